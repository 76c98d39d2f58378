// chunked: a token budget per step; decodes go first and prompts are split into chunks that
// fill the rest (Sarathi-Serve), trading a little TTFT for a flat inter-token latency.
#include "kvlab/continuous_scheduler.hpp"

namespace {

struct ChunkedScheduler final : kvlab::ContinuousScheduler {
  ChunkedScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                                     .chunked_prefill = true,
                                     .preempt_for_priority = false}) {}
};

constexpr auto kParams = kvlab::continuous_scheduler_params("512", "\"last_admitted\"");

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, ChunkedScheduler, "chunked",
             "token budget per step: prefill chunks mixed with decodes (Sarathi-Serve)", kParams)
