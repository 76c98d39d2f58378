// measure_perplexity (cpu_reference/perplexity.hpp) against the full-recompute reference: the
// same protocol computed by hand from ReferenceModel logits, its option checks, and the exact
// run it compares a rounded KV with. Tolerance: 1e-4 relative on perplexity (fp32 logits of
// two computations of the same function, summed in double).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kvlab/cpu_reference/perplexity.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

struct TinyText {
  LlamaWeights weights = random_llama_weights(model_preset("tiny"), 3);
  std::vector<std::int32_t> tokens;
  explicit TinyText(std::size_t n) {
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

}  // namespace
}  // namespace kvlab::cpu
