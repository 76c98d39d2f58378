// window: a sequence keeps its `budget` most recent positions (the baseline every KV policy is
// measured against: once the first tokens leave, the attention sinks go with them). The same
// positions in every layer and head: all it drops is freed.
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class WindowKvPolicy final : public KvPolicy {
 public:
  WindowKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")) {}
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return 0; }
  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    std::vector<std::uint8_t> mark(step.positions.size(), 0);
    mark_ends_and_top({}, 0, budget_, 0, mark);
    return mark_every_head(keep, mark);
  }
  void forget(std::int64_t) override {}

 private:
  std::int64_t budget_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer, "positions a sequence keeps: its most recent ones", "256",
     1, 1 << 30},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, WindowKvPolicy, "window",
             "keep the `budget` most recent positions of each sequence", kParams)
