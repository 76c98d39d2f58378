// snapkv (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): when
// a sequence outgrows its budget, the attention of the forward's last `window` queries (the
// observation window) votes for the older positions; pooled over `kernel` neighbours, the
// best-voted are kept with the window itself, `budget` in all. At the end of a prompt this is
// SnapKV's selection; a later forward that outgrows the budget (a decode step, a streamed
// chunk) selects again the same way with the queries it has.
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "kvlab/kv/kv_selection.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class SnapKvPolicy final : public KvPolicy {
 public:
  SnapKvPolicy(const PluginParams& params, const PluginContext&)
      : budget_(params.integer("budget")),
        window_(params.integer("window")),
        kernel_(params.integer("kernel")) {
    if (window_ >= budget_)
      throw std::invalid_argument("snapkv: the observation window must be below the budget");
  }
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return static_cast<std::int32_t>(window_); }

  std::int64_t select(const KvPolicyStep& step, std::span<std::int64_t> kept) override {
    const auto n = static_cast<std::int64_t>(step.positions.size());
    if (n <= budget_) {
      std::copy(step.positions.begin(), step.positions.end(), kept.begin());
      return n;
    }
    const std::int64_t recent = std::min(window_, n);
    votes_.assign(step.scores.begin(), step.scores.end());
    votes_.resize(static_cast<std::size_t>(n), 0.0);
    max_pool(std::span<double>(votes_).first(static_cast<std::size_t>(n - recent)), kernel_);
    return keep_ends_and_top(step.positions, votes_, 0, recent, budget_ - recent, kept);
  }
  void forget(std::int64_t) override {}

 private:
  std::int64_t budget_, window_, kernel_;
  std::vector<double> votes_;
};

const ParamSpec kParams[] = {
    {"budget", ParamType::param_integer, "positions a sequence keeps, the window included", "256",
     2, 1 << 30},
    {"window", ParamType::param_integer, "the observation window: last queries that vote", "32", 1,
     1 << 20},
    {"kernel", ParamType::param_integer, "max-pooling width over the votes (1: none)", "7", 1,
     1023},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_policy, SnapKvPolicy, "snapkv",
             "when over budget, keep the observation window and the positions it attends to most",
             kParams)
