#pragma once
// kvlab check for requests that ask for log-probabilities (workload.logprobs = k): the engine's
// (computed where it picked each token: the CPU backend's rows, a GPU's device kernel) against
// the reference's log_softmax at the same position (teacher forcing). Each of the engine's
// values must be within a tolerance of the reference's for the same token; its top k must be
// the reference's top k up to ties within that tolerance.
#include <cstdint>
#include <string>

#include "kvlab/engine/sampling.hpp"

namespace kvlab {

// The tolerance on a log-probability in kvlab check. Exact settings: 1e-3. A logprob is
// logit - log-sum-exp, so if every logit is within delta of the reference's it is within
// 2 x delta; measured delta of exact settings is at most 1.7e-4 (SmolLM2 Q4_1 blocks multiplied
// in f32; 1.8e-6 for stories15m), so 1e-3 leaves ~3x (the largest logprob error measured:
// 2.1e-4, experiments/real_model_check.toml). With --tolerance TAU (>= 2 x delta by its own
// rule) TAU itself, when larger.
double logprob_tolerance(double check_tolerance);

struct LogprobAgreement {
  std::int64_t tokens = 0;   // generated tokens whose log-probabilities were compared
  std::int64_t entries = 0;  // top-k entries compared beside them
  double max_abs_delta = 0;  // over both: max |engine - reference|

  // One position: `engine` as the engine reported it (the chosen token's, its top k); `reference`
  // the reference's for the same token with its top kMaxLogprobs. Returns "" when they agree
  // within `tolerance`, else what differs (token ids and values).
  std::string add(const GeneratedLogprobs& engine, const GeneratedLogprobs& reference,
                  double tolerance);
  void merge(const LogprobAgreement& other);
};

}  // namespace kvlab
