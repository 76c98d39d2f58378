#pragma once
// Fitting a hardware profile's efficiencies and overheads to measured step latencies.
//
// Each sample is a step's work (CostModel::work) and its measured latency. The device peaks stay
// as given (measured or datasheet); the five efficiencies and two overheads are fitted by
// Levenberg-Marquardt (Eigen) on relative errors. Compute efficiencies stay in (0, 1) (the
// FMA/tensor-core peak is a ceiling); memory efficiencies stay positive, and one above 1 (a
// working set that lives in cache beats the DRAM bandwidth the profile states) is folded into
// the bandwidth: it rises, the efficiency becomes 1, and every prediction is unchanged.
#include <span>

#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab {

struct CalibrationSample {
  StepWork work;
  double measured_s = 0;
};

struct CalibrationFit {
  HardwareProfile profile;
  double mean_abs_rel_error = 0;  // over the samples, |predicted - measured| / measured
  double max_abs_rel_error = 0;
  int iterations = 0;
};

// Throws kvlab::Error with fewer samples than fitted parameters or a non-positive latency.
CalibrationFit fit_hardware_profile(const HardwareProfile& start,
                                    std::span<const CalibrationSample> samples);

// |predicted - measured| / measured of one sample under `profile`.
double relative_error(const HardwareProfile& profile, const CalibrationSample& sample);

}  // namespace kvlab
