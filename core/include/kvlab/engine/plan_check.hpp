#pragma once
// A scheduler plugin's plan is input from outside the engine: checked like a file before
// apply_plan touches the allocator or the table.
#include <cstdint>
#include <string>
#include <vector>

#include "kvlab/engine/request_table.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

// "" when `plan` is one apply_plan can commit against `table`; otherwise what is wrong with it,
// naming the entry and the request: every id is a request the scheduler was shown (waiting or
// swapped after its arrival, or running), preemptions name running requests with a known mode,
// work gives 1 .. new_tokens() tokens to a request not preempted in the same plan, deferrals
// name waiting requests without work, no request appears twice in one list, and a deferral's
// reason is at most kMaxDeferralReason bytes.
std::string plan_problem(const StepPlan& plan, const RequestTable& table);

// plan_problem for every step of a run: keeps its per-request scratch between checks.
class PlanChecker {
 public:
  std::string problem(const StepPlan& plan, const RequestTable& table);

 private:
  bool list(std::vector<std::uint64_t>& stamps, RequestId id);  // true: listed already
  bool listed(const std::vector<std::uint64_t>& stamps, RequestId id) const;
  std::vector<std::uint64_t> preempted_, worked_, deferred_;  // by request: the check listing it
  std::uint64_t check_ = 0;
};

inline constexpr std::size_t kMaxDeferralReason = 256;

}  // namespace kvlab
