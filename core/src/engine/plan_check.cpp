#include "kvlab/engine/plan_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace kvlab {
namespace {

const char* status_name(const RequestState& r) {
  switch (r.status) {
    case RequestStatus::waiting:
      return "waiting";
    case RequestStatus::running:
      return "running";
    case RequestStatus::swapped:
      return "swapped";
    case RequestStatus::finished:
      return "finished";
    case RequestStatus::rejected:
      return "rejected";
  }
  return "in an unknown state";
}

// Why `id` cannot be named by a plan, or "" with `r` set to its state.
std::string lookup(const RequestTable& table, RequestId id, const RequestState*& r) {
  if (id < 0 || static_cast<std::size_t>(id) >= table.size())
    return fmt::format("request {} does not exist (ids are 0 .. {})", id,
                       static_cast<std::int64_t>(table.size()) - 1);
  r = &table.at(id);
  if (r->is_waiting() && !table.has_arrived(id))
    return fmt::format("request {} has not arrived yet", id);
  return "";
}

std::string preemption_problem(const Preemption& p, const RequestTable& table) {
  const RequestState* r = nullptr;
  if (std::string problem = lookup(table, p.id, r); !problem.empty()) return "preempts " + problem;
  if (r->status != RequestStatus::running)
    return fmt::format("preempts request {}, which is {}, not running", p.id, status_name(*r));
  if (p.mode != PreemptMode::recompute && p.mode != PreemptMode::swap)
    return fmt::format("preempts request {} with mode {}, neither recompute (0) nor swap (1)", p.id,
                       static_cast<int>(p.mode));
  return "";
}

std::string work_problem(const Work& w, const RequestTable& table, bool preempted) {
  const RequestState* r = nullptr;
  if (std::string problem = lookup(table, w.id, r); !problem.empty())
    return "gives work to " + problem;
  if (!r->is_waiting() && r->status != RequestStatus::running)
    return fmt::format("gives work to request {}, which is {}", w.id, status_name(*r));
  if (preempted)
    return fmt::format("gives work to request {}, which it preempts in the same plan", w.id);
  if (w.new_tokens < 1 || w.new_tokens > r->schedulable_tokens())
    return fmt::format(
        "gives request {} {} new tokens; it has {} without KV and {} proposed (1 .. {} allowed)",
        w.id, w.new_tokens, r->new_tokens(), r->proposed.size(), r->schedulable_tokens());
  return "";
}

std::string deferral_problem(const Deferral& d, const RequestTable& table, bool worked) {
  const RequestState* r = nullptr;
  if (std::string problem = lookup(table, d.id, r); !problem.empty()) return "defers " + problem;
  if (!r->is_waiting())
    return fmt::format("defers request {}, which is {}, not waiting", d.id, status_name(*r));
  if (worked) return fmt::format("defers request {} and gives it work in the same plan", d.id);
  if (d.reason.size() > kMaxDeferralReason || (d.reason.data() == nullptr && !d.reason.empty()))
    return fmt::format("defers request {} with a reason of {} bytes (at most {})", d.id,
                       d.reason.size(), kMaxDeferralReason);
  return "";
}

}  // namespace

// Each list's entries are stamped with this check's number, per request: "listed already" and
// "preempted / given work in this plan" are one lookup each, O(plan) in all (sorting the ids
// cost a static batch's step ~30 us: it defers every waiting request every step).
bool PlanChecker::list(std::vector<std::uint64_t>& stamps, RequestId id) {
  auto& stamp = stamps[static_cast<std::size_t>(id)];
  const bool twice = stamp == check_;
  stamp = check_;
  return twice;
}

bool PlanChecker::listed(const std::vector<std::uint64_t>& stamps, RequestId id) const {
  return stamps[static_cast<std::size_t>(id)] == check_;
}

std::string PlanChecker::problem(const StepPlan& plan, const RequestTable& table) {
  ++check_;
  for (auto* stamps : {&preempted_, &worked_, &deferred_}) stamps->resize(table.size(), 0);
  for (const Preemption& p : plan.preempt) {
    if (std::string problem = preemption_problem(p, table); !problem.empty()) return problem;
    if (list(preempted_, p.id)) return fmt::format("lists request {} twice in preempt", p.id);
  }
  for (const Work& w : plan.work) {
    const bool preempted =
        w.id >= 0 && static_cast<std::size_t>(w.id) < table.size() && listed(preempted_, w.id);
    if (std::string problem = work_problem(w, table, preempted); !problem.empty()) return problem;
    if (list(worked_, w.id)) return fmt::format("lists request {} twice in work", w.id);
  }
  for (const Deferral& d : plan.deferred) {
    const bool worked =
        d.id >= 0 && static_cast<std::size_t>(d.id) < table.size() && listed(worked_, d.id);
    if (std::string problem = deferral_problem(d, table, worked); !problem.empty()) return problem;
    if (list(deferred_, d.id)) return fmt::format("lists request {} twice in deferred", d.id);
  }
  return "";
}

std::string plan_problem(const StepPlan& plan, const RequestTable& table) {
  PlanChecker checker;
  return checker.problem(plan, table);
}

}  // namespace kvlab
