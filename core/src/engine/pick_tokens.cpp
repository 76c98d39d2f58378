#include "kvlab/engine/pick_tokens.hpp"

#include <fmt/format.h>

#include <utility>

#include "kvlab/engine/sampling.hpp"
#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// Sampling needs finite logits; NaN or inf means the backend (or the weights) broke: stop the run
// with the request and step rather than emit token 0 with a null logprob.
void throw_if_non_finite(std::span<const float> row, RequestId id, std::int64_t step) {
  if (auto bad = first_non_finite(row))
    throw Error(fmt::format(
        "request {}, step {}: the backend's logits hold {} at token id {}; the model's weights or "
        "the backend produced non-finite values, so no token can be sampled",
        id, step, row[*bad], *bad));
}

void check_shape(const ForwardResult& result, std::size_t entries, std::size_t vocab) {
  if (result.tokens.empty() ? result.logits.size() != entries * vocab
                            : result.tokens.size() != entries)
    throw Error(fmt::format(
        "backend returned {} logits and {} tokens for a batch of {} (vocab {}): it must return "
        "one row of logits or one chosen token per entry",
        result.logits.size(), result.tokens.size(), entries, vocab));
}

// Entry `entry`'s log-probabilities as the backend computed them with its token choice: a
// backend that picks tokens without logits (the simulated one) has none to give.
GeneratedLogprobs device_logprobs(const ForwardResult& result, std::span<const TokenChoice> choices,
                                  RequestId id, std::size_t entry, std::int64_t step) {
  const std::size_t width = result.logprob_width;
  const std::int32_t token = result.tokens[entry];
  if (width == 0 || result.logprobs.size() != width * choices.size())
    throw Error(fmt::format(
        "request {} asks for log-probabilities (logprobs = {}), but the backend chose its tokens "
        "without them ({} values for a batch of {}): use a backend with logits (cpu, cuda)",
        id, choices[entry].logprobs, result.logprobs.size(), choices.size()));
  const auto row = result.logprobs.subspan(entry * width, width);
  const auto asked = static_cast<std::size_t>(choices[entry].logprobs);
  if (row[0].token != token || asked + 1 > width)
    throw Error(
        fmt::format("request {}, step {}: the backend's log-probabilities are for token "
                    "{} with {} alternatives; it chose token {} and {} were asked",
                    id, step, row[0].token, width - 1, token, asked));
  return {row[0].logprob, std::vector<TokenLogprob>(row.begin() + 1, row.begin() + 1 + asked)};
}

}  // namespace

std::vector<TokenChoice> draw_token_choices(const AppliedPlan& applied, RequestTable& table,
                                            std::size_t entries) {
  std::size_t proposals = 0;
  for (const ScheduledWork& work : applied.batch)
    proposals += static_cast<std::size_t>(work.proposals);
  std::vector<TokenChoice> choices;
  choices.reserve(entries + proposals);
  for (const ScheduledWork& work : applied.batch) {
    if (!work.samples) {
      choices.insert(choices.end(), static_cast<std::size_t>(1 + work.proposals), TokenChoice{});
      continue;
    }
    Sampler& sampler = table.sampler(work.id);
    const SamplingParams& p = sampler.params();
    // A draw of its own for each row: a backend that samples each row where the logits are
    // samples each position independently, as drawing them one step at a time would.
    for (std::int64_t row = 0; row <= work.proposals; ++row)
      choices.push_back({p.temperature, p.top_p, p.temperature > 0 ? sampler.next_uniform() : 0.0,
                         p.top_k, p.logprobs});
  }
  choices.resize(entries + proposals);  // padding rows: greedy, discarded
  return choices;
}

