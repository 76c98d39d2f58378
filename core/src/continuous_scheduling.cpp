// The shared continuous-batching algorithm (schedule_continuous) and the static baseline.
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvlab/plugin_params.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {
namespace {

// Slots the plan has committed so far, against what the allocator has free now.
class Ledger {
 public:
  explicit Ledger(const KvAllocator& kv) : kv_(kv), free_(kv.free_slots()) {}
  bool take(std::int64_t slots) {
    if (slots > free_) return false;
    free_ -= slots;
    return true;
  }
  void give(std::int64_t slots) { free_ += slots; }
  const KvAllocator& kv() const { return kv_; }

 private:
  const KvAllocator& kv_;
  std::int64_t free_;
};

// a before b in a built-in admission order; ties by arrival, then id.
bool admitted_before(const RequestState& a, const RequestState& b, ContinuousPolicy::Order order) {
  switch (order) {
    case ContinuousPolicy::Order::arrival:
      break;
    case ContinuousPolicy::Order::priority:
      if (a.priority != b.priority) return a.priority > b.priority;
      break;
    case ContinuousPolicy::Order::shortest_remaining:
      if (a.remaining_output() != b.remaining_output())
        return a.remaining_output() < b.remaining_output();
      break;
  }
  if (a.arrival_s != b.arrival_s) return a.arrival_s < b.arrival_s;
  return a.id < b.id;
}

using Requests = std::vector<const RequestState*>;

// Waiting requests in the policy's admission order, produced lazily: admission usually stops
// after a few requests (a full batch stops at the first), so a heap (O(n) to build, O(log n) a
// request) replaces sorting every waiting request every step. The input is already by
// (arrival, id): first-come-first-served reads it in place.
class AdmissionQueue {
  // The heap's top is the request that comes first.
  struct Later {
    const AdmissionQueue* queue;
    bool operator()(const RequestState* a, const RequestState* b) const {
      return queue->before(*b, *a);
    }
  };

 public:
  AdmissionQueue(const SchedulerInput& input, const ContinuousPolicy& policy,
                 const PolicyHooks& hooks)
      : waiting_(input.waiting), policy_(policy), hooks_(hooks) {
    if (!hooks.admission_order && policy.order == ContinuousPolicy::Order::arrival) return;
    heap_.assign(input.waiting.begin(), input.waiting.end());
    std::make_heap(heap_.begin(), heap_.end(), Later{this});
    sorted_ = false;
  }
  const RequestState* next() {
    if (sorted_) return next_ < waiting_.size() ? waiting_[next_++] : nullptr;
    if (heap_.empty()) return nullptr;
    std::pop_heap(heap_.begin(), heap_.end(), Later{this});
    const RequestState* r = heap_.back();
    heap_.pop_back();
    return r;
  }

 private:
  // a comes before b: the plugin's order or the policy's, ties by arrival, then id.
  bool before(const RequestState& a, const RequestState& b) const {
    if (!hooks_.admission_order) return admitted_before(a, b, policy_.order);
    if (hooks_.admission_order(a, b)) return true;
    if (hooks_.admission_order(b, a)) return false;
    return admitted_before(a, b, ContinuousPolicy::Order::arrival);
  }
  std::span<const RequestState* const> waiting_;
  const ContinuousPolicy& policy_;
  const PolicyHooks& hooks_;
  bool sorted_ = true;
  std::size_t next_ = 0;
  Requests heap_;
};

// Running requests, most important first (the priority order, then admission).
Requests running_queue(const SchedulerInput& input, const ContinuousPolicy& policy) {
  Requests running(input.running.begin(), input.running.end());
  std::stable_sort(running.begin(), running.end(), [&](const auto* a, const auto* b) {
    if (policy.order == ContinuousPolicy::Order::priority && a->priority != b->priority)
      return a->priority > b->priority;
    return a->admitted_step < b->admitted_step ||
           (a->admitted_step == b->admitted_step && a->id < b->id);
  });
  return running;
}

// Running requests in the order they give way: from the back of the running queue (latest
// admitted / least important, as vLLM does), re-ordered by the victim policy.
Requests victim_queue(const Requests& running, const ContinuousPolicy& policy,
                      const PolicyHooks& hooks) {
  Requests victims(running.rbegin(), running.rend());
  if (hooks.victim_order)
    std::stable_sort(victims.begin(), victims.end(),
                     [&](const auto* a, const auto* b) { return hooks.victim_order(*a, *b); });
  else if (policy.victim == ContinuousPolicy::Victim::lowest_priority)
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto* a, const auto* b) { return a->priority < b->priority; });
  else if (policy.victim == ContinuousPolicy::Victim::most_kv)
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto* a, const auto* b) { return a->length() > b->length(); });
  return victims;
}

