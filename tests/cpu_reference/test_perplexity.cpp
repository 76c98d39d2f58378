// measure_perplexity (cpu_reference/perplexity.hpp) against the full-recompute reference: the
// same protocol computed by hand from ReferenceModel logits, its option checks, and the exact
// run it compares a rounded KV with. Tolerance: 1e-4 relative on perplexity (fp32 logits of
// two computations of the same function, summed in double).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "kvlab/cpu_reference/perplexity.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

struct TinyText {
  LlamaWeights weights;
  std::vector<std::int32_t> tokens;
  explicit TinyText(std::size_t n, const ModelConfig& config = model_preset("tiny"))
      : weights(random_llama_weights(config, 3)) {
    std::mt19937 rng(9);
    std::uniform_int_distribution<std::int32_t> id(
        0, static_cast<std::int32_t>(weights.config.vocab_size - 1));
    for (std::size_t i = 0; i < n; ++i) tokens.push_back(id(rng));
  }
  PerplexityResult measure(const PerplexityOptions& options, std::optional<std::int32_t> bos) {
    const ModelWeightsView view = weights_view(weights);
    return measure_perplexity(
        view, [&] { return select_compute_weights(view, "f32"); }, tokens, bos, options);
  }
};

// llama-perplexity's protocol by hand: each chunk from position 0 with BOS first, logits at
// [n/2, n - 1) predicting the next token, PPL = exp(mean NLL) over every chunk.
double reference_perplexity(const TinyText& text, std::int64_t context, std::int64_t chunks,
                            std::int32_t bos) {
  const ReferenceModel model(text.weights);
  double nll = 0;
  std::int64_t count = 0;
  for (std::int64_t c = 0; c < chunks; ++c) {
    std::vector<std::int32_t> chunk(text.tokens.begin() + c * context,
                                    text.tokens.begin() + (c + 1) * context);
    chunk[0] = bos;
    const RowMatrix logits = model.forward(chunk);  // (context, vocab)
    for (std::int64_t i = context / 2; i < context - 1; ++i) {
      const auto row = logits.row(i).cast<double>();
      const double max = row.maxCoeff();
      const double log_sum = max + std::log((row.array() - max).exp().sum());
      nll += log_sum - row(chunk[static_cast<std::size_t>(i + 1)]);
      ++count;
    }
  }
  return std::exp(nll / static_cast<double>(count));
}

TEST(Perplexity, FollowsLlamaPerplexitysProtocolOverTheReference) {
  TinyText text(5 * 24 + 7);  // five whole chunks of 24 and a remainder that is not scored
  PerplexityOptions options;
  options.context = 24;
  options.parallel = 2;  // chunks 1-2, 3-4, 5: a last batch of one
  const PerplexityResult r = text.measure(options, 1);
  EXPECT_EQ(r.chunks, 5);
  EXPECT_EQ(r.scored_tokens(), 5 * 11);
  ASSERT_EQ(r.running_ppl.size(), 5u);
  EXPECT_FALSE(r.compared);  // f32 KV, no window: the exact settings themselves
  EXPECT_NEAR(r.ppl() / reference_perplexity(text, 24, 5, 1), 1.0, 1e-4);
  EXPECT_DOUBLE_EQ(r.running_ppl.back(), r.ppl());
  EXPECT_GT(r.ppl_error(), 0);
  options.chunks = 2;  // the first chunks only, as --chunks
  EXPECT_NEAR(text.measure(options, 1).ppl() / reference_perplexity(text, 24, 2, 1), 1.0, 1e-4);
}

// A rounded KV is compared with the exact one over the same chunks: its exact_ppl is the exact
// run's, KL >= 0 and small for f16, large for a narrow window (most keys masked).
TEST(Perplexity, ComparesRoundedKvWithTheExactRun) {
  TinyText text(4 * 32);
  PerplexityOptions options;
  options.context = 32;
  const double exact = text.measure(options, std::nullopt).ppl();
  options.kv_dtype = DType::dtype_f16;
  const PerplexityResult f16 = text.measure(options, std::nullopt);
  ASSERT_TRUE(f16.compared);
  EXPECT_NEAR(f16.exact_ppl(), exact, 1e-9 * exact);
  EXPECT_GE(f16.mean_kl(), 0);
  EXPECT_LT(f16.mean_kl(), 1e-4);
  EXPECT_GT(f16.top1_agreement(), 0.9);
  options.kv_dtype = DType::dtype_f32;
  options.window = 2;
  const PerplexityResult window = text.measure(options, std::nullopt);
  ASSERT_TRUE(window.compared);
  EXPECT_GT(window.mean_kl(), 10 * f16.mean_kl());
  options.compare_with_exact = false;
  EXPECT_FALSE(text.measure(options, std::nullopt).compared);
}

