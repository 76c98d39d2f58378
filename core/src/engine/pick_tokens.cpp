#include "kvlab/engine/pick_tokens.hpp"

#include <fmt/format.h>

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
  std::vector<TokenChoice> choices(entries);
  for (std::size_t e = 0; e < applied.batch.size(); ++e) {
    if (!applied.batch[e].samples) continue;
    Sampler& sampler = table.sampler(applied.batch[e].id);
    const SamplingParams& p = sampler.params();
    choices[e] = {p.temperature, p.top_p, p.temperature > 0 ? sampler.next_uniform() : 0.0, p.top_k,
                  p.logprobs};
  }
  return choices;
}

std::vector<std::int32_t> pick_tokens(const ForwardResult& result,
                                      std::span<const TokenChoice> choices,
                                      const AppliedPlan& applied, RequestTable& table,
                                      std::int64_t vocab, std::int64_t step,
                                      const TokenObservers& observers) {
  const auto width = static_cast<std::size_t>(vocab);
  check_shape(result, choices.size(), width);
  std::vector<std::int32_t> sampled(applied.batch.size(), -1);  // padding rows: discarded
  for (std::size_t e = 0; e < applied.batch.size(); ++e) {
    const ScheduledWork& work = applied.batch[e];
    if (!work.samples) continue;
    const SamplingParams& params = table.sampler(work.id).params();
    if (!result.tokens.empty()) {
      sampled[e] = result.tokens[e];
      if (sampled[e] < 0)  // the device's choice over a row with NaN or +-inf
        throw Error(fmt::format(
            "request {}, step {}: the backend's logits hold a non-finite value; the model's "
            "weights or the backend produced non-finite values, so no token can be sampled",
            work.id, step));
      if (params.logprobs >= 0)
        table.logprobs(work.id).push_back(device_logprobs(result, choices, work.id, e, step));
    } else {
      const auto row = result.logits.subspan(e * width, width);
      throw_if_non_finite(row, work.id, step);
      if (observers.on_logits) observers.on_logits(work.id, row);
      sampled[e] = pick_token(row, params, choices[e].uniform);
      if (params.logprobs >= 0)
        table.logprobs(work.id).push_back(generated_logprobs(row, sampled[e], params.logprobs));
    }
    if (observers.on_token)
      observers.on_token(work.id, sampled[e],
                         params.logprobs >= 0 ? &table.logprobs(work.id).back() : nullptr);
  }
  return sampled;
}

}  // namespace kvlab
