#include "kvlab/workload/workload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "draws.hpp"
#include "kvlab/checked_math.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/suggest.hpp"
#include "sources.hpp"

namespace kvlab {
namespace {

using detail::Draw;
using detail::PromptBudget;
using detail::random_tokens;

// Request i's arrival time, the one before it at `clock`.
double next_arrival(const ArrivalProcess& arrival, std::int64_t i, double clock, Draw& draw) {
  switch (arrival.kind) {
    case ArrivalKind::all_at_once:
      return 0;
    case ArrivalKind::poisson:
      return clock + draw.exponential(arrival.rate_per_s);
    case ArrivalKind::gamma: {  // shape 1/cv^2, mean 1/rate
      const double shape = 1.0 / (arrival.cv * arrival.cv);
      return clock + draw.gamma(shape) / (shape * arrival.rate_per_s);
    }
    case ArrivalKind::bursts:  // burst_size requests at once, bursts spaced to keep the mean rate
      if (i % arrival.burst_size == 0 && i > 0)
        return clock + static_cast<double>(arrival.burst_size) / arrival.rate_per_s;
      return clock;
  }
  return clock;
}

void check_arrival(const ArrivalProcess& arrival) {
  if (arrival.kind != ArrivalKind::all_at_once &&
      !(arrival.rate_per_s > 0 && std::isfinite(arrival.rate_per_s)))
    throw Error(fmt::format("workload arrival rate must be a finite number > 0 requests/s, got {}",
                            arrival.rate_per_s));
  if (arrival.kind == ArrivalKind::gamma && !(arrival.cv > 0 && std::isfinite(arrival.cv)))
    throw Error(fmt::format("workload gamma arrival cv must be > 0, got {}", arrival.cv));
  if (arrival.kind == ArrivalKind::bursts && arrival.burst_size < 1)
    throw Error("workload burst_size must be >= 1");
}

void check_length(const LengthDistribution& d, const char* what) {
  if (d.min < 1 || d.max < d.min)
    throw Error(
        fmt::format("workload {}: need 1 <= min <= max, got min {} max {}", what, d.min, d.max));
  if (d.max > kMaxRequestTokens)
    throw Error(fmt::format("workload {}: max {} is above kvlab's limit of {} tokens per request",
                            what, d.max, kMaxRequestTokens));
  if ((d.kind == LengthKind::normal || d.kind == LengthKind::lognormal) &&
      (!(d.mean > 0) || !(d.stddev >= 0)))
    throw Error(fmt::format("workload {}: mean must be > 0 and stddev >= 0", what));
  if (d.kind == LengthKind::zipf && !(d.alpha > 0))
    throw Error(fmt::format("workload {}: zipf alpha must be > 0", what));
  if (d.kind == LengthKind::fixed && !(d.value >= 1))
    throw Error(fmt::format("workload {}: fixed value must be >= 1", what));
}

// The mean of draw_length(d) (zipf: bounded below by min), to size a workload before drawing it.
double expected_length(const LengthDistribution& d) {
  const auto lo = static_cast<double>(d.min), hi = static_cast<double>(d.max);
  switch (d.kind) {
    case LengthKind::fixed:
      return std::clamp(d.value, lo, hi);
    case LengthKind::uniform:
      return (lo + hi) / 2;
    case LengthKind::normal:
    case LengthKind::lognormal:
      return std::clamp(d.mean, lo, hi);
    case LengthKind::zipf:
      break;
  }
  return lo;
}

std::int64_t draw_length(const LengthDistribution& d, Draw& draw) {
  double x = 0;
  switch (d.kind) {
    case LengthKind::fixed:
      x = d.value;
      break;
    case LengthKind::uniform:
      x = static_cast<double>(d.min) +
          std::floor(draw.uniform() * static_cast<double>(d.max - d.min + 1));
      break;
    case LengthKind::normal:
      x = std::round(d.mean + d.stddev * draw.normal());
      break;
    case LengthKind::lognormal: {  // parameters chosen so the lengths have the given mean and
                                   // stddev
      const double sigma2 = std::log(1.0 + (d.stddev * d.stddev) / (d.mean * d.mean));
      const double mu = std::log(d.mean) - sigma2 / 2.0;
      x = std::round(std::exp(mu + std::sqrt(sigma2) * draw.normal()));
      break;
    }
    case LengthKind::zipf: {  // P(k) ~ k^-alpha over [min, max], by inverse CDF
      double total = 0;
      for (std::int64_t k = d.min; k <= d.max; ++k)
        total += std::pow(static_cast<double>(k), -d.alpha);
      double target = draw.uniform() * total;
      x = static_cast<double>(d.max);
      for (std::int64_t k = d.min; k <= d.max; ++k) {
        target -= std::pow(static_cast<double>(k), -d.alpha);
        if (target < 0) {
          x = static_cast<double>(k);
          break;
        }
      }
      break;
    }
  }
  // Clamped as a double first: a fixed value of 1e30 must not reach the integer conversion.
  return static_cast<std::int64_t>(std::clamp(std::isnan(x) ? static_cast<double>(d.min) : x,
                                              static_cast<double>(d.min),
                                              static_cast<double>(d.max)));
}

}  // namespace

SamplingParams workload_sampling(const SyntheticWorkload& spec) {
  SamplingParams sampling;
  sampling.temperature = spec.temperature;
  sampling.top_p = spec.top_p;
  sampling.top_k = spec.top_k;
  sampling.logprobs = spec.logprobs;
  return sampling;
}

std::vector<WorkloadRequest> generate_workload(const SyntheticWorkload& spec) {
  if (spec.requests < 0) throw Error("workload requests must be >= 0");
  if (spec.vocab_size < 1) throw Error("workload vocab_size must be >= 1");
  check_arrival(spec.arrival);
  check_length(spec.prompt_tokens, "prompt_tokens");
  check_length(spec.output_tokens, "output_tokens");
  if (spec.prefix_tokens >= kMaxRequestTokens || spec.prefix_groups > kMaxPrefixGroups)
    throw Error(fmt::format(
        "workload shared prefix: {} groups of {} tokens is above kvlab's "
        "limits ({} groups, {} tokens)",
        spec.prefix_groups, spec.prefix_tokens, kMaxPrefixGroups, kMaxRequestTokens - 1));
  if (spec.prefix_groups < 0 || spec.prefix_tokens < 0 ||
      (spec.prefix_groups > 0) != (spec.prefix_tokens > 0))
    throw Error(
        "workload shared prefix: set both prefix_groups and prefix_tokens (> 0), or neither");
  if (spec.priority_weights.empty() ||
      std::any_of(spec.priority_weights.begin(), spec.priority_weights.end(),
                  [](double w) { return !(w >= 0); }) ||
      std::accumulate(spec.priority_weights.begin(), spec.priority_weights.end(), 0.0) <= 0)
    throw Error("workload priority weights must be >= 0 with a positive sum");

  Draw draw(spec.seed);
  std::vector<std::vector<std::int32_t>> prefixes;
  for (std::int64_t g = 0; g < spec.prefix_groups; ++g)
    prefixes.push_back(random_tokens(spec.prefix_tokens, spec.vocab_size, draw));
  const double weight_sum =
      std::accumulate(spec.priority_weights.begin(), spec.priority_weights.end(), 0.0);

  const double expected_tokens =
      static_cast<double>(spec.requests) *
      std::max(expected_length(spec.prompt_tokens), static_cast<double>(spec.prefix_tokens + 1));
  if (expected_tokens * sizeof(std::int32_t) > static_cast<double>(allocatable_bytes()) / 2)
    throw Error(fmt::format(
        "the workload's prompts (workload.requests {} x about {:.0f} prompt_tokens) need more "
        "than half of what this machine can hold ({:.1f} GiB)",
        spec.requests, expected_tokens / static_cast<double>(spec.requests),
        static_cast<double>(allocatable_bytes()) / (1 << 30)));
  std::vector<WorkloadRequest> requests;
  PromptBudget budget;  // the backstop for distributions whose mean says little
  double clock = 0;
  for (std::int64_t i = 0; i < spec.requests; ++i) {
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = clock = next_arrival(spec.arrival, i, clock, draw);
    std::int64_t prompt_length = draw_length(spec.prompt_tokens, draw);
    if (spec.prefix_groups > 0) {
      r.prefix_group =
          static_cast<std::int64_t>(draw.bits() % static_cast<std::uint64_t>(spec.prefix_groups));
      r.prompt = prefixes[static_cast<std::size_t>(r.prefix_group)];
      prompt_length = std::max(prompt_length, spec.prefix_tokens + 1);  // at least one own token
    }
    budget.add(prompt_length, "the workload's prompts (workload.requests x prompt_tokens)");
    const auto own = random_tokens(prompt_length - static_cast<std::int64_t>(r.prompt.size()),
                                   spec.vocab_size, draw);
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    r.output_tokens = draw_length(spec.output_tokens, draw);
    double pick = draw.uniform() * weight_sum;
    r.priority = 0;
    for (std::size_t p = 0; p < spec.priority_weights.size(); ++p) {
      pick -= spec.priority_weights[p];
      if (pick < 0) {
        r.priority = static_cast<int>(p);
        break;
      }
    }
    r.sampling = workload_sampling(spec);
    r.sampling.max_tokens = static_cast<std::int32_t>(r.output_tokens);
    r.sampling.ignore_eos = spec.ignore_eos;
    r.sampling.seed = spec.seed * 1000003ULL + static_cast<std::uint64_t>(i);
    validate_sampling_params(r.sampling);
    requests.push_back(std::move(r));
  }
  return requests;
}

std::vector<double> arrival_times(const ArrivalProcess& arrival, std::int64_t requests,
                                  std::uint64_t seed) {
  check_arrival(arrival);
  Draw draw(seed);
  std::vector<double> times;
  double clock = 0;
  for (std::int64_t i = 0; i < requests; ++i)
    times.push_back(clock = next_arrival(arrival, i, clock, draw));
  return times;
}

void check_arrival_times(const std::vector<WorkloadRequest>& requests, const std::string& source) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const double t = requests[i].arrival_s;
    if (!(t >= 0 && t <= kMaxArrivalSeconds))
      throw Error(fmt::format(
          "{}: request {} arrives at {:g} s, outside [0, {:g}] s (latencies past that would "
          "vanish in double-precision time); raise the rate or shorten the trace",
          source, i, t, kMaxArrivalSeconds));
  }
}

namespace detail {

RealWorkload load_synthetic_source(const WorkloadInput& input) {
  SyntheticWorkload spec = input.synthetic;
  spec.vocab_size = input.vocab_size;
  RealWorkload out;
  out.requests = generate_workload(spec);
  return out;
}

}  // namespace detail

}  // namespace kvlab
