#include <gtest/gtest.h>

#include <thread>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "cpu_reference/test_models.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

// Position t's attention output (heads x head_dim) over positions <= t (within `window`): q, k
// and v hold every position's roped query, key and value rows.
std::vector<double> naive_attention(const ModelConfig& c, const std::vector<std::vector<double>>& q,
                                    const std::vector<std::vector<double>>& k,
                                    const std::vector<std::vector<double>>& v, std::size_t t,
                                    std::optional<std::int64_t> window) {
  const auto hd = static_cast<std::size_t>(c.head_dim);
  const auto heads = static_cast<std::size_t>(c.num_attention_heads);
  const auto kv_heads = static_cast<std::size_t>(c.num_key_value_heads);
  std::vector<double> attention(heads * hd, 0.0);
  for (std::size_t h = 0; h < heads; ++h) {
    const std::size_t kvh = h / (heads / kv_heads);
    std::vector<double> scores;
    std::vector<std::size_t> keys;
    for (std::size_t j = 0; j <= t; ++j) {
      if (window && t - j >= static_cast<std::size_t>(*window)) continue;
      double s = 0;
      for (std::size_t i = 0; i < hd; ++i) s += q[t][h * hd + i] * k[j][kvh * hd + i];
      scores.push_back(s / std::sqrt(static_cast<double>(hd)));
      keys.push_back(j);
    }
    const double m = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (auto& s : scores) sum += s = std::exp(s - m);
    for (std::size_t n = 0; n < keys.size(); ++n)
      for (std::size_t i = 0; i < hd; ++i)
        attention[h * hd + i] += scores[n] / sum * v[keys[n]][kvh * hd + i];
  }
  return attention;
}

// An independent forward written as plain scalar loops in double precision, straight from the
// formulas (llama2.c style), sharing no code with the Eigen reference.
std::vector<std::vector<double>> naive_forward(const LlamaWeights& w,
                                               const std::vector<std::int32_t>& tokens,
                                               std::optional<std::int64_t> window = std::nullopt) {
  const ModelConfig& c = w.config;
  const auto T = tokens.size();
  const auto dim = static_cast<std::size_t>(c.hidden_size);
  const auto hd = static_cast<std::size_t>(c.head_dim);
  const auto heads = static_cast<std::size_t>(c.num_attention_heads);
  const auto kv_heads = static_cast<std::size_t>(c.num_key_value_heads);
  const auto ffn = static_cast<std::size_t>(c.intermediate_size);
  auto matvec = [](const auto& m, const std::vector<double>& x) {  // m: (out, in)
    std::vector<double> y(static_cast<std::size_t>(m.rows()), 0.0);
    for (Eigen::Index r = 0; r < m.rows(); ++r)
      for (Eigen::Index i = 0; i < m.cols(); ++i)
        y[static_cast<std::size_t>(r)] += m(r, i) * x[static_cast<std::size_t>(i)];
    return y;
  };
  auto rmsnorm = [&](const std::vector<double>& x, const Eigen::VectorXf& g) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + c.rms_norm_eps);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * g(static_cast<Eigen::Index>(i));
    return y;
  };
  auto rope = [&](std::vector<double>& v, std::size_t n_heads, std::size_t pos) {
    for (std::size_t h = 0; h < n_heads; ++h)
      for (std::size_t i = 0; i < hd / 2; ++i) {
        const double angle =
            static_cast<double>(pos) *
            std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
        const double a = v[h * hd + i], b = v[h * hd + i + hd / 2];
        v[h * hd + i] = a * std::cos(angle) - b * std::sin(angle);
        v[h * hd + i + hd / 2] = b * std::cos(angle) + a * std::sin(angle);
      }
  };
  std::vector<std::vector<double>> x(T, std::vector<double>(dim));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < dim; ++i)
      x[t][i] = w.embedding(tokens[t], static_cast<Eigen::Index>(i));
  for (const auto& layer : w.layers) {
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (std::size_t t = 0; t < T; ++t) {
      const auto xn = rmsnorm(x[t], layer.attention_norm);
      q[t] = matvec(layer.wq(), xn);
      k[t] = matvec(layer.wk(), xn);
      v[t] = matvec(layer.wv(), xn);
      rope(q[t], heads, t);
      rope(k[t], kv_heads, t);
    }
    for (std::size_t t = 0; t < T; ++t) {
      const auto projected = matvec(layer.wo, naive_attention(c, q, k, v, t, window));
      for (std::size_t i = 0; i < dim; ++i) x[t][i] += projected[i];
    }
    for (std::size_t t = 0; t < T; ++t) {
      const auto xn = rmsnorm(x[t], layer.mlp_norm);
      const auto g = matvec(layer.w_gate(), xn), u = matvec(layer.w_up(), xn);
      std::vector<double> hidden(ffn);
      for (std::size_t i = 0; i < ffn; ++i) hidden[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const auto down = matvec(layer.w_down, hidden);
      for (std::size_t i = 0; i < dim; ++i) x[t][i] += down[i];
    }
  }
  std::vector<std::vector<double>> logits(T);
  for (std::size_t t = 0; t < T; ++t)
    logits[t] = matvec(w.output_projection(), rmsnorm(x[t], w.final_norm));
  return logits;
}

