#pragma once
// Where an experiment's requests come from: one table of workload sources. A row is a source's
// name, how to tell its files, and its reader (each one file in core/src/workload/): the
// synthetic generator, kvlab's own CSV and JSONL traces, the Azure LLM inference trace, the
// Mooncake traces, prompt sets. A new trace format is one file, one row (formats.cpp) and
// nothing else: tests/fuzz/fuzz_trace.cpp fuzzes every row that reads a file.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/workload/real_workloads.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab {

// The part of a recorded trace a run replays, and how fast.
struct ReplayWindow {
  double start_s = 0;             // the window starts this long after the first request
  double duration_s = 0;          // and lasts this long (0 = to the end)
  double rate_scale = 1.0;        // > 1 compresses time
  std::int64_t max_requests = 0;  // the first N of the window (0 = all)
  double length_scale = 1.0;      // every length scaled (a Mooncake trace's; others refuse it)
};

// What a source may read: its file and the run's settings.
struct WorkloadInput {
  std::filesystem::path file;       // the trace or prompt set (none for the synthetic workload)
  SyntheticWorkload synthetic;      // [workload]: requests, arrival process, lengths, ignore_eos
  ReplayWindow window;              // a recorded trace's
  std::int64_t context = 0;         // the model's: prompt + output clipped to it (0 = no limit)
  std::int64_t vocab_size = 32000;  // the model's: random prompt ids
  std::uint64_t seed = 0;           // the run's
  SamplingParams sampling;          // every request's (each gets its own seed)
  // A prompt set: how many requests (0 = one a prompt), their answers' cap, and each text to
  // prompt ids (the tokenizer, with the chat template when the experiment asks for it).
  std::int64_t prompt_requests = 0;
  std::int32_t prompt_max_tokens = 256;
  std::function<std::vector<std::int32_t>(const std::string&)> encode;
};

struct WorkloadFormat {
  const char* name;  // synthetic, kvlab, azure, mooncake, prompts
  const char* what;  // one line: what it reads
  // Whether `file` is this source's: `[workload] trace` is read by the first row that says so.
  // Null: a source never told by its file (the synthetic workload; prompt sets, named as such).
  bool (*recognizes)(const std::filesystem::path& file);
  // Throws kvlab::Error "file:line: why" for a malformed input, or for settings out of range.
  RealWorkload (*load)(const WorkloadInput& input);
};

std::span<const WorkloadFormat> workload_formats();
// The row named `name`; kvlab::Error naming the rows there are otherwise.
const WorkloadFormat& workload_format(std::string_view name);
// The row that reads trace `file`: the first that recognizes it; kvlab::Error when none does.
const WorkloadFormat& trace_format(const std::filesystem::path& file);

}  // namespace kvlab
