// sjf_oracle: shortest-job-first using the true output lengths (known only to the workload):
// not implementable in a real server, an upper bound on what length prediction could buy.
#include "kvlab/continuous_scheduler.hpp"

namespace {

struct SjfOracleScheduler final : kvlab::ContinuousScheduler {
  SjfOracleScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::shortest_remaining,
                                     .chunked_prefill = false,
                                     .preempt_for_priority = false}) {}
};

constexpr auto kParams = kvlab::continuous_scheduler_params("8192", "\"last_admitted\"");

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, SjfOracleScheduler, "sjf_oracle",
             "shortest remaining output first, from the workload's true lengths (an upper bound)",
             kParams)
