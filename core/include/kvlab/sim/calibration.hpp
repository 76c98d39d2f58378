#pragma once
// Fitting a hardware profile's efficiencies and overheads to measured step latencies.
//
// Each sample is a step's work (CostModel::work) and its measured latency. The device peaks
// (measured or datasheet) are the scale; the five efficiencies, two overheads and each kernel
// regime's two efficiencies (the start profile's regimes) are fitted by Levenberg-Marquardt (Eigen)
// on weighted relative errors. Compute efficiencies stay in (0, 1): the start peak is a ceiling
// (the fitted profile keeps it). Memory efficiencies stay positive; one above 1 is folded into the
// bandwidth (it rises, the efficiency becomes 1, every prediction is unchanged): a working set
// that lives in cache beats the DRAM bandwidth the profile states.
#include <span>

#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab {

struct CalibrationSample {
  StepWork work;
  double measured_s = 0;
  double weight = 1;  // of its squared relative error in the fit (> 0)
};

struct CalibrationFit {
  HardwareProfile profile;
  double mean_abs_rel_error = 0;  // over the samples, |predicted - measured| / measured
  double max_abs_rel_error = 0;
  int iterations = 0;
};

// Throws kvlab::Error with fewer samples than fitted parameters, a non-positive latency or a
// non-positive weight. `ungraphed`: also fit ungraphed_step_s, what a step with prefill tokens
// pays beyond step_s (a backend that replays CUDA graphs for decode batches only: the cuda one).
CalibrationFit fit_hardware_profile(const HardwareProfile& start,
                                    std::span<const CalibrationSample> samples,
                                    bool ungraphed = false);

// |predicted - measured| / measured of one sample under `profile`.
double relative_error(const HardwareProfile& profile, const CalibrationSample& sample);

}  // namespace kvlab
