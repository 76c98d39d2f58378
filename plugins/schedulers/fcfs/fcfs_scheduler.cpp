// fcfs: iteration-level (continuous) batching in arrival order: finished requests leave and
// waiting ones join at every step (Orca, vLLM). Prompts are computed whole.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class FcfsScheduler final : public kvlab::Scheduler {
 public:
  FcfsScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : policy_(kvlab::continuous_policy_from_params(
            params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                     .chunked_prefill = false,
                     .preempt_for_priority = false})) {}
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
     "who gives way: last_admitted, lowest_priority or most_kv", "\"last_admitted\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, FcfsScheduler, "fcfs",
             "continuous batching, first come first served (Orca / vLLM)", kParams)
