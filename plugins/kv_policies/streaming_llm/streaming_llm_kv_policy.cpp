// streaming_llm (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
// a sequence keeps its first `sinks` positions, where softmax parks the attention no other token
// needs, and its most recent ones, `budget` in all: the same in every layer and head, so all it
// drops is freed.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class StreamingLlmKvPolicy final : public KvPolicy {
 public:
  StreamingLlmKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")), sinks_(params.integer("sinks")) {
    if (sinks_ >= budget_)
      throw std::invalid_argument(
          "streaming_llm: sinks must be below the budget, leaving room "
          "for recent positions");
  }
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return 0; }
  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    std::vector<std::uint8_t> mark(step.positions.size(), 0);
    mark_ends_and_top({}, sinks_, budget_ - sinks_, 0, mark);
    return mark_every_head(keep, mark);
  }
  void forget(std::int64_t) override {}

 private:
  std::int64_t budget_, sinks_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer, "positions a sequence keeps, sinks included", "256", 2,
     1 << 30},
    {"sinks", ParamType::param_integer, "first positions always kept (the attention sinks)", "4", 0,
     1 << 20},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, StreamingLlmKvPolicy, "streaming_llm",
             "keep the first `sinks` positions and the most recent ones, `budget` in all", kParams)
