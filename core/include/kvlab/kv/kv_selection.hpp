#pragma once
// What KV policies (kvlab/kv_policy.hpp) share: keeping the ends of a sequence's positions and
// the best-scored of the rest, in one head or in every head alike; SnapKV's pooled votes.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/kv_policy.hpp"
#include "kvlab/plugin_params.hpp"

namespace kvlab {

// Marks in `mark` (one byte per position, zeroed) the `first` oldest and the `recent` newest of
// n = mark.size() positions, and of the others the `top` with the highest `scores` (one per
// position; ties: the older position). Returns the count marked: every position when first +
// recent + top >= n.
std::int64_t mark_ends_and_top(std::span<const double> scores, std::int64_t first,
                               std::int64_t recent, std::int64_t top, std::span<std::uint8_t> mark);

// Every layer's and head's row of `keep` copies `mark` (one byte per position); returns the
// cells marked. A policy that keeps the same positions everywhere.
std::int64_t mark_every_head(const KvKeep& keep, std::span<const std::uint8_t> mark);

// The step's scores summed over its layers and heads, one per position (zeros when it has none):
// one vote per position for a policy that selects for the whole sequence.
std::vector<double> summed_scores(const KvPolicyStep& step);

// Each value replaced by the maximum over the `kernel` values centred on it (SnapKV's pooling,
// which keeps a chosen position's neighbours with it); kernel 1 leaves them as they are.
void max_pool(std::span<double> values, std::int64_t kernel);

// SnapKV's votes of one layer's K/V head: its scores of the positions before the last `window`
// (the observation window's own are 0), max-pooled over `kernel`; -infinity for a position the
// head no longer sees (KvPolicyStep::visible).
std::vector<double> snapkv_votes(const KvPolicyStep& step, std::int64_t layer, std::int64_t kv_head,
                                 std::int64_t window, std::int64_t kernel);

// SnapKV in one layer's K/V head: marks the last `window` positions and the `keep - window`
// others with the best snapkv_votes (all of them when n <= keep); returns the count marked.
std::int64_t snapkv_mark(const KvPolicyStep& step, std::int64_t layer, std::int64_t kv_head,
                         std::int64_t window, std::int64_t kernel, std::int64_t keep,
                         std::span<std::uint8_t> mark);

// Marks every position in every head (a policy that keeps all it holds); returns the cells.
std::int64_t mark_all(const KvKeep& keep);

// What the observation-window policies (snapkv, pyramidkv, adakv) share: their parameters
// `budget`, `window`, `kernel` and `one_shot`, and when they select.
struct ObservationWindow {
  std::int64_t budget = 0, window = 0, kernel = 1;
  bool one_shot = false;

  // Throws std::invalid_argument naming `policy` when the window is not below the budget.
  static ObservationWindow from(const PluginParams& params, const char* policy);
  // One shot: in the forward that ends the prompt only; else whenever the sequence holds more
  // than `keep` positions.
  bool selects(const KvPolicyStep& step, std::int64_t keep) const {
    return one_shot ? step.prompt_done : step.count() > keep;
  }
};

}  // namespace kvlab
