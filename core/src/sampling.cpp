#include "kvlab/sampling.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

std::int32_t argmax(std::span<const float> logits) {
  // std::max_element returns the first maximum: the lowest id wins ties.
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

double log_sum_exp(std::span<const float> logits, double scale) {
  double max_value = -std::numeric_limits<double>::infinity();
  for (float v : logits) max_value = std::max(max_value, static_cast<double>(v) * scale);
  double sum = 0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) * scale - max_value);
  return max_value + std::log(sum);
}

// Candidate (token, probability) pairs after temperature / top-k / top-p, most likely first,
// probabilities renormalised to sum to 1.
std::vector<std::pair<std::int32_t, double>> kept_candidates(std::span<const float> logits,
                                                             const SamplingParams& p) {
  const double inv_temperature = 1.0 / p.temperature;
  const double normaliser = log_sum_exp(logits, inv_temperature);
  std::vector<std::pair<std::int32_t, double>> candidates(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i)
    candidates[i] = {static_cast<std::int32_t>(i),
                     std::exp(static_cast<double>(logits[i]) * inv_temperature - normaliser)};
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
}

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, std::int32_t k) {
  const double normaliser = log_sum_exp(logits, 1.0);
  std::vector<std::int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const auto count = std::min<std::size_t>(static_cast<std::size_t>(std::max(k, 0)), ids.size());
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(count), ids.end(),
                    [&](std::int32_t a, std::int32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  std::vector<TokenLogprob> out;
  for (std::size_t i = 0; i < count; ++i)
    out.push_back({ids[i], static_cast<float>(static_cast<double>(logits[ids[i]]) - normaliser)});
  return out;
}

float token_logprob(std::span<const float> logits, std::int32_t token) {
  return static_cast<float>(static_cast<double>(logits[token]) - log_sum_exp(logits, 1.0));
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

std::int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0) return argmax(logits);
  const auto candidates = kept_candidates(logits, params_);
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // uniform [0, 1), 53 bits
  double cumulative = 0;
  for (const auto& [token, probability] : candidates) {
    cumulative += probability;
    if (u < cumulative) return token;
  }
  return candidates.back().first;  // u landed in the rounding slack at the top
}

}  // namespace kvlab
