// fcfs: iteration-level (continuous) batching in arrival order: finished requests leave and
// waiting ones join at every step (Orca, vLLM). Prompts are computed whole.
#include <stdexcept>
#include <string>

#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class FcfsScheduler final : public kvlab::Scheduler {
 public:
  FcfsScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&) {
    policy_.order = kvlab::ContinuousPolicy::Order::arrival;
    policy_.max_batch = params.integer("max_batch");
    policy_.max_tokens_per_step = params.integer("max_tokens_per_step");
    const std::string& preemption = params.string("preemption");
    if (preemption != "recompute" && preemption != "swap")
      throw std::invalid_argument("preemption must be \"recompute\" or \"swap\", got \"" +
                                  preemption + "\"");
    policy_.swap = preemption == "swap";
    const auto victim = kvlab::victim_policy_from_name(params.string("victim"));
    if (!victim)
      throw std::invalid_argument(
          "victim must be \"last_admitted\", \"lowest_priority\" or \"most_kv\", got \"" +
          params.string("victim") + "\"");
    policy_.victim = *victim;
    policy_.chunked_prefill = false;
    policy_.preempt_for_priority = false;
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
    {"preemption", kvlab::ParamType::param_string,
     "recompute (free KV, recompute later) or swap (to the host swap pool)", "\"recompute\"", 0, 0},
    {"victim", kvlab::ParamType::param_string,
     "who gives way: last_admitted, lowest_priority or most_kv", "\"last_admitted\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, FcfsScheduler, "fcfs",
             "continuous batching, first come first served (Orca / vLLM)", kParams)
