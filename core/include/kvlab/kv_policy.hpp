#pragma once
// KvPolicy: which cached positions a sequence keeps under a KV budget, in each layer and K/V
// head. A plugin kind ("kv_policy"): window, streaming_llm (attention sinks + window), h2o
// (heavy hitters, per head), snapkv (an observation window's votes, per head), pyramidkv
// (SnapKV's votes under budgets that shrink with depth), adakv (SnapKV's votes under a layer's
// budget shared by its heads). Without one, a sequence keeps every position.
//
// After each forward that wrote a sequence's KV, its owner (the engine, kvlab perplexity) calls
// `select` with the positions the sequence now holds, oldest first (this forward's new tokens
// last) and, when the policy asks for them (`scored_queries`), the attention the forward's last
// queries gave each of them in each layer and K/V head, as the backend reports it
// (ForwardResult::key_scores). The policy marks, for each layer and K/V head, the positions that
// head keeps seeing (KvKeep).
//
// What is freed and what is only hidden: a pool slot holds a token's K and V for every layer
// and head, so the owner keeps the union of what the heads keep (those slots stay held) and
// frees the rest (kvlab/kv_allocator.hpp: `evict`); a position one head keeps and another does
// not stays in memory and is masked out of the other head's attention (BatchEntry::key_mask).
// A policy that keeps the same positions in every head (window, streaming_llm) frees all it
// drops; per-head policies (h2o, snapkv, adakv) and per-layer ones (pyramidkv) hold their
// union, up to held_limit(): kvpress masks the same way, and the papers' own kernels that store
// each head's positions apart are not what a slot-per-token pool can do. With KV groups
// (kvlab/kv/kv_groups.hpp: Gemma 3's local and global layers in slots of their own) each group
// frees what none of its layers keeps, group 0 what no layer keeps.
//
// A layer with a window (Gemma 3's local layers) never shows its heads a position the window
// has passed again: the owner marks those positions as no longer seen (KvPolicyStep::visible),
// so a head's budget goes to what it can still read.
//
// Positions keep their numbers: the cached keys were rotated (RoPE) at the positions they were
// written at, and a query at position p still sees a kept key at its own position, as H2O and
// SnapKV do. (StreamingLLM instead renumbers the cache to stay inside the trained context; for
// texts within the model's context the two differ only in the positions' distances.)
//
// Failures are exceptions only inside the plugin: select returns a count, never throws across
// the boundary.
#include <boost/config.hpp>
#include <cstdint>
#include <span>

namespace kvlab {

struct KvPolicyStep {
  std::int64_t sequence = 0;                // its id: the policy's state for it
  std::span<const std::int64_t> positions;  // (n) held now, increasing, this forward's new last
  // (layers, kv_heads, n) row-major, or empty: the softmax weight the forward's scored queries
  // gave each position, in each layer and K/V head, summed over the queries and over the query
  // heads that read that K/V head.
  std::span<const float> scores;
  // (layers, kv_heads, n) row-major, or empty (every head sees every position): 0 where that
  // head dropped the position at an earlier selection (another head kept it). What a head
  // dropped stays dropped for it: the owner ignores a mark that would bring it back.
  std::span<const std::uint8_t> visible;
  std::int64_t layers = 1, kv_heads = 1;
  std::int64_t new_tokens = 0;  // the last new_tokens of positions were written by this forward
  bool prompt_done = false;     // the forward wrote the prompt's last token

  std::int64_t count() const { return static_cast<std::int64_t>(positions.size()); }
  std::span<const float> head_scores(std::int64_t layer, std::int64_t kv_head) const {
    return scores.subspan(static_cast<std::size_t>((layer * kv_heads + kv_head) * count()),
                          positions.size());
  }
  // Whether that layer's K/V head still sees positions[i].
  bool sees(std::int64_t layer, std::int64_t kv_head, std::int64_t i) const {
    return visible.empty() ||
           visible[static_cast<std::size_t>((layer * kv_heads + kv_head) * count() + i)] != 0;
  }
};

// The policy's choice: (layers, kv_heads, positions) bytes, row-major, zeroed by the owner; the
// policy sets 1 where that layer's K/V head keeps that position.
struct KvKeep {
  std::span<std::uint8_t> cells;
  std::int64_t layers = 1, kv_heads = 1, positions = 0;

  std::span<std::uint8_t> head(std::int64_t layer, std::int64_t kv_head) const {
    return cells.subspan(static_cast<std::size_t>((layer * kv_heads + kv_head) * positions),
                         static_cast<std::size_t>(positions));
  }
};

class BOOST_SYMBOL_VISIBLE KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  // Positions each layer's K/V head keeps after a selection, on average over the layers and
  // heads (>= 1): a sequence over it keeps at most budget() x layers x kv_heads cells.
  virtual std::int64_t budget() const = 0;
  // Most positions a sequence's slots hold after a selection: the union over its layers and
  // heads (budget() for a policy that keeps the same positions everywhere).
  virtual std::int64_t held_limit() const { return budget(); }
  // How many of a forward's last queries per sequence the backend must score
  // (BatchEntry::scored_queries); 0: the policy reads no scores.
  virtual std::int32_t scored_queries() const = 0;
  // Marks the positions each layer's K/V head keeps in `keep`: everything a head sees (always
  // allowed: a sequence within its budget, a one-shot policy's decode steps), or at most
  // budget() x layers x kv_heads cells in all, their union at most held_limit(); at least one
  // per head. Returns the cells marked, or -1 when it failed.
  virtual std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) = 0;
  // The sequence ended or lost its KV (preempted by recompute): drop its state.
  virtual void forget(std::int64_t sequence) = 0;
};

}  // namespace kvlab
