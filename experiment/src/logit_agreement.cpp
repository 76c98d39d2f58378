#include "kvlab/experiment/logit_agreement.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine_logit_log.hpp"
#include "kvlab/error.hpp"

namespace kvlab {

TopTokens top_tokens(std::span<const float> row) {
  if (row.size() < kTopTokens)
    throw Error(
        fmt::format("top_tokens: a row of {} values has no top {}", row.size(), kTopTokens));
  // ids sorted by value, larger first; a later id never passes an equal value (ties: lower id).
  TopTokens ids;
  std::iota(ids.begin(), ids.end(), 0);
  auto larger = [&](std::int32_t a, std::int32_t b) { return row[a] > row[b]; };
  std::stable_sort(ids.begin(), ids.end(), larger);
  for (std::size_t i = kTopTokens; i < row.size(); ++i) {
    if (!(row[i] > row[ids.back()])) continue;
    std::size_t at = kTopTokens - 1;
    for (; at > 0 && row[i] > row[ids[at - 1]]; --at) ids[at] = ids[at - 1];
    ids[at] = static_cast<std::int32_t>(i);
  }
  return ids;
}

double LogitAgreement::mean_row_max_delta() const {
  return rows > 0 ? sum_row_max_delta / static_cast<double>(rows) : 0.0;
}

double LogitAgreement::top_overlap() const {
  return top_positions > 0
             ? static_cast<double>(top_shared) / static_cast<double>(kTopTokens * top_positions)
             : 1.0;
}

void LogitAgreement::add_row(std::span<const float> engine, std::span<const float> reference) {
  if (engine.size() != reference.size())
    throw Error(fmt::format("logit rows of {} and {} tokens cannot be compared", engine.size(),
                            reference.size()));
  double row_max = 0;
  for (std::size_t i = 0; i < engine.size(); ++i)
    row_max = std::max(row_max, std::abs(static_cast<double>(engine[i]) - reference[i]));
  ++rows;
  max_abs_delta = std::max(max_abs_delta, row_max);
  sum_row_max_delta += row_max;
}

void LogitAgreement::add_top(const TopTokens& engine, const TopTokens& reference) {
  ++top_positions;
  for (const std::int32_t id : engine)
    top_shared += std::count(reference.begin(), reference.end(), id);
}

EngineLogitLog::EngineLogitLog(std::int64_t vocab, std::size_t row_budget_bytes)
    : vocab_(vocab),
      budget_rows_(row_budget_bytes / (sizeof(float) * static_cast<std::size_t>(vocab))) {
  if (vocab < static_cast<std::int64_t>(kTopTokens))
    throw Error(fmt::format("a vocabulary of {} tokens has no top {}", vocab, kTopTokens));
}

void EngineLogitLog::record(std::size_t replica, RequestId id, std::span<const float> row) {
  if (static_cast<std::int64_t>(row.size()) != vocab_)
    throw Error(fmt::format("engine logits of {} tokens, the model's vocabulary is {}", row.size(),
                            vocab_));
  Request& r = requests_[{replica, id}];
  r.top.push_back(top_tokens(row));
  // Only a request whose every earlier row was kept keeps this one: kept rows stay a prefix.
  if (kept_rows_ < budget_rows_ && r.kept_rows(vocab_) + 1 == r.top.size()) {
    r.rows.insert(r.rows.end(), row.begin(), row.end());
    ++kept_rows_;
  }
}

const EngineLogitLog::Request& EngineLogitLog::request(std::size_t replica, RequestId id) const {
  static const Request kNone;
  const auto found = requests_.find({replica, id});
  return found == requests_.end() ? kNone : found->second;
}

}  // namespace kvlab
