#include "kvlab/sim/calibration.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unsupported/Eigen/NonLinearOptimization>
#include <unsupported/Eigen/NumericalDiff>

#include "kvlab/error.hpp"
#include "least_squares.hpp"

namespace kvlab {
namespace {

// Compute efficiencies in (0, 1) (a logistic: the start profile's peak, the FMA probe's or the
// datasheet's, is a ceiling no kernel passes; letting the fit raise it up to 2x, as it once
// could, fitted the same CPU samples within 2 points of mean |error| either way and let it trade
// FLOPs for element-wise traffic, both growing with the tokens, up to peaks 2x the probe), memory
// efficiencies as logs (a cache-resident working set beats the DRAM bandwidth; one above 1 is
// folded into the bandwidth afterwards). Step and sequence overheads in ms; then each kernel
// regime's compute and memory efficiency (gemm regimes, then decode attention regimes). The prior
// pulls on every efficiency, not on the overheads.
constexpr int kBaseParameters = 7;
constexpr int kBaseEfficiencies = 5;
constexpr double kPriorWeight = 0.01;

double bounded(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}
double logit(double v) {
  v = std::clamp(v, 1e-3, 1 - 1e-3);
  return std::log(v / (1 - v));
}

int regime_parameter_end(const HardwareProfile& p) {
  return kBaseParameters +
         2 * static_cast<int>(p.gemm_regimes.size() + p.decode_attention_regimes.size());
}

// The regimes' efficiencies, then (when fitted) the ungraphed step overhead in ms, last.
int parameter_count(const HardwareProfile& p, bool ungraphed) {
  return regime_parameter_end(p) + (ungraphed ? 1 : 0);
}

// Every regime of `p` with its first parameter's index: gemm regimes, then decode attention.
template <typename Profile, typename Visit>
void for_each_regime(Profile& p, Visit&& visit) {
  Eigen::Index i = kBaseParameters;
  for (auto* list : {&p.gemm_regimes, &p.decode_attention_regimes})
    for (auto& regime : *list) {
      visit(regime, i);
      i += 2;
    }
}

HardwareProfile with_parameters(const HardwareProfile& base, const Eigen::VectorXd& x) {
  HardwareProfile p = base;
  Efficiency& e = p.efficiency;
  e.gemm_compute = bounded(x[0]);
  e.gemm_memory = std::exp(x[1]);
  e.attention_compute = bounded(x[2]);
  e.attention_memory = std::exp(x[3]);
  e.elementwise_memory = std::exp(x[4]);
  // A start profile's element-wise kinds (kvlab calibrate --vidur's) keep their ratios to one
  // another: the fit scales them all as it moves elementwise_memory. Floors, knees and waves are
  // the start's, kept as they are.
  for (ElementwiseTerm& t : p.elementwise)
    t.memory *= e.elementwise_memory / base.efficiency.elementwise_memory;
  p.step_overhead_s = std::abs(x[5]) * 1e-3;  // |.|: overheads cannot be negative
  p.sequence_overhead_s = std::abs(x[6]) * 1e-3;
  for_each_regime(p, [&](KernelRegime& r, Eigen::Index i) {
    r.compute = bounded(x[i]);
    r.memory = std::exp(x[i + 1]);
  });
  if (x.size() > regime_parameter_end(base)) p.ungraphed_step_s = std::abs(x[x.size() - 1]) * 1e-3;
  return p;
}

Eigen::VectorXd starting_parameters(const HardwareProfile& start, bool ungraphed) {
  Eigen::VectorXd x(parameter_count(start, ungraphed));
  const Efficiency& e = start.efficiency;
  x.head(kBaseParameters) << logit(e.gemm_compute), std::log(e.gemm_memory),
      logit(e.attention_compute), std::log(e.attention_memory), std::log(e.elementwise_memory),
      std::max(start.step_overhead_s, 1e-5) * 1e3, std::max(start.sequence_overhead_s, 1e-6) * 1e3;
  for_each_regime(start, [&](const KernelRegime& r, Eigen::Index i) {
    x[i] = logit(r.compute);
    x[i + 1] = std::log(r.memory);
  });
  if (ungraphed) x[x.size() - 1] = std::max(start.ungraphed_step_s, 1e-5) * 1e3;
  return x;
}

// Efficiencies: the five base ones and the regimes' (not the overheads, nor the ungraphed one).
bool is_efficiency(Eigen::Index k, Eigen::Index regime_end) {
  return k < kBaseEfficiencies || (k >= kBaseParameters && k < regime_end);
}

// Parameter k's efficiency as a log: compute ones (parameters 0 and 2, and each regime's first)
// are logistic, memory ones logs already. The prior pulls on these, so that a fall from 0.9 to 0.45
// costs what a fall from 0.2 to 0.1 does, on either side.
double log_efficiency(Eigen::Index k, double x) {
  const bool compute = k == 0 || k == 2 || (k >= kBaseParameters && (k - kBaseParameters) % 2 == 0);
  return compute ? std::log(bounded(x)) : x;
}

double predict(const HardwareProfile& profile, const StepWork& work) {
  return step_cost(work, profile).total();
}

struct Residuals : sim_detail::DynamicResiduals {
  const HardwareProfile* base;
  std::span<const CalibrationSample> samples;
  Eigen::VectorXd prior;  // the starting parameters
  Eigen::Index regime_end = 0;
  int inputs() const { return static_cast<int>(prior.size()); }
  int values() const { return static_cast<int>(samples.size() + prior.size()); }
  int operator()(const Eigen::VectorXd& x, Eigen::VectorXd& residual) const {
    const HardwareProfile p = with_parameters(*base, x);
    for (std::size_t i = 0; i < samples.size(); ++i)
      residual[static_cast<Eigen::Index>(i)] =
          std::sqrt(samples[i].weight) *
          (predict(p, samples[i].work) / samples[i].measured_s - 1.0);
    // A weak pull towards the starting efficiencies: directions the samples cannot tell apart
    // (a constant weight read vs the per-step overhead) stay where they started instead of
    // drifting to absurd values; the samples outweigh it wherever they do tell.
    for (Eigen::Index k = 0; k < prior.size(); ++k)
      residual[static_cast<Eigen::Index>(samples.size()) + k] =
          is_efficiency(k, regime_end)
              ? kPriorWeight * (log_efficiency(k, x[k]) - log_efficiency(k, prior[k]))
              : 0.0;
    return 0;
  }
};

// Folds memory efficiencies above 1 into the bandwidth (predictions are unchanged).
void fold_into_bandwidth(HardwareProfile& p) {
  Efficiency& e = p.efficiency;
  double memory = std::max({1.0, e.gemm_memory, e.attention_memory, e.elementwise_memory});
  for_each_regime(
      p, [&](const KernelRegime& r, Eigen::Index) { memory = std::max(memory, r.memory); });
  for (const ElementwiseTerm& t : p.elementwise) memory = std::max(memory, t.memory);
  for (ElementwiseTerm& t : p.elementwise) t.memory /= memory;
  p.memory_gb_per_s *= memory;
  e.gemm_memory /= memory;
  e.attention_memory /= memory;
  e.elementwise_memory /= memory;
  for_each_regime(p, [&](KernelRegime& r, Eigen::Index) { r.memory /= memory; });
}

}  // namespace

double relative_error(const HardwareProfile& profile, const CalibrationSample& sample) {
  return std::abs(predict(profile, sample.work) - sample.measured_s) / sample.measured_s;
}

CalibrationFit fit_hardware_profile(const HardwareProfile& start,
                                    std::span<const CalibrationSample> samples, bool ungraphed) {
  const int parameters = parameter_count(start, ungraphed);
  if (samples.size() < static_cast<std::size_t>(parameters))
    throw Error(
        fmt::format("calibration needs at least {} samples, got {}", parameters, samples.size()));
  for (const auto& s : samples)
    if (!(s.measured_s > 0) || !std::isfinite(s.measured_s))
      throw Error(fmt::format("calibration: a measured latency of {} s", s.measured_s));
    else if (!(s.weight > 0) || !std::isfinite(s.weight))
      throw Error(fmt::format("calibration: a sample weight of {}", s.weight));
  Eigen::VectorXd x = starting_parameters(start, ungraphed);
  Residuals residuals{{}, &start, samples, x, regime_parameter_end(start)};
  Eigen::NumericalDiff<Residuals> numerical(residuals);
  Eigen::LevenbergMarquardt<Eigen::NumericalDiff<Residuals>> solver(numerical);
  solver.parameters.maxfev = 4000;
  solver.parameters.xtol = 1e-10;
  solver.parameters.ftol = 1e-12;
  solver.minimize(x);

  CalibrationFit fit;
  fit.profile = with_parameters(start, x);
  fold_into_bandwidth(fit.profile);
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
