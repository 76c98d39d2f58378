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

// One choice per forwarded entry: the batch's sampling entries take their draw from their
// request's RNG now (one per non-greedy token, as Sampler::sample draws); the rest, and the
// `entries` forwarded beyond the batch (a static batch's padding rows), are greedy and discarded.
std::vector<TokenChoice> draw_token_choices(const AppliedPlan& applied, RequestTable& table,
                                            std::size_t entries);

struct TokenObservers {
  // Each host-sampled row of logits (request, vocab), before the token is drawn.
  std::function<void(RequestId, std::span<const float>)> on_logits;
  // Each token as soon as it is chosen, before the stop rules apply, with its log-probabilities
  // when the request's sampling asks for them (else nullptr; valid during the call only).
  std::function<void(RequestId, std::int32_t, const GeneratedLogprobs*)> on_token;
};

// The next token of each batch entry (-1 for entries that do not sample); log-probabilities
// appended to the request where its sampling asks for them. Throws kvlab::Error when `result`
// does not have one row or token per forwarded entry (choices.size()), or holds non-finite
// logits. `vocab`: the backend's; `step`: for messages.
std::vector<std::int32_t> pick_tokens(const ForwardResult& result,
                                      std::span<const TokenChoice> choices,
                                      const AppliedPlan& applied, RequestTable& table,
                                      std::int64_t vocab, std::int64_t step,
                                      const TokenObservers& observers);

}  // namespace kvlab
