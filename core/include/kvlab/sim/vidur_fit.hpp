#pragma once
// Fitting a hardware profile's kernel terms to Vidur's measured operators, and validating the
// cost model against them (kvlab calibrate --vidur; docs/concepts/simulated-backend.md).
//
// Every operator is priced as the simulator prices it (CostModel::breakdown): a kernel of compute
// time c = FLOPs / (peak x e_compute) and memory time m = bytes / (bandwidth x e_memory) takes
// floor + (c^k + m^k)^(1/k). The fit, by Levenberg-Marquardt (Eigen) on relative errors, finds:
//   gemm         e_compute, e_memory, floor, knee: the four projections of the fit models, every
//                token count and tensor parallelism (the LM head is priced by them, unmeasured)
//   attention    e_compute, e_memory shared, a floor and knee each for prefill and decode: the
//                attention excerpt of one model (A100 only; an H100 carries the A100's terms)
//   elementwise  each kind's e_memory and floor (RMSNorm from both norms; the K/V write, which
//                Vidur's mlp.csv lacks, carries the residual add's: both are plain copies)
//   all-reduce   latency and bus bandwidth for each group size of one node
// The datasheet peaks of the start profile are the scale; its overheads, memory and links are
// kept (Vidur measured kernels, not a serving loop's host time).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/sim/vidur_data.hpp"

namespace kvlab {

struct VidurFitOptions {
  std::vector<std::string> fit_models;  // the layer terms are fitted on these; the rest held out
  std::string attention_model;          // the excerpt attention is fitted on ("": keep start's)
};

// One measurement against the cost model's price for it.
struct VidurPoint {
  std::string model;
  bool held_out = false;  // not among the models its terms were fitted on
  std::string kind;  // operator, layer, attention_decode, attention_prefill, layer_with_attention,
                     // all_reduce
  std::string name;  // the operator (Vidur's column), or the kind again
  std::int64_t tensor_parallel = 1;  // all_reduce: the GPUs
  std::int64_t tokens = 0;           // layer rows; attention: decode batch or prefill chunk
  std::int64_t kv_cache = 0;         // attention: keys cached
  double bytes = 0;                  // all_reduce: the message
  double measured_s = 0, predicted_s = 0;
  double error() const { return predicted_s / measured_s - 1; }
};

// The start profile with every term above fitted, its [provenance] saying where each came from.
HardwareProfile fit_vidur_profile(const VidurData& data, const HardwareProfile& start,
                                  const VidurFitOptions& options);

// Every measurement of `data` priced under `profile`: each operator of each mlp.csv row, the
// layer they make (Vidur's sum: the nine operators but the embedding), each attention row alone
// and with its layer (the mlp row of as many tokens, tensor parallelism 1), each all-reduce.
std::vector<VidurPoint> vidur_validation(const VidurData& data, const HardwareProfile& profile,
                                         const VidurFitOptions& options);

}  // namespace kvlab
