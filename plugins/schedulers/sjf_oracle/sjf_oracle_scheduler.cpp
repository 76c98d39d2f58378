// sjf_oracle: shortest-job-first using the true output lengths (known only to the workload):
// not implementable in a real server, an upper bound on what length prediction could buy.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class SjfOracleScheduler final : public kvlab::Scheduler {
 public:
  SjfOracleScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : policy_(kvlab::continuous_policy_from_params(
            params, {.order = kvlab::ContinuousPolicy::Order::shortest_remaining,
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

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, SjfOracleScheduler, "sjf_oracle",
             "shortest remaining output first, from the workload's true lengths (an upper bound)",
             kParams)
