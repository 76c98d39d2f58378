#include "kvlab/experiment/logprob_agreement.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvlab {

double logprob_tolerance(double check_tolerance) {
  return std::max(1e-3, check_tolerance);
}

namespace {

const TokenLogprob* find_token(const std::vector<TokenLogprob>& list, std::int32_t token) {
  const auto it = std::find_if(list.begin(), list.end(),
                               [token](const TokenLogprob& t) { return t.token == token; });
  return it == list.end() ? nullptr : &*it;
}

}  // namespace

std::string LogprobAgreement::add(const GeneratedLogprobs& engine,
                                  const GeneratedLogprobs& reference, double tolerance) {
  const auto delta = [this](float a, float b) -> double {  // NaN: beyond any tolerance, not in max
    const double d = std::abs(static_cast<double>(a) - static_cast<double>(b));
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    max_abs_delta = std::max(max_abs_delta, d);
    return d;
  };
  ++tokens;
  if (delta(engine.logprob, reference.logprob) > tolerance)
    return fmt::format("its log-probability is {:.6g}, the reference's {:.6g}", engine.logprob,
                       reference.logprob);
  for (std::size_t k = 0; k < engine.top.size(); ++k) {
    ++entries;
    const TokenLogprob& e = engine.top[k];
    if (const TokenLogprob* r = find_token(reference.top, e.token)) {
      if (delta(e.logprob, r->logprob) > tolerance)
        return fmt::format("top {}: token {} has {:.6g}, the reference's {:.6g}", k + 1, e.token,
                           e.logprob, r->logprob);
    } else if (reference.top.size() < static_cast<std::size_t>(kMaxLogprobs) ||  // the vocab
               e.logprob > reference.top.back().logprob + tolerance) {
      return fmt::format("top {}: token {} ({:.6g}) is not among the reference's {} most likely",
                         k + 1, e.token, e.logprob, reference.top.size());
    }
  }
  if (engine.top.empty()) return {};
  const float last = engine.top.back().logprob;  // nothing clearly likelier may be missing
  for (std::size_t k = 0; k < std::min(engine.top.size(), reference.top.size()); ++k) {
    const TokenLogprob& r = reference.top[k];
    if (!find_token(engine.top, r.token) && r.logprob > last + tolerance)
      return fmt::format("top {}: the reference's token {} ({:.6g}) is missing", k + 1, r.token,
                         r.logprob);
  }
  return {};
}

void LogprobAgreement::merge(const LogprobAgreement& other) {
  tokens += other.tokens;
  entries += other.entries;
  max_abs_delta = std::max(max_abs_delta, other.max_abs_delta);
}

}  // namespace kvlab
