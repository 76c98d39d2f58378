// adakv (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
// Allocation"), over SnapKV's votes: a layer's budget, budget x its K/V heads, is shared by its
// heads instead of split evenly. Each head keeps the observation window; of the rest, each
// first keeps its own best `floor` share of an even split (kvpress's safeguard, so that no head
// is left with nothing but the window), and the remaining cells go to the best votes of the
// whole layer, whichever head cast them: a focused head gives up what a spread one needs.
// `one_shot` as snapkv.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class AdaKvPolicy final : public KvPolicy {
 public:
  AdaKvPolicy(const PluginParams& params, const PluginContext&)
      : w_(ObservationWindow::from(params, "adakv")), floor_(params.real("floor")) {}
  std::int64_t budget() const override { return w_.budget; }
  std::int64_t held_limit() const override { return std::numeric_limits<std::int32_t>::max(); }
  std::int32_t scored_queries() const override { return static_cast<std::int32_t>(w_.window); }

  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    if (!w_.selects(step, w_.budget)) return mark_all(keep);
    std::int64_t cells = 0;
    for (std::int64_t l = 0; l < step.layers; ++l) cells += select_layer(step, keep, l);
    return cells;
  }
  void forget(std::int64_t) override {}

 private:
  // One layer: every head's window and safeguard share, then the layer's best remaining votes.
  std::int64_t select_layer(const KvPolicyStep& step, const KvKeep& keep, std::int64_t layer) {
    const std::int64_t n = step.count(), heads = step.kv_heads;
    const std::int64_t recent = std::min(w_.window, n), older = n - recent;
    const auto guaranteed =
        static_cast<std::int64_t>(std::floor(floor_ * static_cast<double>(w_.budget - w_.window)));
    std::int64_t spare = heads * (w_.budget - recent), cells = 0;
    std::vector<std::vector<double>> votes(static_cast<std::size_t>(heads));
    for (std::int64_t h = 0; h < heads; ++h) {
      votes[static_cast<std::size_t>(h)] = snapkv_votes(step, layer, h, w_.window, w_.kernel);
      const std::int64_t marked = mark_ends_and_top(votes[static_cast<std::size_t>(h)], 0, recent,
                                                    guaranteed, keep.head(layer, h));
      spare -= marked - recent;
      cells += marked;
    }
    // The rest: the best votes of the layer among the cells no head has kept yet.
    std::vector<std::int64_t> candidates;  // h * n + i
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < older; ++i)
        if (keep.head(layer, h)[static_cast<std::size_t>(i)] == 0) candidates.push_back(h * n + i);
    const auto take =
        std::clamp<std::int64_t>(spare, 0, static_cast<std::int64_t>(candidates.size()));
    auto vote = [&](std::int64_t cell) {
      return votes[static_cast<std::size_t>(cell / n)][static_cast<std::size_t>(cell % n)];
    };
    std::nth_element(candidates.begin(), candidates.begin() + take, candidates.end(),
                     [&](std::int64_t a, std::int64_t b) {
                       return vote(a) != vote(b) ? vote(a) > vote(b) : a < b;
                     });
    for (std::int64_t c = 0; c < take; ++c) {
      const std::int64_t cell = candidates[static_cast<std::size_t>(c)];
      keep.head(layer, cell / n)[static_cast<std::size_t>(cell % n)] = 1;
    }
    return cells + take;
  }

  ObservationWindow w_;
  double floor_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer,
     "positions a K/V head keeps on average over its layer's heads, the window included", "256", 2,
     1 << 30},
    {"window", ParamType::param_integer, "the observation window: last queries that vote", "32", 1,
     1 << 20},
    {"kernel", ParamType::param_integer, "max-pooling width over the votes (1: none)", "7", 1,
     1023},
    {"floor", ParamType::param_real,
     "share of an even split each head keeps of its own before the layer's best votes are shared "
     "(kvpress's alpha_safeguard)",
     "0.2", 0, 1},
    {"one_shot", ParamType::param_boolean,
     "compress the prompt once at its end and keep every generated token; false: select again "
     "whenever over budget",
     "false", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, AdaKvPolicy, "adakv",
             "SnapKV's votes with a layer's budget shared by its heads, not split evenly", kParams)