// A Hadamard-rotated pool rotates Q, K and V and the attention output back: with f32 KV the
// function is the exact one (KL ~ rounding, the same argmax everywhere); with q8_0 KV it rounds
// the rotated rows instead (tiny: head_dim 16, one block of 32 would not fit, so int8 rows).
TEST(Perplexity, HadamardRotationKeepsTheFunction) {
  TinyText text(4 * 32);
  PerplexityOptions options;
  options.context = 32;
  options.hadamard = true;
  const PerplexityResult rotated = text.measure(options, std::nullopt);
  ASSERT_TRUE(rotated.compared);
  EXPECT_NEAR(rotated.ppl() / rotated.exact_ppl(), 1.0, 1e-5);
  EXPECT_LT(rotated.mean_kl(), 1e-8);
  EXPECT_EQ(rotated.top1_agreement(), 1.0);
  options.kv_dtype = DType::dtype_kv_int8;
  const PerplexityResult int8 = text.measure(options, std::nullopt);
  EXPECT_GT(int8.mean_kl(), rotated.mean_kl());
  EXPECT_LT(int8.mean_kl(), 1e-2);
}

TEST(Perplexity, RefusesTextsAndOptionsItCannotScore) {
  TinyText text(40);
  PerplexityOptions options;
  options.context = 24;  // 40 tokens < 2 x 24
  test::expect_error_containing([&] { (void)text.measure(options, 1); },
                                {"40 tokens", "context of 24", "at least 48"});
  options.context = 2;
  test::expect_error_containing([&] { (void)text.measure(options, 1); }, {"context", "not 2"});
  options.context = 8;
  options.parallel = 0;
  test::expect_error_containing([&] { (void)text.measure(options, 1); }, {"parallel >= 1"});
  options.parallel = 1;
  options.window = 0;
  test::expect_error_containing([&] { (void)text.measure(options, 1); }, {"window", ">= 1"});
}

// The tiny model with two heads of 32 values: block formats and KIVI's groups need multiples of
// 32.
ModelConfig tiny_head_dim_32() {
  ModelConfig config = model_preset("tiny");
  config.num_attention_heads = config.num_key_value_heads = 2;
  config.head_dim = 32;
  return config;
}

// K and V in dtypes apart: each half rounds its own rows. K q4_0 with V f32 is not the pool
// with both in q4_0, and V q4_0 with K f32 is not the exact KV (KL > 0): neither half is dropped.
TEST(Perplexity, KeysAndValuesTakeTheirOwnDtypes) {
  const ModelConfig config = tiny_head_dim_32();
  TinyText text(4 * 40, config);
  PerplexityOptions options;
  options.context = 40;
  options.kv_dtype = DType::dtype_q4_0;
  const PerplexityResult both = text.measure(options, 1);
  options.kv_value_dtype = DType::dtype_f32;
  const PerplexityResult keys = text.measure(options, 1);
  options.kv_dtype = DType::dtype_f32;
  options.kv_value_dtype = DType::dtype_q4_0;
  const PerplexityResult values = text.measure(options, 1);
  ASSERT_TRUE(keys.compared && values.compared && both.compared);
  EXPECT_GT(values.mean_kl(), 0);
  EXPECT_GT(keys.mean_kl(), 0);
  EXPECT_NE(keys.mean_kl(), both.mean_kl());
  EXPECT_NE(values.mean_kl(), both.mean_kl());
}

