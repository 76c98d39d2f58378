#pragma once
// Speculative decoding inside continuous batching (docs/concepts/speculative-decoding.md): before
// each step's schedule the engine gives each running decode up to `tokens` proposed
// tokens (RequestState::proposed); the scheduler grants a decode 1 + the proposals its token
// budget leaves; the target computes the newest token and the proposals in one entry with a row
// of logits at each (BatchEntry::logit_rows); the proposals are accepted while each equals the
// target's token at its position, then the target's own token follows; the rejected positions'
// KV is rolled back (KvRollback::truncate). A greedy request's tokens are exactly those of
// decoding without speculation; a sampled request accepts by rejection sampling
// (verify_sampled, kvlab/engine/pick_tokens.hpp), so its tokens keep the target's distribution.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/request.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/speculation/builtin_proposers.hpp"
#include "kvlab/speculation/prompt_lookup.hpp"

namespace kvlab {

// How an adaptive proposal length prices the step that each length would make.
enum class AdaptiveLength : std::uint8_t {
  off,       // always `tokens`
  priced,    // by the engine's cost model (a hardware profile)
  measured,  // by the times of the steps the engine ran (StepTimes): no profile needed, so it
             // follows the machine and the model file as they are (a real model on the cpu)
};

struct SpeculationOptions {
  std::int64_t tokens = 0;  // proposals per decode at most (k); 0: off
  // The proposer plugin's name: prompt_lookup, simulated, draft or one of your own. An engine
  // made without a proposer object (EngineOptions::proposer) makes prompt_lookup or simulated
  // itself from the settings below (kvlab/speculation/builtin_proposers.hpp).
  std::string proposer = "prompt_lookup";
  PromptLookup lookup;           // prompt_lookup's n-gram range
  double acceptance_rate = 0.7;  // simulated: each proposal right with this probability
  // simulated: the acceptance of a measured run instead (SimulatedAcceptance::accept_trace)
  std::string accept_trace;
  std::uint64_t seed = 0;  // simulated: the draws
  // Each step's proposal lengths from 0 to `tokens`, one a decode: those that maximise the
  // decodes' expected tokens per second of the step, by each request's acceptance measured so
  // far (shrunk toward the run's) and the step's price (adaptive_proposal_lengths). `priced`
  // needs the engine's cost model.
  AdaptiveLength adaptive = AdaptiveLength::off;
  bool enabled() const { return tokens > 0; }
};

// The built-in proposer `options.proposer` names (prompt_lookup or simulated; an error for any
// other); `vocab` and `eos` are the target's (the simulated backend's tokens).
std::unique_ptr<Proposer> make_proposer(const SpeculationOptions& options, std::int64_t vocab,
                                        std::span<const std::int32_t> eos);

// The expected tokens a decode produces in a step when it verifies k proposals, each accepted
// with probability `acceptance` given the ones before it: 1 + a + a^2 + ... + a^k.
double expected_tokens_per_verify(double acceptance, std::int64_t k);

// Each decode's proposal length, from 0 to max_tokens[i], that together maximise the step's
// expected tokens per second: decode i's j-th proposal adds acceptance[i]^j expected tokens, and
// a step lasts step_seconds(proposing), proposing[j] the decodes with more than j proposals
// (their sum: the proposals in all; a drafter runs one step per depth j). The proposals are
// taken best first (the highest acceptance^j: each decode's in order), as many as pay.
std::vector<std::int64_t> adaptive_proposal_lengths(
    const std::function<double(std::span<const std::int64_t> proposing)>& step_seconds,
    std::span<const double> acceptance, std::span<const std::int64_t> max_tokens);

// One draft decode step over `shapes` (one token a sequence) on the draft's cost model: its
// weights, attention and per-sequence overhead, without the engine step's fixed overhead (the
// draft's steps run inside the engine's step: no scheduling of their own, their launches
// captured once, as vLLM and SGLang run a drafter).
double draft_step_seconds(const CostModel& draft, std::span<const EntryShape> shapes);

// The seconds of the steps an engine ran, by the tokens each computed: an exponential moving
// average per count (a quarter's weight to the newest). AdaptiveLength::measured prices a step
// of n tokens from it: the mean at n, interpolated between the nearest counts on either side,
// or below every count run, the line through the two smallest, kept between the smallest's time
// and its share in proportion to n. Nullopt above every count run, or below the only one: there
// nothing says how a step's time grows with its tokens (run such a step and see).
class StepTimes {
 public:
  void observe(std::int64_t tokens, double seconds);
  std::optional<double> seconds(std::int64_t tokens) const;

 private:
  std::map<std::int64_t, double> mean_;  // tokens -> seconds
};

}  // namespace kvlab
