#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include <boost/math/distributions/chi_squared.hpp>

#include "kvlab/engine/pick_tokens.hpp"
#include "kvlab/engine/sampling.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const std::vector<float> kLogits{1.0f, 3.0f, 0.5f, 3.0f, -2.0f, 2.0f};

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  double max_value = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (std::size_t i = 0; i < logits.size(); ++i)
    sum += p[i] = std::exp((logits[i] - max_value) / temperature);
  for (auto& v : p) v /= sum;
  return p;
}

TEST(Sampling, GreedyIsArgmaxWithLowestIdOnTies) {
  Sampler sampler({});
  EXPECT_EQ(sampler.sample(kLogits), 1);  // ids 1 and 3 tie at 3.0
  const std::vector<float> other{-1.0f, -0.5f, -3.0f};
  EXPECT_EQ(sampler.sample(other), 1);
  const auto distribution = sampling_distribution(kLogits, {});
  EXPECT_EQ(distribution[1], 1.0);
  EXPECT_EQ(std::accumulate(distribution.begin(), distribution.end(), 0.0), 1.0);
}

TEST(Sampling, TemperatureScalesTheSoftmax) {
  SamplingParams p;
  p.temperature = 0.7;
  const auto distribution = sampling_distribution(kLogits, p);
  const auto expected = softmax(kLogits, 0.7);
  for (std::size_t i = 0; i < kLogits.size(); ++i)
    EXPECT_NEAR(distribution[i], expected[i], 1e-12) << i;
}

TEST(Sampling, TopKKeepsTheKMostLikely) {
  SamplingParams p;
  p.temperature = 1.0;
  p.top_k = 3;  // ids 1, 3 (3.0) and 5 (2.0)
  const auto distribution = sampling_distribution(kLogits, p);
  const auto full = softmax(kLogits, 1.0);
  const double kept = full[1] + full[3] + full[5];
  for (int i : {0, 2, 4}) EXPECT_EQ(distribution[static_cast<std::size_t>(i)], 0.0) << i;
  for (int i : {1, 3, 5})
    EXPECT_NEAR(distribution[static_cast<std::size_t>(i)], full[static_cast<std::size_t>(i)] / kept,
                1e-12)
        << i;
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  const auto full = softmax(kLogits, 1.0);
  // Sorted: 1, 3 (each ~0.38), 5 (~0.14), 0 (~0.05), 2, 4.
  SamplingParams p;
  p.temperature = 1.0;
  p.top_p = full[1] + full[3] - 1e-9;  // the two 3.0 logits are enough
  auto distribution = sampling_distribution(kLogits, p);
  EXPECT_NEAR(distribution[1], 0.5, 1e-12);
  EXPECT_NEAR(distribution[3], 0.5, 1e-12);
  EXPECT_EQ(distribution[5], 0.0);
  p.top_p = full[1] + full[3] + 1e-6;  // just past them: the third token joins
  distribution = sampling_distribution(kLogits, p);
  EXPECT_GT(distribution[5], 0.0);
  EXPECT_EQ(distribution[0], 0.0);
  const double kept_mass = std::accumulate(distribution.begin(), distribution.end(), 0.0);
  EXPECT_NEAR(kept_mass, 1.0, 1e-12);
  p.top_p = 1e-9;  // always at least one token
  distribution = sampling_distribution(kLogits, p);
  EXPECT_EQ(distribution[1], 1.0);
}

TEST(Sampling, TopKThenTopPComposeAsInHuggingFace) {
  SamplingParams p;
  p.temperature = 1.0;
  p.top_k = 3;
  p.top_p = 0.9;  // of the renormalised top-3 (0.42, 0.42, 0.16): needs all three
  const auto distribution = sampling_distribution(kLogits, p);
  EXPECT_GT(distribution[5], 0.0);
  EXPECT_EQ(distribution[0], 0.0);
}