// One step's plan under construction: the token budget, the KV ledger, who is preempted.
class PlanBuilder {
 public:
  PlanBuilder(const SchedulerInput& input, const ContinuousPolicy& policy, const PolicyHooks& hooks)
      : policy_(policy),
        ledger_(*input.kv),
        budget_(policy.max_tokens_per_step),
        running_(running_queue(input, policy)),
        victims_(victim_queue(running_, policy, hooks)) {}

  StepPlan take() { return std::move(plan_); }
  void schedule_running();
  void schedule_waiting(AdmissionQueue& waiting);

 private:
  bool is_preempted(const RequestState* r) const {
    return std::find(preempted_.begin(), preempted_.end(), r) != preempted_.end();
  }
  // Frees the victim's KV in the ledger and gives back any work it was given this step.
  void preempt(const RequestState* victim) {
    preempted_.push_back(victim);
    plan_.preempt.push_back({victim->id, policy_.preemption});
    ledger_.give(ledger_.kv().slots_held(victim->id));
    std::erase_if(plan_.work, [&](const Work& w) {
      if (w.id != victim->id) return false;
      budget_ += w.new_tokens;
      return true;
    });
  }
  // Preempts the next victim that is not `keep`; false when there is none left.
  bool preempt_next_victim(const RequestState* keep) {
    for (const RequestState* victim : victims_) {
      if (victim == keep || is_preempted(victim)) continue;
      preempt(victim);
      return true;
    }
    return false;
  }
  bool admit(const RequestState& r, std::int64_t chunk);
  // The prompt chunk a request may compute within the budget (0: none).
  std::int64_t chunk_for(const RequestState& r) const {
    const std::int64_t chunk =
        policy_.chunked_prefill ? std::min(r.new_tokens(), budget_) : r.new_tokens();
    return chunk > 0 && chunk <= budget_ ? chunk : 0;
  }

  const ContinuousPolicy& policy_;
  Ledger ledger_;
  std::int64_t budget_;     // tokens left this step
  std::int64_t batch_ = 0;  // running requests after this step's preemptions and admissions
  Requests running_, victims_, preempted_;
  StepPlan plan_;
};

void PlanBuilder::schedule_running() {
  batch_ = static_cast<std::int64_t>(running_.size());
  // Decodes first: they are what keeps inter-token latency low.
  for (const RequestState* r : running_) {
    if (is_preempted(r) || !r->decoding()) continue;
    if (budget_ < 1) break;
    const std::int64_t need = ledger_.kv().slots_to_append(r->id, 1);
    bool fits = ledger_.take(need);
    while (!fits && preempt_next_victim(r)) fits = ledger_.take(need);
    if (!fits) {  // nothing left to preempt but itself
      preempt(r);
      continue;
    }
    plan_.work.push_back({r->id, 1});
    --budget_;
  }
  // Then running requests still computing their prompt (chunked prefill); their slots were
  // allocated at admission.
  for (const RequestState* r : running_) {
    if (is_preempted(r) || !r->prefilling()) continue;
    if (const std::int64_t chunk = chunk_for(*r); chunk > 0) {
      plan_.work.push_back({r->id, chunk});
      budget_ -= chunk;
    }
  }
  batch_ = static_cast<std::int64_t>(running_.size() - preempted_.size());
}

