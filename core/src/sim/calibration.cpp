#include "kvlab/sim/calibration.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unsupported/Eigen/NonLinearOptimization>
#include <unsupported/Eigen/NumericalDiff>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// Compute efficiencies as logits (bounded by 1), memory efficiencies as logs (a cache-resident
// working set may beat the stated bandwidth), step and sequence overheads in ms.
constexpr int kParameters = 7;
constexpr int kEfficiencies = 5;
constexpr double kPriorWeight = 0.1;

HardwareProfile with_parameters(const HardwareProfile& base, const Eigen::VectorXd& x) {
  HardwareProfile p = base;
  Efficiency& e = p.efficiency;
  auto bounded = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };  // (0, 1): the FMA peak is
                                                                       // a hard ceiling
  e.gemm_compute = bounded(x[0]);
  e.gemm_memory = std::exp(x[1]);
  e.attention_compute = bounded(x[2]);
  e.attention_memory = std::exp(x[3]);
  e.elementwise_memory = std::exp(x[4]);
  p.step_overhead_s = std::abs(x[5]) * 1e-3;  // |.|: overheads cannot be negative
  p.sequence_overhead_s = std::abs(x[6]) * 1e-3;
  return p;
}

double predict(const HardwareProfile& profile, const StepWork& work) {
  return step_cost(work, profile).total();
}

struct Residuals {
  using Scalar = double;
  using InputType = Eigen::VectorXd;
  using ValueType = Eigen::VectorXd;
  using JacobianType = Eigen::MatrixXd;
  enum { InputsAtCompileTime = Eigen::Dynamic, ValuesAtCompileTime = Eigen::Dynamic };

  const HardwareProfile* base;
  std::span<const CalibrationSample> samples;
  Eigen::VectorXd prior;  // the starting efficiencies (parameters 0-4)
  int inputs() const { return kParameters; }
  int values() const { return static_cast<int>(samples.size()) + kEfficiencies; }
  int operator()(const Eigen::VectorXd& x, Eigen::VectorXd& residual) const {
    const HardwareProfile p = with_parameters(*base, x);
    for (std::size_t i = 0; i < samples.size(); ++i)
      residual[static_cast<Eigen::Index>(i)] =
          predict(p, samples[i].work) / samples[i].measured_s - 1.0;
    // A weak pull towards the starting efficiencies: directions the samples cannot tell apart
    // (a constant weight read vs the per-step overhead) stay where they started instead of
    // drifting to absurd values; the samples outweigh it wherever they do tell.
    for (int k = 0; k < kEfficiencies; ++k)
      residual[static_cast<Eigen::Index>(samples.size()) + k] = kPriorWeight * (x[k] - prior[k]);
    return 0;
  }
};

// Folds efficiencies above 1 into the peaks (predictions are unchanged).
void fold_into_peaks(HardwareProfile& p) {
  Efficiency& e = p.efficiency;
  const double compute = std::max({1.0, e.gemm_compute, e.attention_compute});
  const double memory = std::max({1.0, e.gemm_memory, e.attention_memory, e.elementwise_memory});
  p.peak_tflops *= compute;
  e.gemm_compute /= compute;
  e.attention_compute /= compute;
  p.memory_gb_per_s *= memory;
  e.gemm_memory /= memory;
  e.attention_memory /= memory;
  e.elementwise_memory /= memory;
}

}  // namespace

double relative_error(const HardwareProfile& profile, const CalibrationSample& sample) {
  return std::abs(predict(profile, sample.work) - sample.measured_s) / sample.measured_s;
}

CalibrationFit fit_hardware_profile(const HardwareProfile& start,
                                    std::span<const CalibrationSample> samples) {
  if (samples.size() < kParameters)
    throw Error(
        fmt::format("calibration needs at least {} samples, got {}", kParameters, samples.size()));
  for (const auto& s : samples)
    if (!(s.measured_s > 0) || !std::isfinite(s.measured_s))
      throw Error(fmt::format("calibration: a measured latency of {} s", s.measured_s));
  Eigen::VectorXd x(kParameters);
  const Efficiency& e = start.efficiency;
  auto logit = [](double v) {
    v = std::clamp(v, 1e-3, 1 - 1e-3);
    return std::log(v / (1 - v));
  };
  x << logit(e.gemm_compute), std::log(e.gemm_memory), logit(e.attention_compute),
      std::log(e.attention_memory), std::log(e.elementwise_memory),
      std::max(start.step_overhead_s, 1e-5) * 1e3, std::max(start.sequence_overhead_s, 1e-6) * 1e3;

  Residuals residuals{&start, samples, x.head(kEfficiencies)};
  Eigen::NumericalDiff<Residuals> numerical(residuals);
  Eigen::LevenbergMarquardt<Eigen::NumericalDiff<Residuals>> solver(numerical);
  solver.parameters.maxfev = 4000;
  solver.parameters.xtol = 1e-10;
  solver.parameters.ftol = 1e-12;
  solver.minimize(x);

  CalibrationFit fit;
  fit.profile = with_parameters(start, x);
  fold_into_peaks(fit.profile);
  fit.iterations = static_cast<int>(solver.iter);
  for (const auto& s : samples) {
    const double error = relative_error(fit.profile, s);
    fit.mean_abs_rel_error += error;
    fit.max_abs_rel_error = std::max(fit.max_abs_rel_error, error);
  }
  fit.mean_abs_rel_error /= static_cast<double>(samples.size());
  return fit;
}

}  // namespace kvlab