namespace {

// The token of choice row `row`: the backend's, or picked from its logits with the choice's draw.
std::int32_t row_token(const ForwardResult& result, std::span<const TokenChoice> choices,
                       std::size_t row, std::size_t width, RequestId id, std::int64_t step,
                       const SamplingParams& params, const TokenObservers& observers) {
  if (!result.tokens.empty()) {
    if (result.tokens[row] < 0)  // the device's choice over a row with NaN or +-inf
      throw Error(fmt::format(
          "request {}, step {}: the backend's logits hold a non-finite value; the model's "
          "weights or the backend produced non-finite values, so no token can be sampled",
          id, step));
    return result.tokens[row];
  }
  const auto logits = result.logits.subspan(row * width, width);
  throw_if_non_finite(logits, id, step);
  if (observers.on_logits) observers.on_logits(id, logits);
  return pick_token(logits, params, choices[row].uniform);
}

// Token `token` of row `row` emitted for request r: its log-probabilities recorded when the
// request asks for them (from the row's logits, or the backend's where it chose the tokens),
// then the observers told. The logprobs are those of the row the token was scored at.
void emit_token(const ForwardResult& result, std::span<const TokenChoice> choices, std::size_t row,
                std::size_t width, RequestId id, std::int32_t token, std::int64_t step,
                RequestTable& table, const TokenObservers& observers) {
  const SamplingParams& params = table.sampler(id).params();
  if (params.logprobs >= 0)
    table.logprobs(id).push_back(
        result.tokens.empty()
            ? generated_logprobs(result.logits.subspan(row * width, width), token, params.logprobs)
            : device_logprobs(result, choices, id, row, step));
  if (observers.on_token)
    observers.on_token(id, token, params.logprobs >= 0 ? &table.logprobs(id).back() : nullptr);
}

// A verify entry's rows first..first+proposals: the target's token at each position, accepted
// while it equals the proposal there and does not end the sequence (a sampled request's logits:
// verify_sampled). Emits the accepted proposals; returns the token after them (the caller emits
// it, from row first + accepted).
std::int32_t verify(const ForwardResult& result, std::span<const TokenChoice> choices,
                    std::size_t first, std::size_t width, ScheduledWork& work, RequestTable& table,
                    std::int64_t step, const TokenObservers& observers,
                    const std::function<bool(std::int32_t)>& is_eos) {
  const RequestState& r = table.at(work.id);
  const SamplingParams& params = table.sampler(r.id).params();
  const bool ignores_eos = table.ignores_eos(r.id);
  const auto ends = [&](std::int32_t token) { return !ignores_eos && is_eos && is_eos(token); };
  const auto proposed = std::span(r.proposed).first(static_cast<std::size_t>(work.proposals));
  if (result.tokens.empty() && params.temperature > 0) {
    const auto rows = result.logits.subspan(first * width, proposed.size() * width + width);
    const SampledVerify outcome = verify_sampled(rows, width, proposed, params, table.sampler(r.id),
                                                 choices[first].uniform, ends);
    for (std::int64_t i = 0; i <= outcome.accepted; ++i) {  // the rows it read
      const auto row = rows.subspan(static_cast<std::size_t>(i) * width, width);
      throw_if_non_finite(row, r.id, step);
      if (observers.on_logits) observers.on_logits(r.id, row);
    }
    work.accepted = outcome.accepted;
    for (std::int64_t i = 0; i < outcome.accepted; ++i)
      emit_token(result, choices, first + static_cast<std::size_t>(i), width, r.id,
                 proposed[static_cast<std::size_t>(i)], step, table, observers);
    return outcome.token;
  }
  work.accepted = 0;
  for (std::int64_t i = 0;; ++i) {
    const std::size_t row = first + static_cast<std::size_t>(i);
    const std::int32_t target =
        row_token(result, choices, row, width, r.id, step, params, observers);
    if (i == work.proposals || target != proposed[static_cast<std::size_t>(i)] || ends(target))
      return target;
    ++work.accepted;
    emit_token(result, choices, row, width, r.id, target, step, table, observers);
  }
}

}  // namespace

SampledVerify verify_sampled(std::span<const float> logits, std::size_t vocab,
                             std::span<const std::int32_t> proposed, const SamplingParams& params,
                             Sampler& sampler, double bonus_uniform,
                             const std::function<bool(std::int32_t)>& ends) {
  for (std::size_t i = 0; i < proposed.size(); ++i) {
    std::vector<double> p = sampling_distribution(logits.subspan(i * vocab, vocab), params);
    const auto x = static_cast<std::size_t>(proposed[i]);
    const double accept = x < p.size() ? p[x] : 0.0;
    if (sampler.next_uniform() < accept) {
      if (ends && ends(proposed[i])) return {static_cast<std::int64_t>(i), proposed[i]};
      continue;
    }
    // Rejected: the target's distribution without x_i, renormalised.
    if (x < p.size()) p[x] = 0;
    double mass = 0;
    for (const double v : p) mass += v;
    const double u = sampler.next_uniform() * mass;
    double cumulative = 0;
    std::int32_t token = -1;
    for (std::size_t t = 0; t < p.size(); ++t) {
      if (p[t] <= 0) continue;
      token = static_cast<std::int32_t>(t);
      cumulative += p[t];
      if (u < cumulative) break;
    }
    return {static_cast<std::int64_t>(i), token};
  }
  return {static_cast<std::int64_t>(proposed.size()),
          pick_token(logits.subspan(proposed.size() * vocab, vocab), params, bonus_uniform)};
}

std::vector<std::int32_t> pick_tokens(const ForwardResult& result,
                                      std::span<const TokenChoice> choices, AppliedPlan& applied,
                                      RequestTable& table, std::int64_t vocab, std::int64_t step,
                                      const TokenObservers& observers,
                                      const std::function<bool(std::int32_t)>& is_eos) {
  const auto width = static_cast<std::size_t>(vocab);
  check_shape(result, choices.size(), width);
  std::vector<std::int32_t> sampled(applied.batch.size(), -1);  // padding rows: discarded
  std::size_t row = 0;
  for (std::size_t e = 0; e < applied.batch.size(); ++e) {
    ScheduledWork& work = applied.batch[e];
    const std::size_t first =
        std::exchange(row, row + 1 + static_cast<std::size_t>(work.proposals));
    if (!work.samples) continue;
    const SamplingParams& params = table.sampler(work.id).params();
    if (work.proposals > 0) {
      sampled[e] = verify(result, choices, first, width, work, table, step, observers, is_eos);
      emit_token(result, choices, first + static_cast<std::size_t>(work.accepted), width, work.id,
                 sampled[e], step, table, observers);
      continue;
    }
    sampled[e] = row_token(result, choices, first, width, work.id, step, params, observers);
    emit_token(result, choices, first, width, work.id, sampled[e], step, table, observers);
  }
  return sampled;
}

}  // namespace kvlab
