#pragma once
// Batch generation without a scheduling policy: N prompts through the engine and the batched
// CPU backend with a chosen KV allocator and attention variant (both plugins). Every request
// joins at its arrival step, so prefills mix with other sequences' decodes. For tests and
// benchmarks: it is the engine (request table, apply_plan) with a scheduler that runs everyone.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::cpu {

struct BatchRequest {
  std::vector<std::int32_t> prompt;
  SamplingParams sampling;
  std::int64_t arrival_step = 0;  // joins the batch at this step
};

struct BatchOptions {
  std::int64_t prefill_chunk =
      0;                       // prompt tokens per sequence per step (0 = the whole prompt at once)
  bool record_logits = false;  // keep the logits that produced every generated token
  // Each token as soon as it is chosen: (request index, token), for streaming.
  std::function<void(std::size_t, std::int32_t)> on_token;
};

struct BatchResult {
  std::vector<std::int32_t> tokens;
  std::vector<std::vector<float>> logits;  // (generated tokens, vocab), when recorded
  // One per generated token when the request's SamplingParams::logprobs >= 0 (the engine's own,
  // computed where the token was picked; nothing else is kept per step).
  std::vector<GeneratedLogprobs> logprobs;
  FinishReason finish_reason = FinishReason::max_tokens;
  std::int64_t cached_prompt_tokens = 0;  // prompt tokens served by the prefix cache
};

struct BatchSetup {
  std::string allocator = "paged";
  std::map<std::string, ParamValue, std::less<>> allocator_params;
  std::string attention = "gqa";
  std::map<std::string, ParamValue, std::less<>> attention_params;
  std::int64_t pool_slots = 4096;  // KV pool capacity in tokens
  std::int64_t max_seq_len = 0;    // 0 = the model's context
  // The format the backend multiplies in (the cpu backend plugin's `weights` and `activations`:
  // select_compute_weights), and the checkpoint's file.
  std::string weights = "stored";
  std::string activations = "f32";  // "q8": 8-bit activations for Q weights (ActivationFormat)
  std::filesystem::path source;     // a .gguf keeps its stored types under "stored"
};

class BatchGenerator {
 public:
  // Creates the attention variant, converts the checkpoint's K/V heads to what it caches,
  // sizes the pool, creates the allocator. Throws kvlab::Error (unknown plugin, bad parameter,
  // a variant that cannot run this model).
  BatchGenerator(const LlamaWeights& checkpoint, const PluginRegistry& registry,
                 const BatchSetup& setup);

  // Runs every request to completion. Throws kvlab::Error for a request that can never run
  // (beyond the context or the KV pool). When the pool fills up, the engine defers admissions
  // and preempts (recomputing later), as it would under any scheduler.
  std::vector<BatchResult> run(const std::vector<BatchRequest>& requests,
                               const BatchOptions& options = {});

  const LlamaWeights& weights() const { return weights_; }  // as converted for the variant
  KvAllocator& allocator() { return *allocator_; }
  const AttentionVariant& attention() const { return *attention_; }
  KvPool& pool() { return pool_; }

 private:
  PluginObject<AttentionVariant> attention_;
  LlamaWeights weights_;
  KvPool pool_;
  SequenceRules rules_;  // context, EOS, window: one source for the backend and the engine
  PluginObject<Backend> backend_;  // the `cpu` backend plugin, made as every backend is
  PluginObject<KvAllocator> allocator_;
};

}  // namespace kvlab::cpu
