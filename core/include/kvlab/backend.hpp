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
  // Greedy sampling where the logits are (a GPU): while enabled, forward() returns no logits
  // and chosen_tokens() each entry's argmax (the lowest id on ties, as the host Sampler picks;
  // -1 for a row holding NaN or +-inf), so token ids cross to the host instead of (entries x
  // vocab) floats. The engine enables it on steps whose sampling entries are all greedy and
  // whose logits nobody reads. Returns whether the backend does as asked (the default: no).
  virtual bool choose_greedy_tokens(bool enable) {
    (void)enable;
    return false;
  }
};

}  // namespace kvlab
