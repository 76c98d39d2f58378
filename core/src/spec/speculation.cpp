#include "kvlab/spec/speculation.hpp"

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

std::int64_t adaptive_proposal_length(
    const std::function<std::optional<double>(std::int64_t k)>& step_seconds, double acceptance,
    std::int64_t max_tokens) {
  std::int64_t best = 0;
  double best_rate = 0;
  for (std::int64_t k = 0; k <= max_tokens; ++k) {
    const std::optional<double> seconds = step_seconds(k);
    if (!seconds) return k;  // not measured yet: run it and see
    const double rate = expected_tokens_per_verify(acceptance, k) / std::max(*seconds, 1e-12);
    if (rate > best_rate) {
      best = k;
      best_rate = rate;
    }
  }
  return best;
}

double draft_step_seconds(const CostModel& draft, std::span<const EntryShape> shapes) {
  return draft.cost(draft.work(shapes)).total() - draft.profile().step_overhead_s;
}

std::int64_t adaptive_proposal_length(const CostModel& cost, const CostModel* draft,
                                      std::span<const std::int64_t> contexts, double acceptance,
                                      std::int64_t max_tokens) {
  if (contexts.empty()) return max_tokens;
  std::vector<EntryShape> shapes(contexts.size());
  // draft_steps[j]: the draft's j-th decode step over the decodes
  std::vector<double> draft_steps;
  for (std::int64_t j = 0; draft != nullptr && j < max_tokens; ++j) {
    for (std::size_t i = 0; i < contexts.size(); ++i) shapes[i] = {1, contexts[i] + j, 0, 1};
    draft_steps.push_back(draft_step_seconds(*draft, shapes));
  }
  return adaptive_proposal_length(
      [&](std::int64_t k) -> std::optional<double> {
        for (std::size_t i = 0; i < contexts.size(); ++i)
          shapes[i] = {1 + k, contexts[i], 0, 1 + k};
        double seconds = cost.cost(cost.work(shapes)).total();
        for (std::int64_t j = 0; j < k && j < static_cast<std::int64_t>(draft_steps.size()); ++j)
          seconds += draft_steps[static_cast<std::size_t>(j)];
        return seconds;
      },
      acceptance, max_tokens);
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
