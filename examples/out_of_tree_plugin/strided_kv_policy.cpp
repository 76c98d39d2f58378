// strided: a KV policy plugin built outside the kvlab tree, the baseline a KV-compression paper
// sets its policy against. A sequence over its budget keeps every stride-th position of its past
// and its most recent ones: half the budget each (the recent half first, so the query's own
// neighbourhood is never lost). `kvlab perplexity --kv-policy strided --kv-param budget=128`
// scores it beside window, streaming_llm, h2o and snapkv; `[kv_policy] name = "strided"` runs it
// in the engine.
#include <algorithm>

#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class StridedKvPolicy final : public KvPolicy {
 public:
  StridedKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")) {}
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return 0; }  // reads no attention scores
  // step.positions: the sequence's held positions, increasing; kept: room for budget() of them.
  std::int64_t select(const KvPolicyStep& step, std::span<std::int64_t> kept) override {
    const auto n = static_cast<std::int64_t>(step.positions.size());
    if (n <= budget_) {
      std::copy(step.positions.begin(), step.positions.end(), kept.begin());
      return n;
    }
    const std::int64_t recent = budget_ - budget_ / 2, older = n - recent;
    const std::int64_t strided = budget_ / 2;  // of the older positions, evenly spaced
    std::int64_t k = 0;
    for (std::int64_t i = 0; i < strided; ++i) kept[k++] = step.positions[i * older / strided];
    for (std::int64_t i = older; i < n; ++i) kept[k++] = step.positions[i];
    return k;
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
