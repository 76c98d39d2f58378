#pragma once
// The proposers without a model of their own, which the prompt_lookup and simulated proposer
// plugins wrap (and an Engine made without a proposer plugin uses: tests, tools).
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvlab/proposer.hpp"
#include "kvlab/speculation/prompt_lookup.hpp"

namespace kvlab {

// One verify of a measured run: how many proposals it checked and how many of them were right.
struct AcceptRecord {
  std::int64_t proposed = 0, accepted = 0;
};

// The verifies of a CSV with a header naming `proposed` and `accepted` (other columns ignored:
// kvlab's verifies.csv has request and step too), 1 <= proposed <= 64 and 0 <= accepted <=
// proposed in each row; an error naming the file and line otherwise, or when it holds none.
std::vector<AcceptRecord> load_accept_trace(const std::filesystem::path& path);

// Prompt lookup over each request's tokens (kvlab/speculation/prompt_lookup.hpp).
std::unique_ptr<Proposer> make_prompt_lookup_proposer(const PromptLookup& lookup);

// How the simulated backend's stand-in for a drafter is right.
struct SimulatedAcceptance {
  double rate = 0.7;  // each proposal right with this probability, given the ones before it
  // Or the acceptance of a measured run (its verifies.csv, or any CSV with columns proposed and
  // accepted): each verify's run of right proposals drawn from its verifies. "" for the rate.
  std::string accept_trace;
  std::uint64_t seed = 0;  // the draws (per request and position)
};

// The simulated backend's stand-in for a drafter: each proposed token is the target's own
// (kvlab::SimulatedBackend over `vocab` and `eos`) as `acceptance` draws it; a proposal after a
// wrong one is wrong too.
std::unique_ptr<Proposer> make_simulated_proposer(std::int64_t vocab,
                                                  std::span<const std::int32_t> eos,
                                                  const SimulatedAcceptance& acceptance);

}  // namespace kvlab
