#pragma once
// A scheduler plugin's plan is input from outside the engine: checked like a file before
// apply_plan touches the allocator or the table.
#include <string>

#include "kvlab/engine/request_table.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

// "" when `plan` is one apply_plan can commit against `table`; otherwise what is wrong with it,
// naming the entry and the request: every id is a request the scheduler was shown (waiting or
// swapped after its arrival, or running), preemptions name running requests with a known mode,
// work gives 1 .. new_tokens() tokens to a request not preempted in the same plan, deferrals
// name waiting requests without work, no request appears twice in one list, and a deferral's
// reason is at most kMaxDeferralReason bytes. O(plan size log plan size).
std::string plan_problem(const StepPlan& plan, const RequestTable& table);

inline constexpr std::size_t kMaxDeferralReason = 256;

}  // namespace kvlab
