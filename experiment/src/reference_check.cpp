// Stage 4 (kvlab check): every generated token against the full-recompute reference's choice
// at its position, teacher-forced; with a tolerance, how close the engine's logits were.
#include <fmt/format.h>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/workload/workload.hpp"
#include "run_memo.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

// The reference's choices for the generated tokens of `sequence` (from position `first`), and,
// with the engine's logits `log` (the request's, at `slot`), how close those were to the
// reference's: whole rows where kept (one reference forward, not memoized), the top 5 of every
// token.
std::vector<ReferenceChoice> compared_choices(
    const std::function<const cpu::ReferenceModel&()>& reference, const std::string& weights_key,
    std::optional<std::int64_t> window, std::span<const std::int32_t> sequence, std::size_t first,
    const EngineLogitLog* log, const std::pair<std::size_t, RequestId>& slot,
    LogitAgreement& agreement) {
  if (log == nullptr) return reference_choices(reference, weights_key, window, sequence, first);
  const EngineLogitLog::Request* logged = &log->request(slot.first, slot.second);
  const std::size_t generated = sequence.size() - 1 - first;
  if (logged->top.size() != generated)
    throw Error(
        fmt::format("the engine sampled {} rows of logits for a request that generated {} "
                    "tokens",
                    logged->top.size(), generated));
  const std::size_t kept = logged->kept_rows(log->vocab());
  std::vector<ReferenceChoice> choices;
  if (kept == 0) {
    choices = reference_choices(reference, weights_key, window, sequence, first);
  } else {
    const cpu::RowMatrix logits = reference_logits(reference(), window, sequence);  // (pos, vocab)
    choices = choices_from_logits(logits, sequence, first);
    const auto vocab = static_cast<std::size_t>(log->vocab());
    for (std::size_t t = 0; t < kept; ++t)
      agreement.add_row(std::span(logged->rows).subspan(t * vocab, vocab),
                        std::span(logits.row(static_cast<Eigen::Index>(first + t)).data(), vocab));
  }
  for (std::size_t t = 0; t < generated; ++t) agreement.add_top(logged->top[t], choices[t].top);
  return choices;
}

// One generated token against the reference's choice at its position: "" when it passes (the
// argmax, or within `tolerance` of it), else why not. Counts it in `check`.
std::string check_token(std::int32_t token, const ReferenceChoice& expected, double tolerance,
                        RunOutput::Check& check) {
  ++check.tokens;
  if (token == expected.argmax) return {};
  if (tolerance > 0 && expected.gap <= tolerance) {  // 0: even exact ties must be argmax
    ++check.off_argmax;
    check.max_gap = std::max(check.max_gap, static_cast<double>(expected.gap));
    return {};
  }
  return tolerance > 0 ? fmt::format(
                             "is {}, whose reference logit is {:.4g} below the best ({}), "
                             "beyond the tolerance {}",
                             token, expected.gap, expected.argmax, tolerance)
                       : fmt::format("is {}, the reference gives {}", token, expected.argmax);
}

}  // namespace

// Teacher forcing: one reference forward over prompt + output checks every generated token
// (memoized per sequence: other sweep points asking for the same sequence share it). A token
// passes when it is the reference's argmax, or its logit is within `tolerance` of the argmax's;
// a request that asked for log-probabilities also needs them within logprob_tolerance of the
// reference's. With the engine's logits `log` (kvlab check --tolerance), out.check.logits
// measures them.
void check_against_reference(const ServedModel& served, std::optional<std::int64_t> window,
                             const std::vector<WorkloadRequest>& requests, double tolerance,
                             const EngineLogitLog* log, const EngineSlots& slots, RunOutput& out,
                             std::vector<std::string>& mismatches) {
  std::optional<cpu::ReferenceModel> model;  // built on the first sequence not seen before
  auto reference = [&]() -> const cpu::ReferenceModel& {
    if (!model) model.emplace(*served.weights);
    return *model;
  };
  const double logprob_tol = logprob_tolerance(tolerance);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::vector<std::int32_t>& tokens = out.engine.tokens[i];
    if (out.engine.requests[i].rejected || tokens.empty()) continue;
    const std::vector<GeneratedLogprobs>& logprobs = out.engine.logprobs[i];  // empty: not asked
    std::vector<std::int32_t> sequence = requests[i].prompt;
    sequence.insert(sequence.end(), tokens.begin(), tokens.end());
    const auto choices =
        compared_choices(reference, served.weights_key, window, sequence,
                         requests[i].prompt.size() - 1, log, slots[i], out.check.logits);
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      if (const std::string problem = check_token(tokens[t], choices[t], tolerance, out.check);
          !problem.empty()) {
        mismatches.push_back(fmt::format("request {}: token {} {}", i, t, problem));
        break;
      }
      if (t >= logprobs.size()) continue;
      if (const std::string problem =
              out.check.logprobs.add(logprobs[t], choices[t].logprobs, logprob_tol);
          !problem.empty()) {
        mismatches.push_back(fmt::format("request {}: token {} ({}): {} (beyond {})", i, t,
                                         tokens[t], problem, logprob_tol));
        break;
      }
    }
  }
}

}  // namespace kvlab
