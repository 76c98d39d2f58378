#include "kvlab/engine/sampling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// The first maximum: the lowest id wins ties (as std::max_element, which it equals on finite
// logits). Eight independent running maxima, then a search for the first equal value: twice the
// reads of one pass, but without its serial dependency (a token per step at a 32k-150k vocab).
std::int32_t argmax(std::span<const float> logits) {
  constexpr std::size_t kLanes = 8;
  if (logits.size() < 2 * kLanes)
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  std::array<float, kLanes> lane{};
  std::copy_n(logits.begin(), kLanes, lane.begin());
  std::size_t i = kLanes;
  for (; i + kLanes <= logits.size(); i += kLanes)
    for (std::size_t l = 0; l < kLanes; ++l)
      lane[l] = logits[i + l] > lane[l] ? logits[i + l] : lane[l];
  float best = *std::max_element(lane.begin(), lane.end());
  for (; i < logits.size(); ++i) best = logits[i] > best ? logits[i] : best;
  return static_cast<std::int32_t>(std::find(logits.begin(), logits.end(), best) - logits.begin());
}

// (logit - max_logit) / temperature, computed so that it cannot overflow or turn into NaN:
// the max logit scores exactly 0 whatever the temperature (1e-20 makes 1/T = 1e20, and a
// fused multiply-subtract of logit * 1e20 - max * 1e20 leaves the rounding error, ~1e4, which
// exp() overflows); every other logit scores a negative number or -inf. As T -> 0 the
// distribution thus converges to the argmax's one-hot.
double scaled_logit(float logit, float max_logit, double inv_temperature) {
  if (logit == max_logit) return 0.0;
  return (static_cast<double>(logit) - static_cast<double>(max_logit)) * inv_temperature;
}

// log(sum(exp(scaled_logit))), >= 0 (the max term is exp(0) = 1).
double log_sum_exp(std::span<const float> logits, float max_logit, double inv_temperature) {
  double sum = 0;
  for (float v : logits) sum += std::exp(scaled_logit(v, max_logit, inv_temperature));
  return std::log(sum);
}

// Candidate (token, probability) pairs after temperature / top-k / top-p, most likely first,
// probabilities renormalised to sum to 1.
std::vector<std::pair<std::int32_t, double>> kept_candidates(std::span<const float> logits,
                                                             const SamplingParams& p) {
  const double inv_temperature = 1.0 / p.temperature;  // may be +inf for subnormal T: fine
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  const double normaliser = log_sum_exp(logits, max_logit, inv_temperature);
  std::vector<std::pair<std::int32_t, double>> candidates(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i)
    candidates[i] = {static_cast<std::int32_t>(i),
                     std::exp(scaled_logit(logits[i], max_logit, inv_temperature) - normaliser)};
  auto more_likely = [](const auto& a, const auto& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  };
  if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < candidates.size()) {
    std::nth_element(candidates.begin(), candidates.begin() + p.top_k, candidates.end(),
                     more_likely);
    candidates.resize(static_cast<std::size_t>(p.top_k));
  }
  std::sort(candidates.begin(), candidates.end(), more_likely);
  double mass = 0;
  for (const auto& c : candidates) mass += c.second;
  if (p.top_p < 1.0) {
    // Smallest prefix whose (renormalised) mass reaches top_p; always at least one token.
    double cumulative = 0;
    std::size_t keep = 0;
    while (keep < candidates.size()) {
      cumulative += candidates[keep].second / mass;
      ++keep;
      if (cumulative >= p.top_p) break;
    }
    candidates.resize(keep);
    mass = 0;
    for (const auto& c : candidates) mass += c.second;
  }
  for (auto& c : candidates) c.second /= mass;
  return candidates;
}

}  // namespace

void validate_sampling_params(const SamplingParams& p) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    throw Error(fmt::format("temperature must be a finite number >= 0 (0 = greedy), got {}",
                            p.temperature));
  if (p.top_k < 0) throw Error(fmt::format("top_k must be >= 0 (0 = off), got {}", p.top_k));
  if (!(p.top_p > 0 && p.top_p <= 1))
    throw Error(fmt::format("top_p must be in (0, 1] (1 = off), got {}", p.top_p));
  if (p.max_tokens < 1) throw Error(fmt::format("max_tokens must be >= 1, got {}", p.max_tokens));
  if (p.logprobs < -1 || p.logprobs > kMaxLogprobs)
    throw Error(
        fmt::format("logprobs must be in [0, {}] (or -1 = off), got {}", kMaxLogprobs, p.logprobs));
}

