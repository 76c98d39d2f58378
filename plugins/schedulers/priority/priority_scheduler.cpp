// priority: continuous batching, higher priority first; when the KV cache is full, lower-
// priority running requests give way (freed or swapped) so higher ones run.
#include "kvlab/continuous_scheduler.hpp"

namespace {

struct PriorityScheduler final : kvlab::ContinuousScheduler {
  PriorityScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::priority,
                                     .chunked_prefill = false,
                                     .preempt_for_priority = true}) {}
};

constexpr auto kParams = kvlab::continuous_scheduler_params("8192", "\"lowest_priority\"");

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, PriorityScheduler, "priority",
             "higher priority first; preempts lower-priority requests under memory pressure",
             kParams)
