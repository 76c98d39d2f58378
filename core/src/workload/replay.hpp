#pragma once
// What the recorded workloads (Azure and Mooncake traces, prompt sets) share: the checks of a
// replay window's options, the clipping of a request to the model's context, a JSONL line.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "kvlab/workload/formats.hpp"

namespace kvlab::detail {

// A recorded trace's reader options (AzureTraceOptions, MooncakeTraceOptions) from a source's
// input: its window (but length_scale, the Mooncake trace's alone), the model's context and
// vocabulary, the seed and the sampling.
template <typename TraceOptions>
TraceOptions replay_options(const WorkloadInput& input) {
  TraceOptions o;
  o.start_s = input.window.start_s;
  o.duration_s = input.window.duration_s;
  o.rate_scale = input.window.rate_scale;
  o.max_requests = input.window.max_requests;
  o.context = input.context;
  o.vocab_size = input.vocab_size;
  o.seed = input.seed;
  o.sampling = input.sampling;
  return o;
}

// Throws kvlab::Error naming `trace` ("Azure trace", "Mooncake trace") for a window before the
// start, a rate scale that is not positive and finite, or negative counts.
void check_replay_options(std::string_view trace, double start_s, double duration_s,
                          double rate_scale, std::int64_t max_requests, std::int64_t context,
                          std::int64_t vocab_size);

// Prompt + output cut to `context` tokens (prompt first keeps at least one token to generate);
// false when they fit (or context is 0: no limit).
bool clip_to_context(std::int64_t& prompt, std::int64_t& output, std::int64_t context);

// One line of a JSONL file as a JSON object; kvlab::Error "not valid JSON: ..." or "each line
// must be a JSON object" (the caller adds file:line).
nlohmann::json parse_json_object(const std::string& line);

}  // namespace kvlab::detail
