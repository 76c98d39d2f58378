// An out-of-tree scheduler: kvlab's continuous batching (decodes first, chunk-free prefills,
// preemption when the KV cache cannot grow) with this plugin's own policy: the waiting request
// with the longest prompt is admitted first, and the running request holding the least KV
// gives way first (it is the cheapest to recompute).
#include <kvlab/continuous_scheduler.hpp>
#include <kvlab/plugin.hpp>

namespace {

class LongestPromptFirst final : public kvlab::ContinuousScheduler {
 public:
  LongestPromptFirst(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, kvlab::ContinuousPolicy{}) {
    hooks_.admission_order = [](const kvlab::RequestState& a, const kvlab::RequestState& b) {
      return a.prompt_tokens > b.prompt_tokens;
    };
    hooks_.victim_order = [](const kvlab::RequestState& a, const kvlab::RequestState& b) {
      return a.computed < b.computed;
    };
  }
};

// max_batch, max_tokens_per_step, preemption, victim (the victim hook overrides `victim`).
constexpr auto kParams = kvlab::continuous_scheduler_params("8192", "\"last_admitted\"");

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, LongestPromptFirst, "longest_prompt_first",
             "continuous batching, longest prompt admitted first (example out-of-tree plugin)",
             kParams)