using test::scaled_random_weights;

void expect_matches_naive(const LlamaWeights& weights, const std::vector<std::int32_t>& tokens,
                          std::optional<std::int64_t> window = std::nullopt) {
  const ReferenceModel model(weights);
  ForwardOptions options;
  options.sliding_window = window;
  const RowMatrix logits = model.forward(tokens, options);
  const auto expected = naive_forward(weights, tokens, window);
  ASSERT_EQ(logits.rows(), static_cast<Eigen::Index>(tokens.size()));
  test::Closeness worst;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    std::vector<float> expected_row(expected[t].begin(), expected[t].end());
    const auto c =
        test::compare(std::span<const float>(logits.row(static_cast<Eigen::Index>(t)).data(),
                                             static_cast<std::size_t>(logits.cols())),
                      expected_row);
    worst.max_abs = std::max(worst.max_abs, c.max_abs);
    worst.has_nan |= c.has_nan;
  }
  EXPECT_FALSE(worst.has_nan);
  EXPECT_LT(worst.max_abs, 1e-4) << "fp32 Eigen vs fp64 loops, logits O(1)";
}

TEST(ReferenceModel, OneLayerMatchesHandWrittenLoops) {
  ModelConfig c = model_preset("tiny");
  c.num_hidden_layers = 1;
  c.vocab_size = 64;
  expect_matches_naive(scaled_random_weights(c, 11), {1, 5, 9, 13, 2, 63, 0});
}

TEST(ReferenceModel, GqaTwoLayersMatchHandWrittenLoops) {
  const ModelConfig c = model_preset("tiny");  // 4 query heads, 2 KV heads
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < 150; ++i)
    tokens.push_back((i * 37 + 11) % 512);  // crosses the 64-query blocks
  expect_matches_naive(scaled_random_weights(c, 12), tokens);
}

TEST(ReferenceModel, MqaAndTiedEmbeddingsMatchHandWrittenLoops) {
  ModelConfig c = model_preset("tiny");
  c.num_key_value_heads = 1;
  c.tie_word_embeddings = true;
  expect_matches_naive(scaled_random_weights(c, 13), {3, 1, 4, 1, 5, 9, 2, 6});
}

TEST(ReferenceModel, SlidingWindowMatchesHandWrittenLoops) {
  const ModelConfig c = model_preset("tiny");
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < 100; ++i) tokens.push_back((i * 13) % 512);
  expect_matches_naive(scaled_random_weights(c, 14), tokens, 5);
}

TEST(ReferenceModel, SingleTokenClosedForm) {
  // With one token, attention returns V exactly (softmax over one key is 1) and RoPE at
  // position 0 is the identity, so the forward is a closed-form chain of matrix products.
  ModelConfig c = model_preset("tiny");
  c.num_hidden_layers = 1;
  const LlamaWeights w = scaled_random_weights(c, 15);
  const ReferenceModel model(w);
  const std::int32_t token = 42;
  const RowMatrix logits = model.forward(std::vector<std::int32_t>{token});
  auto norm = [&](const Eigen::RowVectorXd& x, const Eigen::VectorXf& g) {
    return Eigen::RowVectorXd(
        x.array() / std::sqrt(x.squaredNorm() / static_cast<double>(x.size()) + c.rms_norm_eps) *
        g.cast<double>().transpose().array());
  };
  const auto& layer = w.layers[0];
  Eigen::RowVectorXd x = w.embedding.row(token).cast<double>();
  Eigen::RowVectorXd v =
      norm(x, layer.attention_norm) * layer.wv().cast<double>().transpose();  // (kv_dim)
  Eigen::RowVectorXd attention(c.q_dim());
  for (std::int64_t h = 0; h < c.num_attention_heads; ++h)
    attention.segment(h * c.head_dim, c.head_dim) =
        v.segment((h / c.group_size()) * c.head_dim, c.head_dim);
  x += attention * layer.wo.cast<double>().transpose();
  const Eigen::RowVectorXd xn = norm(x, layer.mlp_norm);
  const Eigen::ArrayXXd g = (xn * layer.w_gate().cast<double>().transpose()).array();
  const Eigen::ArrayXXd u = (xn * layer.w_up().cast<double>().transpose()).array();
  x += (g / (1.0 + (-g).exp()) * u).matrix() * layer.w_down.cast<double>().transpose();
  const Eigen::RowVectorXd expected = norm(x, w.final_norm) * w.lm_head.cast<double>().transpose();
  EXPECT_LT((logits.row(0).cast<double>() - expected).cwiseAbs().maxCoeff(), 1e-4);
  EXPECT_TRUE(logits.allFinite());
}

