// h2o (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"): each layer's K/V head keeps the most
// recent positions and its own "heavy hitters", the positions with the most attention
// accumulated over every query that has seen them, `budget` in all, split by `recent_share`.
// Per head as the paper does; `per_head = false` sums the scores over layers and heads and keeps
// one set for the whole sequence (then all it drops is freed: per head, the slots hold the union
// of the heads' choices and each head is masked to its own).
#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class H2oKvPolicy final : public KvPolicy {
 public:
  H2oKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")),
        recent_(std::llround(static_cast<double>(budget_) * params.real("recent_share"))),
        per_head_(params.boolean("per_head")) {}
  std::int64_t budget() const override { return budget_; }
  // Per head: the recent positions, and each head's heavy hitters (their union unbounded by the
  // budget: a long sequence may keep most positions somewhere).
  std::int64_t held_limit() const override {
    return per_head_ ? std::numeric_limits<std::int32_t>::max() : budget_;
  }
  std::int32_t scored_queries() const override { return std::numeric_limits<std::int32_t>::max(); }

  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    Accumulated& held = sequences_[step.sequence];
    const std::int64_t heads = per_head_ ? step.layers * step.kv_heads : 1;
    accumulate(held, step, heads);
    const std::int64_t n = step.count();
    std::int64_t cells = 0;
    std::vector<std::uint8_t> mark(static_cast<std::size_t>(n));
    std::vector<double> scores(static_cast<std::size_t>(n));
    for (std::int64_t h = 0; h < heads; ++h) {
      std::fill(mark.begin(), mark.end(), std::uint8_t{0});
      const std::span<const double> sums = held.head(h, n);
      for (std::int64_t i = 0; i < n; ++i)  // what the head dropped ranks last
        scores[static_cast<std::size_t>(i)] =
            !per_head_ || step.sees(h / step.kv_heads, h % step.kv_heads, i)
                ? sums[static_cast<std::size_t>(i)]
                : -std::numeric_limits<double>::infinity();
      mark_ends_and_top(scores, 0, recent_, budget_ - recent_, mark);
      if (!per_head_) return mark_every_head(keep, mark);
      const std::span<std::uint8_t> row = keep.head(h / step.kv_heads, h % step.kv_heads);
      std::copy(mark.begin(), mark.end(), row.begin());
      cells += std::count(mark.begin(), mark.end(), std::uint8_t{1});
    }
    held.drop_unmarked(keep, heads);
    return cells;
  }
  void forget(std::int64_t sequence) override { sequences_.erase(sequence); }

 private:
  // One sequence's held positions and the attention each has received in each scored head
  // (heads, positions) row-major: one head of sums when the scores are summed.
  struct Accumulated {
    std::vector<std::int64_t> positions;
    std::vector<double> scores;
    std::span<const double> head(std::int64_t h, std::int64_t n) const {
      return std::span<const double>(scores).subspan(static_cast<std::size_t>(h * n),
                                                     static_cast<std::size_t>(n));
    }
    // Keeps the positions some head kept; a head's sums of the others it no longer sees stay
    // (it never reads them again: zero from now on would do, the stale sum only ranks them).
    void drop_unmarked(const KvKeep& keep, std::int64_t heads) {
      const std::size_t n = positions.size();
      std::vector<bool> any(n, false);
      for (std::size_t row = 0; row < static_cast<std::size_t>(keep.layers * keep.kv_heads); ++row)
        for (std::size_t i = 0; i < n; ++i) any[i] = any[i] || keep.cells[row * n + i] != 0;
      const auto kept = static_cast<std::size_t>(std::count(any.begin(), any.end(), true));
      std::vector<std::int64_t> new_positions;
      std::vector<double> new_scores(kept * static_cast<std::size_t>(heads));
      for (std::size_t i = 0, k = 0; i < n; ++i) {
        if (!any[i]) continue;
        new_positions.push_back(positions[i]);
        for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h)
          new_scores[h * kept + k] = scores[h * n + i];
        ++k;
      }
      positions = std::move(new_positions);
      scores = std::move(new_scores);
    }
  };
  // held := step.positions, each with its earlier sums (0 for a new one) plus this forward's.
  static void accumulate(Accumulated& held, const KvPolicyStep& step, std::int64_t heads) {
    const auto n = static_cast<std::size_t>(step.count()), before = held.positions.size();
    std::vector<double> scores(n * static_cast<std::size_t>(heads), 0.0);
    std::size_t j = 0;
    for (std::size_t i = 0; i < n; ++i) {
      while (j < before && held.positions[j] < step.positions[i]) ++j;
      if (j < before && held.positions[j] == step.positions[i])
        for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h)
          scores[h * n + i] = held.scores[h * before + j];
    }
    if (!step.scores.empty()) {
      const std::vector<double> summed = heads == 1 ? summed_scores(step) : std::vector<double>();
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::size_t i = 0; i < n; ++i)
          scores[static_cast<std::size_t>(h) * n + i] +=
              heads == 1 ? summed[i] : step.head_scores(h / step.kv_heads, h % step.kv_heads)[i];
    }
    held.positions.assign(step.positions.begin(), step.positions.end());
    held.scores = std::move(scores);
  }

  std::int64_t budget_, recent_;
  bool per_head_;
  std::unordered_map<std::int64_t, Accumulated> sequences_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer, "positions each layer's K/V head keeps", "256", 1,
     1 << 30},
    {"recent_share", ParamType::param_real,
     "share of the budget for the most recent positions; the rest go to the heavy hitters", "0.5",
     0, 1},
    {"per_head", ParamType::param_boolean,
     "each layer's K/V head keeps its own heavy hitters (false: one set for the sequence, the "
     "scores summed over layers and heads)",
     "true", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, H2oKvPolicy, "h2o",
             "keep the most recent positions and each head's most attended ones", kParams)
