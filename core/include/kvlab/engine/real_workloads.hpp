#pragma once
// Real workloads: request sizes and arrival times from a production trace, and prompts that are
// real text whose answers end where the model says so.
//   - The Azure LLM inference trace 2023 (Splitwise, ISCA 2024; data/azure-llm-inference-2023):
//     TIMESTAMP,ContextTokens,GeneratedTokens per request. Replayed as Splitwise and Vidur do:
//     the trace's prompt and output lengths (prompt ids random, output forced to its length).
//   - Prompt sets (data/prompts: MT-Bench, Vicuna bench, GSM8K): each prompt's text through the
//     model's tokenizer (and chat template); generation ends at EOS, or at a cap.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kvlab/engine/workload.hpp"

namespace kvlab {

struct AzureTraceOptions {
  double start_s = 0;               // the window starts this long after the trace's first request
  double duration_s = 0;            // and lasts this long (0 = to the end)
  double rate_scale = 1.0;          // > 1 compresses time: 2 = the same requests at twice the rate
  std::int64_t max_requests = 0;    // the first N of the window (0 = all)
  std::int64_t context = 0;         // prompt + output clipped to this many tokens (0 = no clip)
  std::int64_t vocab_size = 32000;  // for the random prompt ids
  std::uint64_t seed = 0;
  SamplingParams sampling;  // each request's seed = seed + index; ignore_eos is always on
};

struct RealWorkload {
  std::vector<WorkloadRequest> requests;
  std::vector<std::string> prompt_texts;  // a prompt set's text of each request (else empty)
  std::int64_t clipped = 0;               // requests whose lengths were cut to the context
  std::string description;  // "azure conv: 812 requests, 600.0 s window, ..." for the run log
};

// Throws kvlab::Error "file:line: why" for a malformed row (bad timestamp, a negative or
// non-integer count), or for options out of range; rows need not be in time order.
RealWorkload load_azure_trace(const std::filesystem::path& path, const AzureTraceOptions& options);

// The texts of a prompt-set JSONL file: per line "turns"[0] (MT-Bench, Vicuna bench), else
// "question" (GSM8K), else "prompt" or "text". Throws kvlab::Error "file:line: why".
std::vector<std::string> load_prompt_texts(const std::filesystem::path& path);

struct PromptSetOptions {
  std::int64_t requests = 0;      // 0 = one per prompt; more cycle through the prompts
  std::int32_t max_tokens = 256;  // the cap on each answer (EOS usually ends it first)
  std::int64_t context = 0;       // a prompt + cap beyond it has its cap cut (0 = no limit)
  ArrivalProcess arrival;
  std::uint64_t seed = 0;
  SamplingParams sampling;  // ignore_eos is always off: answers end at EOS
};

// Requests from prompt texts; `encode` turns a text into prompt ids (the tokenizer, with the
// chat template when the experiment asks for it). A prompt that leaves no room to answer in the
// context is a kvlab::Error naming it.
RealWorkload prompt_set_workload(
    const std::vector<std::string>& texts,
    const std::function<std::vector<std::int32_t>(const std::string&)>& encode,
    const PromptSetOptions& options);

}  // namespace kvlab