// More threads than processors only oversubscribes (and OpenBLAS at 64+ threads under an
// address-space limit spins forever): requests are capped to the processors.
TEST(Threads, CappedToTheProcessors) {
  const int threads = num_threads();
  set_num_threads(4096);
  EXPECT_LE(num_threads(), static_cast<int>(std::thread::hardware_concurrency()));
  EXPECT_GE(num_threads(), 1);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), 1);
  set_num_threads(threads);
}

// OMP_THREAD_LIMIT caps the threads an experiment file asks for (the test suite sets 1: ctest runs
// two tests at once). Run by ctest as cpu_reference.thread_limit, with the limit set.
TEST(Threads, CappedByOmpThreadLimit) {
  const char* limit = std::getenv("OMP_THREAD_LIMIT");
  ASSERT_NE(limit, nullptr) << "ctest sets OMP_THREAD_LIMIT for this test";
  const int threads = num_threads();
  set_num_threads(4096);
  EXPECT_EQ(num_threads(),
            std::min(std::stoi(limit), static_cast<int>(std::thread::hardware_concurrency())));
  set_num_threads(threads);
}

TEST(ReferenceModel, DeterministicAndThreadCountIndependent) {
  const ReferenceModel model(random_llama_weights(model_preset("tiny"), 3));
  std::vector<std::int32_t> tokens;
  for (int i = 0; i < 200; ++i) tokens.push_back((i * 7) % 512);
  const int threads = num_threads();
  set_num_threads(2);
  const RowMatrix a = model.forward(tokens), b = model.forward(tokens);
  EXPECT_EQ(a, b);  // same run, same bits
  set_num_threads(1);
  const RowMatrix single = model.forward(tokens);
  set_num_threads(threads);
  const auto c =
      test::compare(std::span<const float>(single.data(), static_cast<std::size_t>(single.size())),
                    std::span<const float>(a.data(), static_cast<std::size_t>(a.size())));
  EXPECT_FALSE(c.has_nan);
  EXPECT_LT(c.max_abs, 1e-5);
}

TEST(ReferenceModel, CausalityAndLastPositionOnly) {
  const ReferenceModel model(random_llama_weights(model_preset("tiny"), 4));
  const std::vector<std::int32_t> prefix{1, 2, 3, 4, 5};
  std::vector<std::int32_t> longer = prefix;
  longer.insert(longer.end(), {6, 7, 8});
  const RowMatrix short_logits = model.forward(prefix);
  const RowMatrix long_logits = model.forward(longer);
  // Later tokens never change earlier positions' logits.
  EXPECT_LT((long_logits.topRows(5) - short_logits).cwiseAbs().maxCoeff(), 1e-5);
  ForwardOptions last;
  last.last_position_only = true;
  const RowMatrix only = model.forward(longer, last);
  ASSERT_EQ(only.rows(), 1);
  EXPECT_LT((only.row(0) - long_logits.row(7)).cwiseAbs().maxCoeff(), 1e-5);
}

TEST(ReferenceModel, BadSequencesAreClearErrors) {
  const ReferenceModel model(random_llama_weights(model_preset("tiny"), 4));
  auto message = [&](std::vector<std::int32_t> tokens) {
    return test::error_of<Error>([&] { model.forward(tokens); });
  };
  EXPECT_NE(message({}).find("empty"), std::string::npos);
  EXPECT_NE(message({1, 512}).find("token id 512 at position 1 is outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(message({-3}).find("token id -3"), std::string::npos);
  EXPECT_NE(message(std::vector<std::int32_t>(513, 1)).find("513 tokens exceed the context"),
            std::string::npos);
}

TEST(ReferenceModel, SizeOnlyPresetIsRefused) {
  EXPECT_NE(test::error_of<Error>([] {
              random_llama_weights(model_preset("llama-7b"), 0);
            }).find("size-only"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab::cpu