// KIVI pools: each chunk's slots start a group of 32 (a context of 40 takes 64 slots) and its
// chunks are streamed token by token; within the residual (128, more than a chunk) KIVI is the
// f16 cache (its prefill and residual read fp16: the same PPL within 1e-5 and KL within 1e-6,
// fp32 sums in other batches); with a residual of 0, keys of 2 bits per channel cost more than
// 4.
TEST(Perplexity, KiviChunksStartTheirOwnGroups) {
  const ModelConfig config = tiny_head_dim_32();
  TinyText text(4 * 40, config);
  PerplexityOptions options;
  options.context = 40;
  options.parallel = 2;
  options.kv_dtype = DType::dtype_f16;
  const PerplexityResult f16 = text.measure(options, 1);
  options.kv_dtype = DType::dtype_kivi2;
  const PerplexityResult residual = text.measure(options, 1);
  EXPECT_NEAR(residual.ppl(), f16.ppl(), 1e-5 * f16.ppl());
  EXPECT_NEAR(residual.mean_kl(), f16.mean_kl(), 1e-6);
  options.kivi_residual = 0;
  options.kv_dtype = DType::dtype_kivi4;
  const PerplexityResult kivi4 = text.measure(options, 1);
  options.kv_dtype = DType::dtype_kivi2;
  const PerplexityResult kivi2 = text.measure(options, 1);
  ASSERT_TRUE(kivi4.compared);
  EXPECT_EQ(kivi4.chunks, 4);
  EXPECT_GT(kivi4.mean_kl(), 0);
  EXPECT_LT(kivi4.mean_kl(), 0.05);
  EXPECT_GT(kivi2.mean_kl(), kivi4.mean_kl());
  options.parallel = 1;  // one chunk a forward: the same groups, so the same figures
  const PerplexityResult alone = text.measure(options, 1);
  EXPECT_NEAR(alone.ppl(), kivi2.ppl(), 1e-6 * kivi2.ppl());
  EXPECT_NEAR(alone.mean_kl(), kivi2.mean_kl(), 1e-6 * kivi2.mean_kl());
}

// A KV policy for the tests: keeps its first `sinks` positions and the newest, `budget` in all
// (streaming_llm's rule; sinks 0 is the plain window), in every layer and head, and checks what
// it is given: the attention scores of `scored` queries sum, over layers, K/V heads and keys, to
// layers x query heads per query.
class KeepEnds final : public KvPolicy {
 public:
  KeepEnds(std::int64_t budget, std::int64_t sinks, std::int32_t scored, std::int64_t score_sum)
      : budget_(budget), sinks_(sinks), scored_(scored), score_sum_(score_sum) {}
  std::int64_t budget() const override { return budget_; }
  std::int32_t scored_queries() const override { return scored_; }
  std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
    EXPECT_TRUE(std::is_sorted(step.positions.begin(), step.positions.end()));
    if (scored_ > 0) {
      EXPECT_EQ(step.scores.size(),
                step.positions.size() * static_cast<std::size_t>(step.layers * step.kv_heads));
      double sum = 0;
      for (float v : step.scores) sum += v;
      const auto queries = std::min<std::int64_t>(scored_, step.new_tokens);
      worst_score_error =
          std::max(worst_score_error, std::abs(sum - static_cast<double>(score_sum_ * queries)));
    }
    const auto n = static_cast<std::int64_t>(step.positions.size());
    const std::int64_t first = std::min(sinks_, n), recent = std::min(n - first, budget_ - first);
    std::int64_t count = 0;
    for (std::int64_t l = 0; l < keep.layers; ++l)
      for (std::int64_t h = 0; h < keep.kv_heads; ++h)
        for (std::int64_t i = 0; i < n; ++i)
          if (i < first || i >= n - recent) {
            keep.head(l, h)[static_cast<std::size_t>(i)] = 1;
            ++count;
          }
    ++selections;
    return count;
  }
  void forget(std::int64_t) override { ++forgotten; }

  double worst_score_error = 0;
  std::int64_t selections = 0, forgotten = 0;

 private:
  std::int64_t budget_, sinks_;
  std::int32_t scored_;
  std::int64_t score_sum_;
};

