#pragma once
// What Eigen's Levenberg-Marquardt (unsupported/Eigen/NonLinearOptimization, through
// NumericalDiff) asks of a residual functor: double, sizes known at run time. A functor derives
// from this and adds inputs(), values() and operator()(x, residuals).
#include "kvlab/eigen_core.hpp"

namespace kvlab::sim_detail {

struct DynamicResiduals {
  using Scalar = double;
  using InputType = Eigen::VectorXd;
  using ValueType = Eigen::VectorXd;
  using JacobianType = Eigen::MatrixXd;
  enum { InputsAtCompileTime = Eigen::Dynamic, ValuesAtCompileTime = Eigen::Dynamic };
};

}  // namespace kvlab::sim_detail
