#pragma once
// Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded RNG,
// so a request's tokens never depend on what else shares its batch.
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvlab/backend.hpp"  // TokenLogprob

namespace kvlab {

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy (argmax, lowest id on ties)
  std::int32_t top_k = 0;    // keep the k most likely tokens; 0 = off
  double top_p = 1.0;        // keep the smallest set whose mass reaches p; 1 = off
  std::uint64_t seed = 0;    // this request's RNG seed
  std::int32_t max_tokens = 16;
  bool ignore_eos = false;  // keep generating past EOS (benchmarks with fixed output lengths)
  // -1: off; k in [0, kMaxLogprobs]: each generated token's log-probability and the k most
  // likely tokens at its position (EngineResult::logprobs), computed where the logits are.
  std::int32_t logprobs = -1;
};

inline constexpr std::int32_t kMaxLogprobs = 20;  // as vLLM's default max_logprobs

// Throws kvlab::Error naming the bad field (negative temperature, top_p outside (0, 1], ...).
void validate_sampling_params(const SamplingParams& params);

// The first position of `logits` holding NaN or +-inf, if any. Sampling assumes finite logits:
// callers check first and report the request and step (a backend that produced NaN is broken).
std::optional<std::size_t> first_non_finite(std::span<const float> logits);

// A generated token's log-probability and the k most likely tokens at its position
// (SamplingParams::logprobs = k).
struct GeneratedLogprobs {
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

// The k most likely tokens under log_softmax(logits) (temperature 1, before any filtering),
// most likely first, lower id first on ties.
std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, std::int32_t k);
// log_softmax(logits)[token].
float token_logprob(std::span<const float> logits, std::int32_t token);
// Both at once (one max and one log-sum-exp): {token_logprob(token), top_logprobs(k)}.
GeneratedLogprobs generated_logprobs(std::span<const float> logits, std::int32_t token,
                                     std::int32_t k);

// The distribution `Sampler::sample` draws from: softmax(logits / temperature), cut to the top
// k, then to the top-p nucleus, renormalised. Zero outside the kept set. Greedy: one-hot.
std::vector<double> sampling_distribution(std::span<const float> logits,
                                          const SamplingParams& params);

// The token `params` picks from one position's logits (vocab) with the draw `uniform` in [0, 1):
// greedy takes the argmax (uniform unused); otherwise the first token, most likely first, whose
// cumulative probability in sampling_distribution exceeds `uniform` (the last kept token when
// rounding leaves it short). A backend that samples on the device picks the same token.
std::int32_t pick_token(std::span<const float> logits, const SamplingParams& params,
                        double uniform);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks the next token from one position's logits (vocab): pick_token with next_uniform().
  // Greedy draws no random number; otherwise exactly one draw from this sampler's RNG per call.
  std::int32_t sample(std::span<const float> logits);
  // This request's next draw, uniform in [0, 1) with 53 random bits: the engine draws it before
  // the forward pass, so the device or the host can pick the token with it.
  double next_uniform();
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;  // fully specified by the standard: same seed, same stream everywhere
};

}  // namespace kvlab
