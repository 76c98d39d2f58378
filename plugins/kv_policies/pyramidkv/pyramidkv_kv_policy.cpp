// pyramidkv (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
// Information Funneling"): SnapKV's per-head selection under a budget that shrinks linearly with
// depth, the lower layers (whose attention is spread wide) keeping more than the upper ones
// (whose attention is focused), `budget` a head on average. As the authors' code sets it: of
// the budget beyond the window, s = budget - window, the last layer keeps s / beta and the first
// 2s - s / beta, the layers between on the line (rounded down, so the average stays within the
// budget), each with the observation window besides. A layer selects when the sequence outgrows
// its own budget (`one_shot`: once, at the prompt's end, as snapkv).
#include <cmath>
#include <limits>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class PyramidKvPolicy final : public KvPolicy {
 public:
  PyramidKvPolicy(const PluginParams& params, const PluginContext&)
      : w_(ObservationWindow::from(params, "pyramidkv")), beta_(params.real("beta")) {}
  std::int64_t budget() const override { return w_.budget; }
  std::int64_t held_limit() const override { return std::numeric_limits<std::int32_t>::max(); }
  std::int32_t scored_queries() const override { return static_cast<std::int32_t>(w_.window); }

  // Positions layer `layer` of `layers` keeps in each head, its window included.
  std::int64_t layer_budget(std::int64_t layer, std::int64_t layers) const {
    const auto spare = static_cast<double>(w_.budget - w_.window);
    const double last = spare / beta_, first = 2 * spare - last;
    if (layers == 1) return w_.budget;
    const double share =
        first - (first - last) * static_cast<double>(layer) / static_cast<double>(layers - 1);
    return w_.window + static_cast<std::int64_t>(std::floor(share));
  }

  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    if (w_.one_shot && !step.prompt_done) return mark_all(keep);
    std::int64_t cells = 0;
    for (std::int64_t l = 0; l < step.layers; ++l) {
      const std::int64_t layer_keep = layer_budget(l, step.layers);
      for (std::int64_t h = 0; h < step.kv_heads; ++h)
        cells += snapkv_mark(step, l, h, w_.window, w_.kernel, layer_keep, keep.head(l, h));
    }
    return cells;
  }
  void forget(std::int64_t) override {}

 private:
  ObservationWindow w_;
  double beta_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer,
     "positions a K/V head keeps on average over the layers, the window included", "256", 2,
     1 << 30},
    {"window", ParamType::param_integer, "the observation window: last queries that vote", "32", 1,
     1 << 20},
    {"kernel", ParamType::param_integer, "max-pooling width over the votes (1: none)", "7", 1,
     1023},
    {"beta", ParamType::param_real,
     "the pyramid's slope: the last layer keeps (budget - window) / beta besides the window", "20",
     1, 1e6},
    {"one_shot", ParamType::param_boolean,
     "compress the prompt once at its end and keep every generated token; false: select again "
     "whenever a layer is over its budget",
     "false", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, PyramidKvPolicy, "pyramidkv",
             "SnapKV per head under budgets that shrink with depth (more below, less above)",
             kParams)
