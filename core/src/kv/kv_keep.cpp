#include "kvlab/kv/kv_keep.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// The union of the heads' rows, and the fewest any head keeps; a mark on a position the head
// no longer sees (step.visible) is undone first.
void union_of_heads(const KvPolicyStep& step, const KvKeep& keep, std::vector<std::uint8_t>& any,
                    std::int64_t& cells, std::int64_t& fewest) {
  any.assign(static_cast<std::size_t>(keep.positions), 0);
  cells = 0;
  fewest = keep.positions;
  for (std::int64_t l = 0; l < keep.layers; ++l)
    for (std::int64_t h = 0; h < keep.kv_heads; ++h) {
      const std::span<std::uint8_t> row = keep.head(l, h);
      std::int64_t kept = 0;
      for (std::size_t i = 0; i < row.size(); ++i) {
        row[i] = row[i] != 0 && step.sees(l, h, static_cast<std::int64_t>(i));
        any[i] |= row[i];
        kept += row[i];
      }
      cells += kept;
      fewest = std::min(fewest, kept);
    }
}

}  // namespace

HeadSelection kept_by_policy(const KvPolicy& policy, std::string_view policy_name,
                             const KvPolicyStep& step, const KvKeep& keep, std::int64_t returned) {
  std::int64_t marked = 0;
  for (const std::uint8_t cell : keep.cells) marked += cell != 0;
  std::vector<std::uint8_t> any;
  std::int64_t cells = 0, fewest = 0;
  union_of_heads(step, keep, any, cells, fewest);
  const std::int64_t n = step.count(), heads = keep.layers * keep.kv_heads;
  HeadSelection kept;
  kept.layers = keep.layers;
  kept.kv_heads = keep.kv_heads;
  kept.cells = cells;
  for (std::int64_t i = 0; i < n; ++i)
    if (any[static_cast<std::size_t>(i)] != 0)
      kept.positions.push_back(step.positions[static_cast<std::size_t>(i)]);
  const std::int64_t limit = std::max(policy.held_limit(), policy.budget());
  const std::int64_t seen =
      step.visible.empty() ? n * heads : std::count(step.visible.begin(), step.visible.end(), 1);
  const bool drops = cells < seen;  // keeping all it sees is always allowed (one_shot's decode)
  if (returned != marked || fewest < 1 ||
      (drops && (cells > std::min(n, policy.budget()) * heads ||
                 (n > policy.budget() && kept.held() > limit))))
    throw Error(fmt::format(
        "KV policy \"{}\" kept {} (layer, head, position) cells of sequence {}'s {} positions "
        "and said {}; the fewest a head kept is {}, their union {} positions (budget {} a head, "
        "{} layers x {} K/V heads, held limit {}): a policy keeps at least one position in "
        "every head, at most budget x layers x heads cells once over its budget, a union "
        "within its held limit, and says how many it kept",
        policy_name, marked, step.sequence, n, returned, fewest, kept.held(), policy.budget(),
        keep.layers, keep.kv_heads, limit));
  if (cells == kept.held() * heads) return kept;  // every head sees the whole union
  kept.visible.reserve(static_cast<std::size_t>(heads * kept.held()));
  for (std::int64_t l = 0; l < keep.layers; ++l)
    for (std::int64_t h = 0; h < keep.kv_heads; ++h) {
      const std::span<std::uint8_t> row = keep.head(l, h);
      for (std::int64_t i = 0; i < n; ++i)
        if (any[static_cast<std::size_t>(i)] != 0)
          kept.visible.push_back(row[static_cast<std::size_t>(i)]);
    }
  return kept;
}

void key_mask_for(const HeadSelection& kept, std::span<const std::int64_t> view_positions,
                  std::int64_t new_from, std::vector<std::uint8_t>& mask) {
  mask.clear();
  if (kept.visible.empty()) return;
  const std::size_t n = view_positions.size(), held = kept.positions.size();
  mask.assign(static_cast<std::size_t>(kept.layers * kept.kv_heads) * n, 1);
  std::size_t j = 0;
  for (std::size_t i = 0; i < n; ++i) {  // view position i is kept position j, or new
    while (j < held && kept.positions[j] < view_positions[i]) ++j;
    if (j == held || kept.positions[j] != view_positions[i] || view_positions[i] >= new_from)
      continue;
    for (std::size_t row = 0; row < static_cast<std::size_t>(kept.layers * kept.kv_heads); ++row)
      mask[row * n + i] = kept.visible[row * held + j];
  }
}

void hide_outside_windows(std::span<const std::optional<std::int64_t>> layer_windows,
                          std::int64_t kv_heads, std::span<const std::int64_t> positions,
                          std::vector<std::uint8_t>& visible) {
  if (positions.empty()) return;
  const std::size_t n = positions.size(), heads = static_cast<std::size_t>(kv_heads);
  const std::int64_t newest = positions.back();
  for (std::size_t l = 0; l < layer_windows.size(); ++l) {
    if (!layer_windows[l]) continue;
    const std::int64_t first_seen = std::min(newest, newest + 2 - *layer_windows[l]);
    const auto hidden = static_cast<std::size_t>(
        std::lower_bound(positions.begin(), positions.end(), first_seen) - positions.begin());
    if (hidden == 0) continue;
    if (visible.empty()) visible.assign(layer_windows.size() * heads * n, 1);
    for (std::size_t row = l * heads; row < (l + 1) * heads; ++row)  // (layer, K/V head) rows
      std::fill_n(visible.begin() + static_cast<std::ptrdiff_t>(row * n), hidden, std::uint8_t{0});
  }
}

std::vector<std::vector<std::int64_t>> kept_per_group(const HeadSelection& kept,
                                                      std::span<const std::int64_t> group_of_layer,
                                                      std::int64_t groups) {
  const std::size_t held = kept.positions.size(), heads = static_cast<std::size_t>(kept.kv_heads);
  std::vector<std::vector<std::uint8_t>> any(static_cast<std::size_t>(groups),
                                             std::vector<std::uint8_t>(held, 0));
  for (std::size_t l = 0; l < group_of_layer.size(); ++l) {
    std::vector<std::uint8_t>& group = any[static_cast<std::size_t>(group_of_layer[l])];
    for (std::size_t row = l * heads; row < (l + 1) * heads; ++row)
      for (std::size_t i = 0; i < held; ++i)
        group[i] |= kept.visible.empty() || kept.visible[row * held + i] != 0;
  }
  std::vector<std::vector<std::int64_t>> per_group(static_cast<std::size_t>(groups));
  per_group[0] = kept.positions;  // every position some layer keeps
  for (std::size_t g = 1; g < per_group.size(); ++g)
    for (std::size_t i = 0; i < held; ++i)
      if (any[g][i] != 0) per_group[g].push_back(kept.positions[i]);
  return per_group;
}

}  // namespace kvlab
