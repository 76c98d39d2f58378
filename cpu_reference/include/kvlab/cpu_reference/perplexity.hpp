#pragma once
// Perplexity of a model over a text through the batched CPU backend and a KV pool, by
// llama.cpp's llama-perplexity protocol, so that the two tools' figures mean the same: the text
// is tokenized whole (with the BOS the tokenizer adds), cut into chunks of `context` tokens,
// each chunk's first token replaced by BOS (when the tokenizer adds one) and run as one
// sequence from position 0; the second half of each chunk is scored (logits at positions
// [context/2, context - 1) predicting the next token). With a KV policy, each chunk is fed in
// steps and the policy drops positions between them. Beside it, the mean KL divergence and
// the top-1 agreement against the exact run (f32 KV, every position kept), as llama.cpp's
// --kl-divergence reports them.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv/kv_keep.hpp"
#include "kvlab/kv_policy.hpp"

namespace kvlab::cpu {

struct PerplexityOptions {
  std::int64_t context = 512;         // n_ctx: tokens per chunk (llama.cpp's -c)
  std::int64_t chunks = 0;            // chunks scored; 0 = every whole chunk of the text (--chunks)
  std::int64_t parallel = 4;          // chunks per forward (llama.cpp's n_batch / n_ctx sequences)
  DType kv_dtype = DType::dtype_f32;  // the KV pool under test (K, and V unless below)
  std::optional<DType> kv_value_dtype;  // V's rows in a dtype of their own (llama.cpp's -ctv)
  bool hadamard = false;                // its rows rotated (KvPoolShape::hadamard_rotated)
  // A KIVI pool's residual length (KvPoolShape::kivi_residual): its newest tokens kept in fp16.
  // KIVI attends to the prompt in full precision, so its chunks are streamed policy_step tokens a
  // forward: a whole chunk in one forward would read nothing but fp16.
  std::int64_t kivi_residual = kKiviResidualDefault;
  std::optional<std::int64_t> window;  // attend to the last W positions only
  bool compare_with_exact = true;      // also run the exact KV: KL and top-1 agreement
  // A KV policy (not owned): each chunk is then streamed `policy_step` tokens a forward, the
  // policy choosing after each which positions stay (at most its budget), as a long generation
  // would meet it; one chunk per sequence id, forgotten at its end.
  KvPolicy* policy = nullptr;
  std::string policy_name = "kv_policy";  // as errors name it
  std::int64_t policy_step = 1;  // token by token: as a generation meets the policy (and KIVI)
};

// Sums over scored tokens; what each figure is made of.
struct PerplexitySums {
  std::int64_t tokens = 0;
  double nll = 0, nll_squared = 0;  // of -log p(next token)
  double kl = 0, kl_squared = 0;    // KL(exact || this), nats
  std::int64_t same_top1 = 0;       // tokens whose argmax equals the exact run's
  double exact_nll = 0;
};

struct PerplexityResult {
  std::int64_t chunks = 0;          // scored so far
  std::vector<double> running_ppl;  // after each chunk (llama.cpp's "[i]ppl" list)
  PerplexitySums sums;
  bool compared = false;  // the exact run was computed beside it
  // With a KV policy: the positions its selections held (the union over layers and heads, the
  // slots that stay in memory) and those a head saw, on average over the selections that
  // dropped something.
  KvKeepStats kv_kept;

  std::int64_t scored_tokens() const { return sums.tokens; }
  double ppl() const;        // exp(mean NLL)
  double ppl_error() const;  // its standard error, as llama.cpp's "+/-"
  double exact_ppl() const;  // the exact run's (compared only)
  double mean_kl() const;
  double kl_error() const;        // standard error of the mean KL
  double top1_agreement() const;  // fraction in [0, 1]
};

// `tokens`: the whole text's ids, with the BOS the tokenizer adds; `bos`: the id that replaces
// each chunk's first token (nullopt when the tokenizer adds none). `make_compute` builds the
// matrices the backends multiply with (called once: every backend shares them). Throws
// kvlab::Error when the text has fewer than 2 x context tokens (llama.cpp's rule), when context
// is below 4 or beyond the model's, or for a bad option. `on_chunk` sees the result after each
// chunk (progress).
PerplexityResult measure_perplexity(
    const ModelWeightsView& weights, const std::function<ComputeWeights()>& make_compute,
    std::span<const std::int32_t> tokens, std::optional<std::int32_t> bos,
    const PerplexityOptions& options,
    const std::function<void(const PerplexityResult&)>& on_chunk = {});

// Several KV settings over the same text and chunks (`points`: equal context, chunks and
// parallel), results in their order. The exact KV's forward runs once per batch of chunks and
// every point compared with it is scored against that one run: N settings cost N + 1 forwards
// per batch, not 2N. Each point's perplexity is what measure_perplexity gives it alone.
// `on_chunk(point, result)` after each point's batch. Throws as above, and for points that
// differ in context, chunks or parallel.
std::vector<PerplexityResult> measure_perplexity(
    const ModelWeightsView& weights, const std::function<ComputeWeights()>& make_compute,
    std::span<const std::int32_t> tokens, std::optional<std::int32_t> bos,
    std::span<const PerplexityOptions> points,
    const std::function<void(std::size_t, const PerplexityResult&)>& on_chunk = {});

}  // namespace kvlab::cpu