TEST(Sampling, SameSeedSameTokensDifferentSeedDifferentTokens) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 1234;
  Sampler a(p), b(p);
  p.seed = 1235;
  Sampler c(p);
  std::vector<std::int32_t> ta, tb, tc;
  for (int i = 0; i < 200; ++i) {
    ta.push_back(a.sample(kLogits));
    tb.push_back(b.sample(kLogits));
    tc.push_back(c.sample(kLogits));
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

TEST(Sampling, FrequenciesFollowTheDistribution) {
  SamplingParams p;
  p.temperature = 0.8;
  p.top_k = 4;
  p.seed = 99;
  Sampler sampler(p);
  const auto expected = sampling_distribution(kLogits, p);
  constexpr int kDraws = 200000;
  std::map<std::int32_t, int> counts;
  for (int i = 0; i < kDraws; ++i) ++counts[sampler.sample(kLogits)];
  for (std::size_t token = 0; token < expected.size(); ++token) {
    const double observed = counts[static_cast<std::int32_t>(token)] / static_cast<double>(kDraws);
    const double sigma = std::sqrt(expected[token] * (1 - expected[token]) / kDraws);
    EXPECT_NEAR(observed, expected[token], 5 * sigma + 1e-12) << "token " << token;  // 5 sigma
  }
}

TEST(Sampling, LogprobsAreLogSoftmax) {
  const auto top = top_logprobs(kLogits, 3);
  ASSERT_EQ(top.size(), 3u);
  const auto p = softmax(kLogits, 1.0);
  EXPECT_EQ(top[0].token, 1);
  EXPECT_EQ(top[1].token, 3);
  EXPECT_EQ(top[2].token, 5);
  for (const auto& t : top)
    EXPECT_NEAR(t.logprob, std::log(p[static_cast<std::size_t>(t.token)]), 1e-6);
  EXPECT_NEAR(token_logprob(kLogits, 4), std::log(p[4]), 1e-6);
  EXPECT_EQ(top_logprobs(kLogits, 100).size(), kLogits.size());
}

// The k first tokens are those of a full sort by (logit desc, id asc), ties across the k-th
// place included; generated_logprobs is token_logprob and top_logprobs at once, bit for bit.
TEST(Sampling, TopLogprobsAreTheFullSortsFirstTokens) {
  std::mt19937 rng(5);
  std::vector<float> logits(3000);
  for (float& v : logits) v = static_cast<float>(rng() % 40) * 0.25f;  // ~75 ties per value
  std::vector<std::int32_t> sorted(logits.size());
  std::iota(sorted.begin(), sorted.end(), 0);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; });
  for (const std::int32_t k : {0, 1, 7, 20}) {
    const auto top = top_logprobs(logits, k);
    ASSERT_EQ(top.size(), static_cast<std::size_t>(k));
    for (std::int32_t i = 0; i < k; ++i) EXPECT_EQ(top[i].token, sorted[i]) << k << " " << i;
    const GeneratedLogprobs both = generated_logprobs(logits, 17, k);
    EXPECT_EQ(both.logprob, token_logprob(logits, 17));
    ASSERT_EQ(both.top.size(), top.size());
    for (std::size_t i = 0; i < top.size(); ++i) {
      EXPECT_EQ(both.top[i].token, top[i].token);
      EXPECT_EQ(both.top[i].logprob, top[i].logprob);
    }
  }
}

// As the temperature goes to 0 the sampled token converges to the argmax (the first of tied
// maxima gets half the mass each with its twin; the last id never appears). 1e-20 used to
// overflow exp() in a fused multiply-subtract and return the last vocabulary id.
TEST(Sampling, TinyTemperaturesConvergeToGreedy) {
  std::vector<float> logits(512);
  for (std::size_t i = 0; i < logits.size(); ++i)
    logits[i] = 0.001f * static_cast<float>((i * 7919) % 512) - 0.2f;  // one max, at id 279
  const auto greedy = Sampler({}).sample(logits);
  for (double temperature : {1e-6, 1e-8, 1e-20, 1e-300, 5e-324}) {
    SamplingParams p;
    p.temperature = temperature;
    p.seed = 3;
    Sampler sampler(p);
    for (int draw = 0; draw < 16; ++draw)
      EXPECT_EQ(sampler.sample(logits), greedy) << "temperature " << temperature;
    const auto distribution = sampling_distribution(logits, p);
    EXPECT_DOUBLE_EQ(distribution[static_cast<std::size_t>(greedy)], 1.0) << temperature;
    for (double v : distribution) EXPECT_FALSE(std::isnan(v)) << temperature;
  }
  SamplingParams tied;
  tied.temperature = 1e-20;
  const auto distribution = sampling_distribution(kLogits, tied);  // ids 1 and 3 tie at 3.0
  EXPECT_DOUBLE_EQ(distribution[1], 0.5);
  EXPECT_DOUBLE_EQ(distribution[3], 0.5);
}

TEST(Sampling, LargeLogitsStayFinite) {
  const std::vector<float> logits{3e38f, -3e38f, 2.9e38f};
  SamplingParams p;
  p.temperature = 0.5;
  const auto distribution = sampling_distribution(logits, p);
  EXPECT_DOUBLE_EQ(distribution[0], 1.0);
  EXPECT_TRUE(std::isfinite(token_logprob(logits, 0)));
}

TEST(Sampling, NonFiniteLogitsAreFound) {
  EXPECT_EQ(first_non_finite(kLogits), std::nullopt);
  std::vector<float> bad = kLogits;
  bad[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(first_non_finite(bad), 4u);
  bad[2] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_non_finite(bad), 2u);
}