// KIVI under a KV policy (quantize and evict): a policy that drops nothing streams exactly what
// KIVI streams alone (the same PPL within 1e-5, the same KL within 1e-6); one that keeps 4 sinks
// and the newest 36 of 80 costs more than KIVI alone, within its budget (each kept row stays in
// its slot and group: nothing is quantized twice).
TEST(Perplexity, KiviUnderAPolicyKeepsItsGroupsInPlace) {
  const ModelConfig config = tiny_head_dim_32();
  TinyText text(3 * 80, config);
  const std::int64_t score_sum = config.num_hidden_layers * config.num_attention_heads;
  PerplexityOptions options;
  options.context = 80;
  options.kv_dtype = DType::dtype_kivi2;
  options.kivi_residual = 32;  // groups seal inside a chunk
  const PerplexityResult alone = text.measure(options, 1);
  KeepEnds everything(96, 0, 0, score_sum);
  options.policy = &everything;
  const PerplexityResult kept = text.measure(options, 1);
  EXPECT_NEAR(kept.ppl(), alone.ppl(), 1e-5 * alone.ppl());
  EXPECT_NEAR(kept.mean_kl(), alone.mean_kl(), 1e-6);
  KeepEnds ends(40, 4, 0, score_sum);
  options.policy = &ends;
  const PerplexityResult evicted = text.measure(options, 1);
  ASSERT_TRUE(evicted.compared);
  EXPECT_TRUE(std::isfinite(evicted.ppl()));
  EXPECT_GT(evicted.mean_kl(), alone.mean_kl());
  EXPECT_GT(evicted.kv_kept.selections, 0);
  EXPECT_LE(evicted.kv_kept.mean_held(), 40.0);
}

// A policy that keeps every position streams the chunks step by step and still computes the
// exact run: the same perplexity (1e-4 relative: other chunkings of the same sums), KL ~ 0.
TEST(Perplexity, StreamedThroughAPolicyThatKeepsAllItEqualsTheExactRun) {
  TinyText text(4 * 32);
  const ModelConfig& c = text.weights.config;
  PerplexityOptions options;
  options.context = 32;
  const double exact = text.measure(options, 1).ppl();
  KeepEnds all(64, 0, 3, c.num_hidden_layers * c.num_attention_heads);
  options.policy = &all;
  options.policy_step = 5;  // 32 = 6 x 5 + 2: a short last step
  const PerplexityResult r = text.measure(options, 1);
  ASSERT_TRUE(r.compared);
  EXPECT_NEAR(r.ppl() / exact, 1.0, 1e-4);
  EXPECT_LT(r.mean_kl(), 1e-6);
  EXPECT_DOUBLE_EQ(r.top1_agreement(), 1.0);
  EXPECT_EQ(all.selections, 4 * 7);        // every step of every chunk
  EXPECT_EQ(all.forgotten, 4);             // every chunk at its end
  EXPECT_LT(all.worst_score_error, 1e-3);  // softmax rows sum to 1 (fp32)
}

// Keeping the newest B positions between one-token steps is window attention over B + 1
// positions (each query sees the B kept and itself): the same perplexity as options.window,
// through views whose positions no longer start at 0. With 2 sinks kept, it differs from it.
TEST(Perplexity, StreamedWindowPolicyIsWindowAttention) {
  TinyText text(3 * 40);
  const ModelConfig& c = text.weights.config;
  PerplexityOptions options;
  options.context = 40;
  options.compare_with_exact = false;
  options.window = 9;
  const double window_ppl = text.measure(options, 1).ppl();
  options.window.reset();
  KeepEnds newest(8, 0, 1, c.num_hidden_layers * c.num_attention_heads);
  options.policy = &newest;
  options.policy_step = 1;
  EXPECT_NEAR(text.measure(options, 1).ppl() / window_ppl, 1.0, 1e-4);
  EXPECT_LT(newest.worst_score_error, 1e-3);
  // Its exact run holds the whole chunks, 3 at once, in their own slots (the stream needs 9 a
  // chunk, the exact run 40): the plain run's perplexity.
  options.compare_with_exact = true;
  const PerplexityResult compared = text.measure(options, 1);
  PerplexityOptions plain;
  plain.context = 40;
  EXPECT_NEAR(compared.exact_ppl() / text.measure(plain, 1).ppl(), 1.0, 1e-6);
  KeepEnds sinks(8, 2, 0, 0);
  options.policy = &sinks;
  EXPECT_GT(std::abs(text.measure(options, 1).ppl() / window_ppl - 1.0), 1e-3);
}

