// priority: continuous batching, higher priority first; when the KV cache is full, lower-
// priority running requests give way (freed or swapped) so higher ones run.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class PriorityScheduler final : public kvlab::Scheduler {
 public:
  PriorityScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : policy_(kvlab::continuous_policy_from_params(
            params, {.order = kvlab::ContinuousPolicy::Order::priority,
                     .chunked_prefill = false,
                     .preempt_for_priority = true})) {}
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
    {"preemption", kvlab::ParamType::param_string,
     "recompute (free KV, recompute later) or swap (to the host swap pool)", "\"recompute\"", 0, 0},
    {"victim", kvlab::ParamType::param_string,
     "who gives way: last_admitted, lowest_priority or most_kv", "\"lowest_priority\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, PriorityScheduler, "priority",
             "higher priority first; preempts lower-priority requests under memory pressure",
             kParams)
