#pragma once
// Proposer: where speculative decoding's proposed tokens come from (a plugin kind; the engine's
// use of them: kvlab/speculation/speculation.hpp). Each step, before the schedule, the engine asks
// for every running decode's proposals at once, so a proposer that runs a draft model batches the
// decodes' draft steps. Plugins: prompt_lookup (n-gram lookup over the prompt and the output so
// far), simulated (the simulated backend's tokens, right at a rate or as a measured trace
// says), draft (a draft model with its own KV: a second model file, or the target's own first
// layers).
#include <boost/config.hpp>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvlab/request.hpp"

namespace kvlab {

// One decode's ask: up to `max_tokens` (>= 1) tokens to follow request->tokens.back(), written
// to *proposed (empty on entry; fewer, or none, is always allowed).
struct ProposeAsk {
  const RequestState* request = nullptr;
  std::int64_t max_tokens = 0;
  std::vector<std::int32_t>* proposed = nullptr;
};

class BOOST_SYMBOL_VISIBLE Proposer {
 public:
  virtual ~Proposer() = default;
  // This step's proposals for each decode asking (each request at most once a call). The asked
  // sequences' tokens are verified: a proposer that keeps state per request (a draft's KV) keeps
  // what matches them and drops the rest (the rejected proposals of the last step).
  virtual void propose(std::span<const ProposeAsk> asks) = 0;
  // The request finished, was rejected or handed off: anything kept for it can go.
  virtual void forget(RequestId /*id*/) {}

  // One request's proposals (tests, tools): propose() with one ask.
  std::vector<std::int32_t> propose_one(const RequestState& r, std::int64_t max_tokens) {
    std::vector<std::int32_t> proposed;
    const ProposeAsk ask{&r, max_tokens, &proposed};
    propose(std::span(&ask, 1));
    return proposed;
  }
};

}  // namespace kvlab
