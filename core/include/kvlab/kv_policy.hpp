#pragma once
// KvPolicy: which cached positions a sequence keeps under a KV budget. A plugin kind
// ("kv_policy"): window, streaming_llm (attention sinks + window), h2o (heavy hitters), snapkv
// (an observation window's votes). Without one, a sequence keeps every position.
//
// After each forward that wrote a sequence's KV, its owner (the engine, kvlab perplexity) calls
// `select` with the positions the sequence now holds, oldest first (this forward's new tokens
// last) and, when the policy asks for them (`scored_queries`), the attention the forward's last
// queries gave each of them, as the backend reports it (ForwardResult::key_scores). The policy
// names the positions to keep, at most `budget` of them; the owner drops the rest from the
// sequence's view, and the allocator frees what they held (kvlab/kv_allocator.hpp: `evict`).
//
// Positions keep their numbers: the cached keys were rotated (RoPE) at the positions they were
// written at, and a query at position p still sees a kept key at its own position, as H2O and
// SnapKV do. (StreamingLLM instead renumbers the cache to stay inside the trained context; for
// texts within the model's context the two differ only in the positions' distances.)
//
// One selection per sequence holds for every layer and head (a slot holds a token's K/V for
// all of them), so scores are summed over layers and query heads. Failures are exceptions only
// inside the plugin: select returns a count, never throws across the boundary.
#include <boost/config.hpp>
#include <cstdint>
#include <span>

namespace kvlab {

struct KvPolicyStep {
  std::int64_t sequence = 0;                // its id: the policy's state for it
  std::span<const std::int64_t> positions;  // held now, increasing, this forward's new ones last
  std::span<const float> scores;            // (positions) attention received this forward, or empty
  std::int64_t new_tokens = 0;  // the last new_tokens of positions were written by this forward
  bool prompt_done = false;     // the forward wrote the prompt's last token
};

class BOOST_SYMBOL_VISIBLE KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  // Positions a sequence keeps after a selection (>= 1).
  virtual std::int64_t budget() const = 0;
  // How many of a forward's last queries per sequence the backend must score
  // (BatchEntry::scored_queries); 0: the policy reads no scores.
  virtual std::int32_t scored_queries() const = 0;
  // Writes the positions to keep, increasing, into kept (room for step.positions.size()) and
  // returns their count: all of them while they fit the budget, at most budget() after.
  virtual std::int64_t select(const KvPolicyStep& step, std::span<std::int64_t> kept) = 0;
  // The sequence ended or lost its KV (preempted by recompute): drop its state.
  virtual void forget(std::int64_t sequence) = 0;
};

}  // namespace kvlab
