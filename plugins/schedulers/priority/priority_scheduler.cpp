// priority: continuous batching, higher priority first; when the KV cache is full, lower-
// priority running requests are preempted (freed, recomputed later) to admit higher ones.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class PriorityScheduler final : public kvlab::Scheduler {
 public:
  PriorityScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&) {
    policy_.order = kvlab::ContinuousPolicy::Order::priority;
    policy_.max_batch = params.integer("max_batch");
    policy_.max_tokens_per_step = params.integer("max_tokens_per_step");
    policy_.chunked_prefill = false;
    policy_.preempt_for_priority = true;
  }
  kvlab::StepPlan schedule(const kvlab::SchedulerInput& input) override {
    return kvlab::schedule_continuous(input, policy_);
  }

 private:
  kvlab::ContinuousPolicy policy_;
};

const kvlab::ParamSpec kParams[] = {
    {"max_batch", kvlab::ParamType::param_integer, "running requests at most", "256", 1, 1 << 20},
    {"max_tokens_per_step", kvlab::ParamType::param_integer, "prefill + decode tokens per step",
     "8192", 1, 1 << 24},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, PriorityScheduler, "priority",
             "higher priority first; preempts lower-priority requests under memory pressure",
             kParams)
