// chunked: a token budget per step; decodes go first and prompts are split into chunks that
// fill the rest (Sarathi-Serve), trading a little TTFT for a flat inter-token latency.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class ChunkedScheduler final : public kvlab::Scheduler {
 public:
  ChunkedScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : policy_(kvlab::continuous_policy_from_params(
            params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                     .chunked_prefill = true,
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
     "512", 1, 1 << 24},
    {"preemption", kvlab::ParamType::param_string,
     "recompute (free KV, recompute later) or swap (to the host swap pool)", "\"recompute\"", 0, 0},
    {"victim", kvlab::ParamType::param_string,
     "who gives way: last_admitted, lowest_priority or most_kv", "\"last_admitted\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, ChunkedScheduler, "chunked",
             "token budget per step: prefill chunks mixed with decodes (Sarathi-Serve)", kParams)
