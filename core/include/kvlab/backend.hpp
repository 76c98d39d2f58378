#pragma once
// Backend: runs the forward pass over a mixed batch. Implementations: the CPU backend
// (cpu_reference/), the simulated backend (core, a cost model), the CUDA backend (a plugin).
#include <boost/config.hpp>
#include <cstdint>
#include <span>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

// One sequence's share of a batch: `tokens` sit at positions [start_position, + size()).
// `view` must already map every position up to start_position + size() (the allocator gave the
// new tokens their slots) and back to the oldest position attention needs.
struct BatchEntry {
  std::span<const std::int32_t> tokens;
  std::int64_t start_position = 0;
  KvView view;
  // false: the entry's K/V are computed but not stored (a static batch's padding rows: pad
  // tokens whose logits are discarded, their views mapping the request's own cached slots and,
  // past what it holds, any pool slots): the backend attends to the cache as it is and leaves
  // every slot of the view as it is (vLLM's padding slot), so a discarded row never reaches a
  // cached block, nor another sequence's.
  bool writes_kv = true;
};

// How one batch entry's next token is picked (Backend::choose_tokens): the request's
// SamplingParams filters and this step's draw from its RNG.
struct TokenChoice {
  double temperature = 0;  // 0: the argmax, lowest id on ties (uniform unused)
  double top_p = 1;        // 1: off
  double uniform = 0;      // the draw, in [0, 1)
  std::int32_t top_k = 0;  // 0: off
  // -1: no log-probabilities; k >= 0: the chosen token's and the k most likely tokens'
  // (Backend::chosen_logprobs), as kvlab::token_logprob and kvlab::top_logprobs compute them.
  std::int32_t logprobs = -1;
};

struct TokenLogprob {
  std::int32_t token = 0;
  float logprob = 0;  // natural log of the model's probability (softmax of the raw logits)
};

// How a backend's forwards ran so far (Backend::counters), for a run's report.
struct BackendCounters {
  std::int64_t graph_captures = 0;  // CUDA graphs captured (the cuda backend's decode steps)
  std::int64_t graph_replays = 0;   // forwards that replayed one instead of launching each kernel
};

class BOOST_SYMBOL_VISIBLE Backend {
 public:
  virtual ~Backend() = default;
  // Writes each new token's K/V into its slot; returns logits (entries, vocab) row-major for
  // the last token of each entry, valid until the next call.
  virtual std::span<const float> forward(std::span<const BatchEntry> batch) = 0;
  virtual std::int64_t vocab_size() const = 0;
  // Backends without logits (the simulated one) choose each entry's next token themselves:
  // after forward() they return one token per entry here and forward() returns no logits.
  // Empty (the default): the engine samples the logits.
  virtual std::span<const std::int32_t> chosen_tokens() const { return {}; }
  // Sampling where the logits are (a GPU): given one choice per entry of the next forward(), in
  // batch order, that forward() returns no logits and chosen_tokens() each entry's token, picked
  // as kvlab::pick_token picks it from the same row (kvlab/engine/sampling.hpp), or -1 for a row
  // holding NaN or +-inf. Token ids cross to the host instead of (entries x vocab) floats. The
  // engine offers it before every forward whose logits nobody reads. Applies to that forward
  // only; returns whether the backend does as asked (the default: no, and it is not asked again).
  virtual bool choose_tokens(std::span<const TokenChoice> choices) {
    (void)choices;
    return false;
  }
  // After a forward whose choices (choose_tokens) asked for log-probabilities (some logprobs
  // >= 0): (entries, 1 + K) row-major, K the largest logprobs asked. Row e: the chosen token and
  // its log-probability under softmax(logits) (temperature 1, before any filtering), then the
  // k_e most likely tokens, most likely first, the lower id first among equals; {-1, NaN} fill
  // the rest (and the whole row of a non-finite row). Empty when none was asked. A backend that
  // cannot compute them declines choose_tokens for such a step.
  virtual std::span<const TokenLogprob> chosen_logprobs() const { return {}; }
  // Totals since the backend was made (zeros where a backend has nothing to count).
  virtual BackendCounters counters() const { return {}; }
};

}  // namespace kvlab
