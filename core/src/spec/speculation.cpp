#include "kvlab/spec/speculation.hpp"

#include <algorithm>
#include <cmath>

#include "kvlab/sim/simulated_backend.hpp"

namespace kvlab {
namespace {

class PromptLookupProposer final : public Proposer {
 public:
  explicit PromptLookupProposer(PromptLookup lookup) : lookup_(lookup) {}
  std::vector<std::int32_t> propose(const RequestState& r, std::int64_t max_tokens) const override {
    return prompt_lookup(r.tokens, lookup_, max_tokens);
  }

 private:
  PromptLookup lookup_;
};

// A uniform draw in [0, 1) for (seed, request, position): splitmix64.
double draw(std::uint64_t seed, RequestId id, std::int64_t position) {
  std::uint64_t z = seed ^ (static_cast<std::uint64_t>(id) * 0x9e3779b97f4a7c15ULL) ^
                    (static_cast<std::uint64_t>(position) * 0xc2b2ae3d27d4eb4fULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

class SimulatedProposer final : public Proposer {
 public:
  SimulatedProposer(const SpeculationOptions& options, std::int64_t vocab,
                    std::span<const std::int32_t> eos)
      : target_(vocab, {eos.begin(), eos.end()}),
        vocab_(vocab),
        rate_(options.acceptance_rate),
        seed_(options.seed) {}
  std::vector<std::int32_t> propose(const RequestState& r, std::int64_t max_tokens) const override {
    std::vector<std::int32_t> proposed;
    std::int32_t last = r.tokens.back();
    const std::int64_t newest = r.length() - 1;
    bool right = true;
    for (std::int64_t j = 0; j < max_tokens; ++j) {
      // The target's token after `last` at this position: what the verify's row j will say.
      const std::int32_t target = target_.token_after(last, newest + j);
      right = right && draw(seed_, r.id, newest + j) < rate_;
      last = right ? target : static_cast<std::int32_t>((target + 1) % vocab_);
      proposed.push_back(last);
    }
    return proposed;
  }

 private:
  SimulatedBackend target_;
  std::int64_t vocab_;
  double rate_;
  std::uint64_t seed_;
};

}  // namespace

std::unique_ptr<Proposer> make_proposer(const SpeculationOptions& options, std::int64_t vocab,
                                        std::span<const std::int32_t> eos) {
  if (options.proposer == ProposerKind::simulated)
    return std::make_unique<SimulatedProposer>(options, vocab, eos);
  return std::make_unique<PromptLookupProposer>(options.lookup);
}

double expected_tokens_per_verify(double acceptance, std::int64_t k) {
  double tokens = 0, p = 1;
  for (std::int64_t i = 0; i <= k; ++i, p *= acceptance) tokens += p;
  return tokens;
}

std::int64_t adaptive_proposal_length(const CostModel& cost, std::span<const std::int64_t> contexts,
                                      double acceptance, std::int64_t max_tokens) {
  if (contexts.empty()) return max_tokens;
  std::vector<EntryShape> shapes(contexts.size());
  std::int64_t best = 0;
  double best_rate = 0;
  for (std::int64_t k = 0; k <= max_tokens; ++k) {
    for (std::size_t i = 0; i < contexts.size(); ++i) shapes[i] = {1 + k, contexts[i], 0, 1 + k};
    const double seconds = cost.cost(cost.work(shapes)).total();
    const double rate = expected_tokens_per_verify(acceptance, k) / seconds;
    if (rate > best_rate) {
      best = k;
      best_rate = rate;
    }
  }
  return best;
}

}  // namespace kvlab
