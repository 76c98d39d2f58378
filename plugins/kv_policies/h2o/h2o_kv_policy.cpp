// h2o (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"): a sequence keeps its most recent
// positions and the "heavy hitters", the positions with the most attention accumulated over
// every query that has seen them (summed over layers and heads here: one selection holds for
// all of them); `budget` in all, split by `recent_share`.
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
        recent_(std::llround(static_cast<double>(budget_) * params.real("recent_share"))) {}
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return std::numeric_limits<std::int32_t>::max(); }

  std::int64_t select(const KvPolicyStep& step, std::span<std::int64_t> kept) override {
    Accumulated& held = sequences_[step.sequence];
    accumulate(held, step);
    const std::int64_t count =
        keep_ends_and_top(step.positions, held.scores, 0, recent_, budget_ - recent_, kept);
    held.keep_only({kept.data(), static_cast<std::size_t>(count)});
    return count;
  }
  void forget(std::int64_t sequence) override { sequences_.erase(sequence); }

 private:
  struct Accumulated {  // one sequence's held positions and the attention each has received
    std::vector<std::int64_t> positions;
    std::vector<double> scores;
    void keep_only(std::span<const std::int64_t> kept) {
      std::size_t out = 0;
      for (std::size_t i = 0, k = 0; i < positions.size() && k < kept.size(); ++i) {
        if (positions[i] != kept[k]) continue;
        positions[out] = positions[i];
        scores[out++] = scores[i];
        ++k;
      }
      positions.resize(out);
      scores.resize(out);
    }
  };
  // held := step.positions, each with its earlier sum (0 for a new one) plus this forward's.
  static void accumulate(Accumulated& held, const KvPolicyStep& step) {
    std::vector<double> scores(step.positions.size(), 0.0);
    std::size_t j = 0;
    for (std::size_t i = 0; i < step.positions.size(); ++i) {
      while (j < held.positions.size() && held.positions[j] < step.positions[i]) ++j;
      if (j < held.positions.size() && held.positions[j] == step.positions[i])
        scores[i] = held.scores[j];
      if (!step.scores.empty()) scores[i] += step.scores[i];
    }
    held.positions.assign(step.positions.begin(), step.positions.end());
    held.scores = std::move(scores);
  }

  std::int64_t budget_, recent_;
  std::unordered_map<std::int64_t, Accumulated> sequences_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer, "positions a sequence keeps", "256", 1, 1 << 30},
    {"recent_share", ParamType::param_real,
     "share of the budget for the most recent positions; the rest go to the heavy hitters", "0.5",
     0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, H2oKvPolicy, "h2o",
             "keep the most recent positions and those with the most accumulated attention",
             kParams)
