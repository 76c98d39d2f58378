#pragma once
// Step 4 of the engine (sample): each batch entry's token choice, drawn before the forward, and
// the next token of every entry that ends its sequence, from what the forward returned — the
// backend's own choice when it made one, else picked from the logits on the host with the same
// draw (so both give the same token).
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/request_table.hpp"

namespace kvlab {

// One choice per row of logits the forward returns (an entry's logit_rows; a speculative verify
// has 1 + its proposals): the batch's sampling entries take their draw from their request's RNG
// now (one per non-greedy token, as Sampler::sample draws; a verify's rows one each); the rest,
// and the `entries` forwarded beyond the batch (a static batch's padding rows), are greedy and
// discarded.
std::vector<TokenChoice> draw_token_choices(const AppliedPlan& applied, RequestTable& table,
                                            std::size_t entries);

struct TokenObservers {
  // Each host-sampled row of logits (request, vocab), before the token is drawn.
  std::function<void(RequestId, std::span<const float>)> on_logits;
  // Each token as soon as it is chosen, before the stop rules apply, with its log-probabilities
  // when the request's sampling asks for them (else nullptr; valid during the call only).
  std::function<void(RequestId, std::int32_t, const GeneratedLogprobs*)> on_token;
};

// Speculative sampling with a proposer that names tokens without probabilities (prompt lookup,
// the simulated drafter: a one-hot draft q). Row i of `logits` (k + 1 rows of `vocab`) is the
// target's at proposal i's position. Proposal x_i is accepted with probability p_i(x_i), p_i
// the distribution `params` samples from (sampling_distribution); at the first rejection the
// token is drawn from p_i without x_i, renormalised (max(0, p - q) / its mass); with every
// proposal accepted, from p_k with `bonus_uniform`. So each emitted token has the target's
// distribution (Leviathan et al. 2023, Chen et al. 2023). The draws come from `sampler` (one to
// test each proposal, one more after a rejection). An accepted proposal for which `ends` is
// true ends the verify: it is the token, the ones before it accepted.
struct SampledVerify {
  std::int64_t accepted = 0;  // proposals accepted before `token`
  std::int32_t token = -1;
};
SampledVerify verify_sampled(std::span<const float> logits, std::size_t vocab,
                             std::span<const std::int32_t> proposed, const SamplingParams& params,
                             Sampler& sampler, double bonus_uniform,
                             const std::function<bool(std::int32_t)>& ends);

// The next token of each batch entry (-1 for entries that do not sample); log-probabilities
// appended to the request where its sampling asks for them. A verify entry accepts its
// proposals while each equals the target's token at its position (greedy, or a backend that
// picks its tokens) or by verify_sampled (a sampled request's logits), up to one that ends the
// sequence (`is_eos`, unless the request ignores EOS): its `accepted` count is written into
// `applied`, and its token is the one after them; observers see the accepted proposals, then
// that token. Throws kvlab::Error when `result` does not have one
// row or token per choice, or holds non-finite logits. `vocab`: the backend's; `step`: for
// messages.
std::vector<std::int32_t> pick_tokens(const ForwardResult& result,
                                      std::span<const TokenChoice> choices, AppliedPlan& applied,
                                      RequestTable& table, std::int64_t vocab, std::int64_t step,
                                      const TokenObservers& observers,
                                      const std::function<bool(std::int32_t)>& is_eos = {});

}  // namespace kvlab
