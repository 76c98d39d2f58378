// strided: a KV policy plugin built outside the kvlab tree, the baseline a KV-compression paper
// sets its policy against. A sequence over its budget keeps every stride-th position of its past
// and its most recent ones: half the budget each (the recent half first, so the query's own
// neighbourhood is never lost). `kvlab perplexity --kv-policy strided --kv-param budget=128`
// scores it beside window, streaming_llm, h2o and snapkv; `[kv_policy] name = "strided"` runs it
// in the engine.
#include <algorithm>
#include <vector>

#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class StridedKvPolicy final : public KvPolicy {
 public:
  StridedKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")) {}
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return 0; }  // reads no attention scores
  // step.positions: the sequence's held positions (n), increasing. keep: one row of n bytes
  // per layer and K/V head (keep.head(layer, head)), zeroed; 1 marks a position that head keeps.
  // This policy keeps the same positions in every head: what it drops is freed.
  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    const auto n = static_cast<std::int64_t>(step.positions.size());
    std::vector<std::uint8_t> mark(static_cast<std::size_t>(n), n <= budget_ ? 1 : 0);
    if (n > budget_) {
      const std::int64_t recent = budget_ - budget_ / 2, older = n - recent;
      const std::int64_t strided = budget_ / 2;  // of the older positions, evenly spaced
      for (std::int64_t i = 0; i < strided; ++i) mark[i * older / strided] = 1;
      for (std::int64_t i = older; i < n; ++i) mark[i] = 1;
    }
    std::int64_t cells = 0;
    for (std::int64_t l = 0; l < keep.layers; ++l)
      for (std::int64_t h = 0; h < keep.kv_heads; ++h) {
        std::copy(mark.begin(), mark.end(), keep.head(l, h).begin());
        cells += std::count(mark.begin(), mark.end(), std::uint8_t{1});
      }
    return cells;  // the cells marked
  }
  void forget(std::int64_t) override {}  // keeps nothing per sequence

 private:
  std::int64_t budget_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer,
     "positions a sequence keeps: half its most recent, half strided over the rest", "256", 2,
     1 << 30},
};

}  // namespace

KVLAB_PLUGIN(
    kvlab::PluginKind::kv_policy, StridedKvPolicy, "strided",
    "keep the `budget` / 2 most recent positions and `budget` / 2 evenly spaced older ones",
    kParams)