// Settings measured together share one exact run: each point's figures are what it measures
// alone (1e-9 relative: the same forwards, summed in the same order), in the points' order, and
// points that cut the text differently are refused.
TEST(Perplexity, SettingsMeasuredTogetherEqualEachMeasuredAlone) {
  TinyText text(4 * 32);
  const ModelConfig& c = text.weights.config;
  KeepEnds newest(12, 2, 1, c.num_hidden_layers * c.num_attention_heads);
  std::vector<PerplexityOptions> points(5);
  for (PerplexityOptions& o : points) {
    o.context = 32;
    o.parallel = 3;  // batches of 3 and 1
  }
  points[1].kv_dtype = DType::dtype_f16;
  points[2].kv_dtype = DType::dtype_kv_int8;
  points[2].hadamard = true;
  points[3].window = 5;
  points[4].policy = &newest;
  points[4].policy_step = 4;
  const ModelWeightsView view = weights_view(text.weights);
  std::vector<std::pair<std::size_t, std::int64_t>> progress;
  const std::vector<PerplexityResult> together = measure_perplexity(
      view, [&] { return select_compute_weights(view, "f32"); }, text.tokens, 1, points,
      [&](std::size_t p, const PerplexityResult& r) { progress.emplace_back(p, r.chunks); });
  ASSERT_EQ(together.size(), points.size());
  EXPECT_EQ(progress.size(), 2 * points.size());  // each point after each of the 2 batches
  EXPECT_EQ(progress.back(), std::make_pair(std::size_t{4}, std::int64_t{4}));
  for (std::size_t p = 0; p < points.size(); ++p) {
    const PerplexityResult alone = text.measure(points[p], 1);
    EXPECT_EQ(together[p].compared, alone.compared) << p;
    EXPECT_EQ(together[p].scored_tokens(), alone.scored_tokens()) << p;
    EXPECT_NEAR(together[p].ppl(), alone.ppl(), 1e-9 * alone.ppl()) << p;
    EXPECT_NEAR(together[p].mean_kl(), alone.mean_kl(), 1e-9 * alone.mean_kl() + 1e-15) << p;
    EXPECT_EQ(together[p].top1_agreement(), alone.top1_agreement()) << p;
    if (alone.compared) {
      EXPECT_NEAR(together[p].exact_ppl(), together[0].ppl(), 1e-9 * alone.ppl()) << p;
    }
  }
  EXPECT_GT(together[3].mean_kl(), together[1].mean_kl());  // distinct settings, not one run
  points[2].context = 16;
  test::expect_error_containing(
      [&] {
        (void)measure_perplexity(
            view, [&] { return select_compute_weights(view, "f32"); }, text.tokens, 1, points);
      },
      {"share context, chunks and parallel", "16/0/3"});
}

// A policy that leaves a head with nothing, drops some but keeps more than its budget, holds a
// union beyond its held limit or miscounts what it kept is a clear error naming it.
TEST(Perplexity, RefusesAPolicyThatBreaksItsContract) {
  enum class Lie { empty_head, over_budget, over_held_limit, miscount };
  struct Liar final : KvPolicy {
    Lie lie = Lie::empty_head;
    std::int64_t budget() const override { return 4; }
    std::int32_t scored_queries() const override { return 0; }
    std::int64_t select(const KvPolicyStep& step, const KvKeep& keep) override {
      const std::int64_t n = step.count();
      std::int64_t cells = 0;
      for (std::int64_t row = 0; row < keep.layers * keep.kv_heads; ++row) {
        std::span<std::uint8_t> head = keep.head(row / keep.kv_heads, row % keep.kv_heads);
        const std::int64_t keeps = lie == Lie::over_budget ? n - 1
                                   : lie == Lie::empty_head && row == 1
                                       ? 0
                                       : std::min<std::int64_t>(n, 4);
        // over_held_limit: over budget, heads keep [0, 4) or [1, 5): a union of 5
        const std::int64_t first = lie == Lie::over_held_limit && n > 4 ? row % 2 : n - keeps;
        for (std::int64_t i = first; i < first + keeps; ++i, ++cells)
          head[static_cast<std::size_t>(i)] = 1;
      }
      return lie == Lie::miscount ? cells + 1 : cells;
    }
    void forget(std::int64_t) override {}
  } liar;
  TinyText text(2 * 16);
  PerplexityOptions options;
  options.context = 16;
  options.policy = &liar;
  options.policy_name = "liar";
  options.policy_step = 8;
  for (const Lie lie : {Lie::empty_head, Lie::over_budget, Lie::over_held_limit, Lie::miscount}) {
    liar.lie = lie;
    test::expect_error_containing([&] { (void)text.measure(options, 1); },
                                  {"KV policy \"liar\"", "budget 4"});
  }
}

}  // namespace
}  // namespace kvlab::cpu