// Blocks checked with an integer test the compiler vectorises (exponent bits all ones = inf or
// NaN); only a block that holds one is searched element by element.
std::optional<std::size_t> first_non_finite(std::span<const float> logits) {
  constexpr std::uint32_t kExponent = 0x7f800000u;
  constexpr std::size_t kBlock = 256;
  for (std::size_t start = 0; start < logits.size(); start += kBlock) {
    const std::size_t end = std::min(logits.size(), start + kBlock);
    std::uint32_t any = 0;
    for (std::size_t i = start; i < end; ++i)
      any |= static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(logits[i]) & kExponent) ==
                                        kExponent);
    if (any == 0) continue;
    for (std::size_t i = start; i < end; ++i)
      if (!std::isfinite(logits[i])) return i;
  }
  return std::nullopt;
}

namespace {

// The k tokens that come first in the candidate order (larger logit first, the lower id first
// among equals), in that order: one pass keeping them sorted (k is at most kMaxLogprobs).
std::vector<std::int32_t> first_tokens(std::span<const float> logits, std::size_t k) {
  std::vector<std::int32_t> best;
  if (k == 0) return best;
  best.reserve(k + 1);
  for (std::size_t i = 0; i < logits.size(); ++i) {
    if (best.size() == k && !(logits[i] > logits[best.back()])) continue;
    const auto at = std::upper_bound(best.begin(), best.end(), logits[i],
                                     [&](float v, std::int32_t b) { return v > logits[b]; });
    best.insert(at, static_cast<std::int32_t>(i));  // after its equals: they have lower ids
    if (best.size() > k) best.pop_back();
  }
  return best;
}

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, std::int32_t k,
                                       double normaliser) {
  std::vector<TokenLogprob> out;
  for (const std::int32_t id : first_tokens(logits, static_cast<std::size_t>(std::max(k, 0))))
    out.push_back({id, static_cast<float>(static_cast<double>(logits[id]) - normaliser)});
  return out;
}

}  // namespace

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, std::int32_t k) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  return top_logprobs(logits, k,
                      static_cast<double>(max_logit) + log_sum_exp(logits, max_logit, 1.0));
}

GeneratedLogprobs generated_logprobs(std::span<const float> logits, std::int32_t token,
                                     std::int32_t k) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  const double log_sum = log_sum_exp(logits, max_logit, 1.0);
  return {static_cast<float>(static_cast<double>(logits[token]) - static_cast<double>(max_logit) -
                             log_sum),
          top_logprobs(logits, k, static_cast<double>(max_logit) + log_sum)};
}

float token_logprob(std::span<const float> logits, std::int32_t token) {
  return generated_logprobs(logits, token, 0).logprob;
}

std::vector<double> sampling_distribution(std::span<const float> logits, const SamplingParams& p) {
  std::vector<double> distribution(logits.size(), 0.0);
  if (p.temperature == 0) {
    distribution[argmax(logits)] = 1.0;
    return distribution;
  }
  for (const auto& [token, probability] : kept_candidates(logits, p))
    distribution[token] = probability;
  return distribution;
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  validate_sampling_params(params);
}

std::int32_t pick_token(std::span<const float> logits, const SamplingParams& params,
                        double uniform) {
  if (params.temperature == 0) return argmax(logits);
  const auto candidates = kept_candidates(logits, params);
  double cumulative = 0;
  for (const auto& [token, probability] : candidates) {
    cumulative += probability;
    if (uniform < cumulative) return token;
  }
  return candidates.back().first;  // the draw landed in the rounding slack at the top
}

double Sampler::next_uniform() {
  return static_cast<double>(rng_() >> 11) * 0x1.0p-53;
}

std::int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0) return argmax(logits);
  return pick_token(logits, params_, next_uniform());
}

}  // namespace kvlab