// Admits `r` when batch slots, the token budget and the KV cache allow (preempting strictly
// lower-priority requests when the policy says so).
bool PlanBuilder::admit(const RequestState& r, std::int64_t chunk) {
  // The sequence so far (prompt, plus anything generated before a preemption) is allocated.
  const AllocateRequest request{r.id, r.tokens, r.length() + r.remaining_output()};
  const std::int64_t need = ledger_.kv().slots_to_allocate(request);
  bool fits = ledger_.take(need);
  if (!fits && policy_.preempt_for_priority) {
    for (auto it = running_.rbegin(); it != running_.rend() && !fits; ++it) {
      const RequestState* victim = *it;
      if (victim->priority >= r.priority || is_preempted(victim)) continue;
      preempt(victim);
      --batch_;
      fits = ledger_.take(need);
    }
  }
  if (!fits) return false;
  plan_.work.push_back({r.id, chunk});
  budget_ -= chunk;
  ++batch_;
  return true;
}

// Admissions in order until the first request that does not fit: it is deferred with the
// reason, and everyone behind it waits too (head-of-line; they are not listed, so a step costs
// nothing per waiting request beyond the blocker). A request preempted this step is not in
// `waiting`, so it is not re-admitted in the same step.
void PlanBuilder::schedule_waiting(AdmissionQueue& waiting) {
  while (const RequestState* r = waiting.next()) {
    std::string_view blocked;
    if (batch_ >= policy_.max_batch)
      blocked = "max_batch";
    else if (const std::int64_t chunk = chunk_for(*r); chunk == 0)
      blocked = "token_budget";
    else if (!admit(*r, chunk))
      blocked = "kv_full";
    if (!blocked.empty()) {
      plan_.deferred.push_back({r->id, blocked});
      return;
    }
  }
}

}  // namespace

StepPlan schedule_continuous(const SchedulerInput& input, const ContinuousPolicy& policy,
                             const PolicyHooks& hooks) {
  PlanBuilder builder(input, policy, hooks);
  builder.schedule_running();
  AdmissionQueue waiting(input, policy, hooks);
  builder.schedule_waiting(waiting);
  return builder.take();
}

std::optional<ContinuousPolicy::Victim> victim_policy_from_name(std::string_view name) {
  if (name == "last_admitted") return ContinuousPolicy::Victim::last_admitted;
  if (name == "lowest_priority") return ContinuousPolicy::Victim::lowest_priority;
  if (name == "most_kv") return ContinuousPolicy::Victim::most_kv;
  return std::nullopt;
}

ContinuousPolicy continuous_policy_from_params(const PluginParams& params,
                                               ContinuousPolicy policy) {
  policy.max_batch = params.integer("max_batch");
  policy.max_tokens_per_step = params.integer("max_tokens_per_step");
  const std::string& preemption = params.string("preemption");
  if (preemption != "recompute" && preemption != "swap")
    throw std::invalid_argument("preemption must be \"recompute\" or \"swap\", got \"" +
                                preemption + "\"");
  policy.preemption = preemption == "swap" ? PreemptMode::swap : PreemptMode::recompute;
  const auto victim = victim_policy_from_name(params.string("victim"));
  if (!victim)
    throw std::invalid_argument(
        "victim must be \"last_admitted\", \"lowest_priority\" or \"most_kv\", got \"" +
        params.string("victim") + "\"");
  policy.victim = *victim;
  return policy;
}

StepPlan schedule_static(const SchedulerInput& input, std::int64_t max_batch) {
  ContinuousPolicy policy;  // whole prompts, arrival order, no token budget
  policy.max_batch = max_batch;
  policy.max_tokens_per_step = std::numeric_limits<std::int64_t>::max() / 4;
  if (input.running.empty()) return schedule_continuous(input, policy);  // form a new batch
  // The batch runs to completion: same step logic, but nobody is admitted.
  SchedulerInput running_only = input;
  running_only.waiting = {};
  StepPlan plan = schedule_continuous(running_only, policy);
  for (const RequestState* r : input.waiting)
    plan.deferred.push_back({r->id, "static_batch_running"});
  return plan;
}

}  // namespace kvlab
