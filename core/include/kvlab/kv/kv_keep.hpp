#pragma once
// The owner's side of a KV policy's choice (kvlab/kv_policy.hpp: KvKeep), shared by the engine
// (KvPolicyRunner) and kvlab perplexity: the choice checked against the policy's promises, the
// union of what the heads keep (the slots that stay held), each head's view of that union (the
// backend's key mask), and what a run held and saw on average.
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kvlab/kv_policy.hpp"

namespace kvlab {

// One sequence's positions after a selection.
struct HeadSelection {
  std::vector<std::int64_t> positions;  // (kept) the union over layers and heads, increasing
  // (layers, kv_heads, kept) row-major, 1 where that head sees the position; empty when every
  // head sees every kept position (nothing is masked)
  std::vector<std::uint8_t> visible;
  std::int64_t layers = 1, kv_heads = 1;
  std::int64_t cells = 0;  // (layer, head, position) triples seen

  std::int64_t held() const { return static_cast<std::int64_t>(positions.size()); }
  // Positions a head sees, on average over the layers and heads.
  double seen_per_head() const {
    return static_cast<double>(cells) / static_cast<double>(layers * kv_heads);
  }
};

// Checks `keep` (what `policy` marked for `step`, `returned` its answer) against the policy's
// promises and returns what the sequence keeps, a mark on a position the head no longer sees
// (step.visible) undone; throws kvlab::Error naming `policy_name` when the
// policy failed or broke one (a head with nothing kept, more cells than its budget, a union
// beyond held_limit()).
HeadSelection kept_by_policy(const KvPolicy& policy, std::string_view policy_name,
                             const KvPolicyStep& step, const KvKeep& keep, std::int64_t returned);

// Fills `mask` with the key mask of a view (BatchEntry::key_mask): (layers, kv_heads,
// view_positions.size()), each view position's bit in `kept` where kept holds it, 1 for the
// others and for every position from `new_from` on (a forward's new tokens: a query always sees
// its own key). Empty when nothing is masked.
void key_mask_for(const HeadSelection& kept, std::span<const std::int64_t> view_positions,
                  std::int64_t new_from, std::vector<std::uint8_t>& mask);

// Hides from each layer's K/V heads the positions its window will never show again (Gemma 3's
// local layers, a sliding window): after a forward whose newest position is positions.back(),
// the next query sees keys from positions.back() + 2 - window on (the newest always). `visible`
// is (layers, kv_heads, positions.size()), or empty when every head sees every position; it is
// filled in when a window hides one. `layer_windows`: (layers) each layer's window, or empty.
void hide_outside_windows(std::span<const std::optional<std::int64_t>> layer_windows,
                          std::int64_t kv_heads, std::span<const std::int64_t> positions,
                          std::vector<std::uint8_t>& visible);

// What each KV group keeps (KvGroupDropping): group g the union of what its layers' heads keep
// (group_of_layer: (layers) each layer's group), group 0 the union over every layer
// (kept.positions), so that it holds every other group's.
std::vector<std::vector<std::int64_t>> kept_per_group(const HeadSelection& kept,
                                                      std::span<const std::int64_t> group_of_layer,
                                                      std::int64_t groups);

// What the selections of a run held and saw, averaged over those that dropped something.
struct KvKeepStats {
  std::int64_t selections = 0;
  // sums: positions held (the union; with KV groups, the mean over the groups of what each
  // group's slots hold), positions a head saw, positions the full cache would hold (every one
  // written so far: the newest + 1)
  double held = 0, seen = 0, full = 0;

  void add(const HeadSelection& kept, std::int64_t written) {
    add(kept, written, static_cast<double>(kept.held()));
  }
  void add(const HeadSelection& kept, std::int64_t written, double held_positions) {
    ++selections;
    held += held_positions;
    seen += kept.seen_per_head();
    full += static_cast<double>(written);
  }
  double mean_held() const { return selections == 0 ? 0 : held / static_cast<double>(selections); }
  double mean_seen() const { return selections == 0 ? 0 : seen / static_cast<double>(selections); }
  // The share of the full cache's positions the slots held: 1 when nothing was dropped.
  double held_fraction() const { return full == 0 ? 1 : held / full; }
};

}  // namespace kvlab
