#pragma once
// Real workloads: request sizes and arrival times from a production trace, and prompts that are
// real text whose answers end where the model says so.
//   - The Azure LLM inference trace 2023 (Splitwise, ISCA 2024; data/azure-llm-inference-2023):
//     TIMESTAMP,ContextTokens,GeneratedTokens per request. Replayed as Splitwise and Vidur do:
//     the trace's prompt and output lengths (prompt ids random, output forced to its length).
//   - The Mooncake FAST'25 traces (data/mooncake-fast25): per request its arrival, lengths and
//     hash_ids, one per 512-token prompt block (equal ids: equal blocks). Replayed with token ids
//     that honour them: an id's block is the same tokens wherever it appears, a new id new ones.
//   - Prompt sets (data/prompts: MT-Bench, Vicuna bench, GSM8K): each prompt's text through the
//     model's tokenizer (and chat template); generation ends at EOS, or at a cap.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kvlab/workload/workload.hpp"

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
  // A trace with prefix-sharing information (Mooncake): the prefix hit rate of an infinite cache
  // at its block granularity, the ceiling every prefix-caching result is read against; -1 when
  // the workload does not say.
  double ideal_prefix_hit_rate = -1;
};

// Throws kvlab::Error "file:line: why" for a malformed row (bad timestamp, a negative or
// non-integer count), or for options out of range; rows need not be in time order.
RealWorkload load_azure_trace(const std::filesystem::path& path, const AzureTraceOptions& options);

// The Mooncake traces' block: the tokens one hash id names.
inline constexpr std::int64_t kMooncakeBlockTokens = 512;

struct MooncakeTraceOptions {
  double start_s = 0;             // the window starts this long after the first request
  double duration_s = 0;          // and lasts this long (0 = to the end)
  double rate_scale = 1.0;        // > 1 compresses time
  std::int64_t max_requests = 0;  // the first N of the window (0 = all)
  // (0, 1]: every length and the 512-token block scaled by this (rounded, at least 1), for a
  // small model: the sharing structure (which requests share how many blocks) and the relative
  // lengths are kept; absolute sizes, and with them attention's quadratic share of the work and
  // the KV bytes per request, are not.
  double length_scale = 1.0;
  std::int64_t context = 0;  // prompt + output clipped to this many tokens (0 = no clip)
  std::int64_t vocab_size = 32000;
  std::uint64_t seed = 0;   // the tokens of each block (the same seed, the same tokens)
  SamplingParams sampling;  // each request's seed = seed + index; ignore_eos is always on
};

struct MooncakeRow {
  double time_s = 0;  // the trace's timestamp (ms) in seconds
  std::int64_t input = 0;
  std::int64_t output = 0;
  std::vector<std::int64_t> hash_ids;  // one per 512-token prompt block, the last often partial
};

// Whether the file's first JSON line is a Mooncake trace row (input_length, output_length and
// hash_ids): how `[workload] trace` tells this format from kvlab's own JSONL.
bool is_mooncake_trace(const std::filesystem::path& path);
// The rows in time order. Throws kvlab::Error "file:line: why" for a malformed row (not JSON,
// a missing or negative field, lengths beyond kMaxRequestTokens, hash ids that are not
// non-negative integers, more ids than a 512-token block each can fill).
std::vector<MooncakeRow> read_mooncake_trace(const std::filesystem::path& path);

// Prompt tokens an infinite prefix cache that keeps whole blocks of `block_tokens` would serve:
// in arrival order, a request's leading blocks whose ids an earlier request held whole (its
// first miss ends the run; a partial block never hits). The ceiling of any prefix hit rate on the
// trace at that granularity.
struct PrefixReuse {
  std::int64_t prompt_tokens = 0;
  std::int64_t hit_tokens = 0;
  double rate() const {
    return prompt_tokens > 0 ? static_cast<double>(hit_tokens) / static_cast<double>(prompt_tokens)
                             : 0.0;
  }
};

// The ideal reuse of prompts `prompts` whose blocks of `block_tokens` are named by `hash_ids`
// (one id a block, in order), served in this order.
PrefixReuse ideal_prefix_reuse(const std::vector<std::vector<std::int64_t>>& hash_ids,
                               const std::vector<std::int64_t>& prompt_lengths,
                               std::int64_t block_tokens);

// The window of the trace as requests, prompt ids from the hash ids (see above); output forced
// to its length; ideal_prefix_hit_rate set for the requests as replayed (window, scale,
// clipping). Throws kvlab::Error for bad options or an empty window.
RealWorkload load_mooncake_trace(const std::filesystem::path& path,
                                 const MooncakeTraceOptions& options);

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
