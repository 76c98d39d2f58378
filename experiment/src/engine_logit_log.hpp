#pragma once
// The engine's logits as kvlab check --tolerance sees them (EngineOptions::on_logits): for every
// generated token its five most likely ids, and whole rows while a memory budget lasts, so the
// check can measure them against the reference's (logit_agreement.hpp).
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "kvlab/experiment/logit_agreement.hpp"
#include "kvlab/request.hpp"

namespace kvlab {

class EngineLogitLog {
 public:
  // Rows are kept until they would take more than `row_budget_bytes`; after that only top
  // tokens. A request's kept rows are thus always its first ones.
  EngineLogitLog(std::int64_t vocab, std::size_t row_budget_bytes);

  struct Request {
    std::vector<TopTokens> top;  // one per generated token, in order
    std::vector<float> rows;     // (kept rows, vocab): the first tokens' logits
    std::size_t kept_rows(std::int64_t vocab) const {
      return rows.size() / static_cast<std::size_t>(vocab);
    }
  };

  // One sampled row of request `id` in replica `replica`'s engine (logits of its next token).
  void record(std::size_t replica, RequestId id, std::span<const float> row);
  // What was recorded for that request (empty when nothing was).
  const Request& request(std::size_t replica, RequestId id) const;
  std::int64_t vocab() const { return vocab_; }

 private:
  std::int64_t vocab_;
  std::size_t budget_rows_;
  std::size_t kept_rows_ = 0;
  std::map<std::pair<std::size_t, RequestId>, Request> requests_;
};

}  // namespace kvlab