TEST(Sampling, InvalidParametersAreNamed) {
  auto message = [](SamplingParams p) {
    return test::error_of<Error>([&] { validate_sampling_params(p); });
  };
  SamplingParams p;
  p.temperature = -0.1;
  EXPECT_NE(message(p).find("temperature"), std::string::npos);
  p = {};
  p.top_p = 0.0;
  EXPECT_NE(message(p).find("top_p"), std::string::npos);
  p = {};
  p.top_k = -1;
  EXPECT_NE(message(p).find("top_k"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(message(p).find("max_tokens"), std::string::npos);
  for (const std::int32_t bad : {-2, kMaxLogprobs + 1}) {
    p = {};
    p.logprobs = bad;
    EXPECT_NE(message(p).find("logprobs must be in [0, 20]"), std::string::npos) << bad;
  }
  p = {};
  p.logprobs = kMaxLogprobs;
  EXPECT_NO_THROW(validate_sampling_params(p));
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// Greedy is the first maximum wherever it lies: in the lanes, on a tie, in the ragged tail.
TEST(Sampling, GreedyPicksTheFirstMaximumAnywhereInTheVocabulary) {
  for (const std::size_t vocab : {5u, 16u, 517u, 32000u}) {
    for (const std::size_t at : {std::size_t{0}, vocab / 3, vocab - 1}) {
      std::vector<float> logits(vocab, -1.0f);
      logits[at] = 2.0f;
      if (at + 9 < vocab) logits[at + 9] = 2.0f;  // a tie later: the first one wins
      Sampler greedy(SamplingParams{});
      EXPECT_EQ(greedy.sample(logits), static_cast<std::int32_t>(at)) << vocab << " " << at;
    }
  }
}

TEST(Sampling, FirstNonFiniteFindsTheFirstInfOrNan) {
  std::vector<float> logits(1000, 0.5f);
  EXPECT_FALSE(first_non_finite(logits));
  logits[700] = std::numeric_limits<float>::quiet_NaN();
  logits[999] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_non_finite(logits), 700u);
  logits[3] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(first_non_finite(logits), 3u);
  logits[3] = std::numeric_limits<float>::max();  // the largest finite float is fine
  EXPECT_EQ(first_non_finite(logits), 700u);
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// Pearson's chi-square of `counts` against `probabilities` (bins with p = 0 must stay empty).
double chi_square(const std::vector<std::int64_t>& counts, const std::vector<double>& probabilities,
                  std::int64_t draws, int& bins) {
  double statistic = 0;
  bins = 0;
  for (std::size_t t = 0; t < counts.size(); ++t) {
    if (probabilities[t] <= 0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " is outside the sampled set";
      continue;
    }
    const double expected = probabilities[t] * static_cast<double>(draws);
    statistic += (static_cast<double>(counts[t]) - expected) *
                 (static_cast<double>(counts[t]) - expected) / expected;
    ++bins;
  }
  return statistic;
}

// Speculative sampling keeps the target's distribution (Leviathan et al. 2023): with two
// proposals verified against three rows of logits, the first emitted token follows row 0's
// sampling distribution, the second (when the first proposal was accepted) row 1's, the third
// (both accepted) row 2's. Chi-square goodness of fit over 200,000 seeded verifies, each below
// its 0.999 quantile (df = kept tokens - 1); a token outside top-p never appears.
TEST(Sampling, SpeculativeSamplingEmitsTheTargetsDistributionAtEachPosition) {
  const std::size_t vocab = 6;
  const std::vector<float> rows{1.0f, 3.0f, 0.5f, 3.0f,  -2.0f, 2.0f,   // row 0
                                0.0f, 0.2f, 2.5f, -1.0f, 1.0f,  1.5f,   // row 1
                                2.0f, 2.0f, 0.0f, 1.0f,  -3.0f, 0.5f};  // row 2
  const std::vector<std::int32_t> proposed{3, 5};  // likely at row 0, less so at row 1
  SamplingParams params;
  params.temperature = 0.8;
  params.top_p = 0.95;
  params.seed = 42;
  Sampler sampler(params);
  std::vector<std::vector<double>> p;
  for (std::size_t r = 0; r < 3; ++r)
    p.push_back(sampling_distribution(std::span(rows).subspan(r * vocab, vocab), params));
  std::vector<std::vector<std::int64_t>> counts(3, std::vector<std::int64_t>(vocab, 0));
  std::int64_t draws[3] = {0, 0, 0};
  const std::int64_t verifies = 200000;
  std::int64_t accepted = 0;
  for (std::int64_t v = 0; v < verifies; ++v) {
    const double bonus = sampler.next_uniform();
    const SampledVerify out = verify_sampled(rows, vocab, proposed, params, sampler, bonus, {});
    ASSERT_GE(out.token, 0);
    accepted += out.accepted;
    // The tokens emitted at positions 0 .. accepted: the accepted proposals, then the token.
    for (std::int64_t i = 0; i <= out.accepted; ++i) {
      const std::int32_t token =
          i < out.accepted ? proposed[static_cast<std::size_t>(i)] : out.token;
      ++counts[static_cast<std::size_t>(i)][static_cast<std::size_t>(token)];
      ++draws[i];
    }
  }
  for (std::size_t r = 0; r < 3; ++r) {
    int bins = 0;
    const double statistic = chi_square(counts[r], p[r], draws[r], bins);
    const boost::math::chi_squared distribution(bins - 1);
    EXPECT_LT(statistic, boost::math::quantile(distribution, 0.999))
        << "position " << r << " over " << draws[r] << " draws, " << bins << " tokens";
  }
  // Acceptance as the formula says: p0(3) + p0(3) p1(5).
  EXPECT_NEAR(static_cast<double>(accepted) / verifies, p[0][3] + p[0][3] * p[1][5], 0.01);
}

}  // namespace
}  // namespace kvlab
