// fcfs: iteration-level (continuous) batching in arrival order: finished requests leave and
// waiting ones join at every step (Orca, vLLM). Prompts are computed whole.
#include "kvlab/continuous_scheduler.hpp"

namespace {

struct FcfsScheduler final : kvlab::ContinuousScheduler {
  FcfsScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                                     .chunked_prefill = false,
                                     .preempt_for_priority = false}) {}
};

constexpr auto kParams = kvlab::continuous_scheduler_params("8192", "\"last_admitted\"");

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, FcfsScheduler, "fcfs",
             "continuous batching, first come first served (Orca / vLLM)", kParams)
