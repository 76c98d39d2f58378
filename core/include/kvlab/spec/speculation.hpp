#pragma once
// Speculative decoding inside continuous batching (docs/concepts/speculative-decoding.md): before
// each step's schedule the engine gives each running greedy decode up to `tokens` proposed
// tokens (RequestState::proposed); the scheduler grants a decode 1 + the proposals its token
// budget leaves; the target computes the newest token and the proposals in one entry with a row
// of logits at each (BatchEntry::logit_rows); the proposals are accepted while each equals the
// target's token at its position, then the target's own token follows; the rejected positions'
// KV is rolled back (KvAllocator::truncate). A greedy request's tokens are exactly those of
// decoding without speculation.
#include <cstdint>

#include "kvlab/spec/prompt_lookup.hpp"

namespace kvlab {

struct SpeculationOptions {
  std::int64_t tokens = 0;  // proposals per decode at most (k); 0: off
  PromptLookup lookup;      // the proposer: prompt lookup (n-gram) over the sequence so far
  bool enabled() const { return tokens > 0; }
};

}  // namespace kvlab
