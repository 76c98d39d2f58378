#include "kvlab/speculation/speculation.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "kvlab/error.hpp"

namespace kvlab {

std::unique_ptr<Proposer> make_proposer(const SpeculationOptions& options, std::int64_t vocab,
                                        std::span<const std::int32_t> eos) {
  if (options.proposer == "simulated")
    return make_simulated_proposer(vocab, eos,
                                   {options.acceptance_rate, options.accept_trace, options.seed});
  if (options.proposer == "prompt_lookup") return make_prompt_lookup_proposer(options.lookup);
  throw Error(fmt::format(
      "speculation: the proposer \"{}\" is a plugin: the engine needs it made (EngineOptions::"
      "proposer); only prompt_lookup and simulated are built in",
      options.proposer));
}

double expected_tokens_per_verify(double acceptance, std::int64_t k) {
  double tokens = 0, p = 1;
  for (std::int64_t i = 0; i <= k; ++i, p *= acceptance) tokens += p;
  return tokens;
}

std::vector<std::int64_t> adaptive_proposal_lengths(
    const std::function<double(std::span<const std::int64_t> proposing)>& step_seconds,
    std::span<const double> acceptance, std::span<const std::int64_t> max_tokens) {
  struct Proposal {
    double value;  // expected tokens it adds: acceptance^j
    std::size_t decode;
    std::size_t depth;  // j - 1
  };
  std::vector<Proposal> proposals;
  std::int64_t deepest = 0;
  for (std::size_t i = 0; i < acceptance.size(); ++i) {
    double value = 1;
    for (std::int64_t j = 0; j < max_tokens[i]; ++j)
      proposals.push_back({value *= acceptance[i], i, static_cast<std::size_t>(j)});
    deepest = std::max(deepest, max_tokens[i]);
  }
  std::stable_sort(proposals.begin(), proposals.end(),
                   [](const Proposal& a, const Proposal& b) { return a.value > b.value; });
  // The best m: tokens(m) / seconds(m), tokens(m) the decodes' own plus the m best values.
  std::vector<std::int64_t> proposing(static_cast<std::size_t>(deepest), 0);
  double tokens = static_cast<double>(acceptance.size()), best_rate = 0;
  std::size_t best = 0;
  for (std::size_t m = 0; m <= proposals.size(); ++m) {
    if (m > 0) {
      tokens += proposals[m - 1].value;
      ++proposing[proposals[m - 1].depth];
    }
    const double rate = tokens / std::max(step_seconds(proposing), 1e-12);
    if (rate > best_rate) {
      best_rate = rate;
      best = m;
    }
  }
  std::vector<std::int64_t> lengths(acceptance.size(), 0);
  for (std::size_t m = 0; m < best; ++m) ++lengths[proposals[m].decode];
  // Or one length k for every decode (within its room), when that is better: a price by depth (a
  // drafter's step shared by all who propose that deep) can favour whole depths over the best
  // proposals first.
  for (std::int64_t k = 1; k <= deepest; ++k) {
    std::fill(proposing.begin(), proposing.end(), 0);
    double uniform_tokens = static_cast<double>(acceptance.size());
    for (std::size_t i = 0; i < acceptance.size(); ++i) {
      double value = 1;
      for (std::int64_t j = 0; j < std::min(k, max_tokens[i]); ++j) {
        uniform_tokens += value *= acceptance[i];
        ++proposing[static_cast<std::size_t>(j)];
      }
    }
    const double rate = uniform_tokens / std::max(step_seconds(proposing), 1e-12);
    if (rate > best_rate) {
      best_rate = rate;
      for (std::size_t i = 0; i < lengths.size(); ++i) lengths[i] = std::min(k, max_tokens[i]);
    }
  }
  return lengths;
}

double draft_step_seconds(const CostModel& draft, std::span<const EntryShape> shapes) {
  return draft.cost(draft.work(shapes)).total() - draft.profile().step_overhead_s;
}

void StepTimes::observe(std::int64_t tokens, double seconds) {
  if (tokens <= 0 || !(seconds >= 0)) return;
  auto [at, inserted] = mean_.try_emplace(tokens, seconds);
  if (!inserted) at->second += 0.25 * (seconds - at->second);
}

std::optional<double> StepTimes::seconds(std::int64_t tokens) const {
  if (mean_.empty() || tokens > mean_.rbegin()->first) return std::nullopt;
  auto above = mean_.lower_bound(tokens);
  if (above->first == tokens) return above->second;
  if (above == mean_.begin()) {  // below every count run: the line through the two smallest
    if (mean_.size() < 2) return std::nullopt;
    ++above;
  }
  const auto below = std::prev(above);
  const double slope =
      (above->second - below->second) / static_cast<double>(above->first - below->first);
  const double line = below->second + slope * static_cast<double>(tokens - below->first);
  if (tokens > below->first) return line;
  // Extrapolated down, kept between the smallest count's time (all of it fixed cost) and its
  // share in proportion to the tokens (none of it fixed).
  const double proportional =
      below->second * static_cast<double>(tokens) / static_cast<double>(below->first);
  return std::clamp(line, std::min(proportional, below->second), below->second);
}

}  // namespace kvlab
