// snapkv (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): the
// attention of the forward's last `window` queries (the observation window) votes for the older
// positions in each layer's K/V head; pooled over `kernel` neighbours, each head keeps its
// best-voted with the window itself, `budget` in all. `one_shot = true` is the paper's protocol:
// the prompt is compressed once, by the forward that writes its last token (its last `window`
// tokens, the question, vote), and every generated token is kept after it. `one_shot = false`
// selects again the same way whenever the sequence outgrows the budget (a decode step, a
// streamed chunk), as a bounded cache needs. `per_head = false` sums the votes over layers and
// heads: one set for the sequence, all it drops freed.
#include <limits>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class SnapKvPolicy final : public KvPolicy {
 public:
  SnapKvPolicy(const PluginParams& params, const PluginContext&)
      : w_(ObservationWindow::from(params, "snapkv")), per_head_(params.boolean("per_head")) {}
  std::int64_t budget() const override { return w_.budget; }
  // One shot: generated tokens are all kept (no bound); per head: the window and each head's
  // choice (their union is bounded by the positions only).
  std::int64_t held_limit() const override {
    return w_.one_shot || per_head_ ? std::numeric_limits<std::int32_t>::max() : w_.budget;
  }
  std::int32_t scored_queries() const override { return static_cast<std::int32_t>(w_.window); }

  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    if (!w_.selects(step, w_.budget)) return mark_all(keep);
    if (!per_head_) {
      std::vector<double> votes = summed_scores(step);
      const std::int64_t recent = std::min(w_.window, step.count());
      max_pool(std::span<double>(votes).first(votes.size() - static_cast<std::size_t>(recent)),
               w_.kernel);
      std::vector<std::uint8_t> mark(step.positions.size(), 0);
      mark_ends_and_top(votes, 0, recent, w_.budget - recent, mark);
      return mark_every_head(keep, mark);
    }
    std::int64_t cells = 0;
    for (std::int64_t l = 0; l < step.layers; ++l)
      for (std::int64_t h = 0; h < step.kv_heads; ++h)
        cells += snapkv_mark(step, l, h, w_.window, w_.kernel, w_.budget, keep.head(l, h));
    return cells;
  }
  void forget(std::int64_t) override {}

 private:
  ObservationWindow w_;
  bool per_head_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer,
     "positions each layer's K/V head keeps, the window included", "256", 2, 1 << 30},
    {"window", ParamType::param_integer, "the observation window: last queries that vote", "32", 1,
     1 << 20},
    {"kernel", ParamType::param_integer, "max-pooling width over the votes (1: none)", "7", 1,
     1023},
    {"per_head", ParamType::param_boolean,
     "each layer's K/V head keeps its own choice (false: one set, votes summed)", "true", 0, 1},
    {"one_shot", ParamType::param_boolean,
     "compress the prompt once at its end and keep every generated token (the paper's protocol); "
     "false: select again whenever over budget",
     "false", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, SnapKvPolicy, "snapkv",
             "keep the observation window and the positions it attends to most, per head", kParams)
