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

// Most KV held first (a running request's view: every one holds its sequence), stable.
void sort_by_kv_held(Requests& requests, const KvAllocator& kv) {
  std::vector<std::pair<std::int64_t, const RequestState*>> held;
  for (const RequestState* r : requests) held.emplace_back(kv.view(r->id).length(), r);
  std::stable_sort(held.begin(), held.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::size_t i = 0; i < held.size(); ++i) requests[i] = held[i].second;
}

// Running requests in the order they give way: from the back of the running queue (latest
// admitted / least important, as vLLM does), re-ordered by the victim policy. most_kv reads the
// KV each holds from the allocator's view: under a KV policy that is not its length.
Requests victim_queue(const Requests& running, const ContinuousPolicy& policy,
                      const PolicyHooks& hooks, const KvAllocator& kv) {
  Requests victims(running.rbegin(), running.rend());
  if (hooks.victim_order)
    std::stable_sort(victims.begin(), victims.end(),
                     [&](const auto* a, const auto* b) { return hooks.victim_order(*a, *b); });
  else if (policy.victim == ContinuousPolicy::Victim::lowest_priority)
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto* a, const auto* b) { return a->priority < b->priority; });
  else if (policy.victim == ContinuousPolicy::Victim::most_kv)
    sort_by_kv_held(victims, kv);
  return victims;
}

// One step's plan under construction: the token budget, the allocator's planner (every KV
// operation tried in commit order), who is preempted.
class PlanBuilder {
 public:
  PlanBuilder(const SchedulerInput& input, const ContinuousPolicy& policy, const PolicyHooks& hooks)
      : policy_(policy),
        input_(input),
        budget_(policy.max_tokens_per_step),
        running_(running_queue(input, policy)),
        victims_(victim_queue(running_, policy, hooks, *input.kv)) {
    plan_step_begin(*input.kv, input.running);
  }

  StepPlan take() { return std::move(plan_); }
  void schedule_running();
  void schedule_waiting(AdmissionQueue& waiting);

 private:
  bool is_preempted(const RequestState* r) const {
    return std::find(preempted_.begin(), preempted_.end(), r) != preempted_.end();
  }
  // Tries r's KV operation for `new_tokens` on the planner, after those planned so far.
  bool plan_kv(const RequestState& r, std::int64_t new_tokens = 1) {
    if (!plan_work(*input_.kv, r, new_tokens)) return false;
    planned_.emplace_back(&r, new_tokens);
    return true;
  }
  // Gives back any work the victim was given this step, and replans: apply frees every
  // preempted sequence before it commits any work, so the planner must see the frees first.
  void preempt(const RequestState* victim) {
    preempted_.push_back(victim);
    plan_.preempt.push_back({victim->id, policy_.preemption});
    drop_work(victim);
    replan();
  }
  void drop_work(const RequestState* r) {
    std::erase_if(planned_, [&](const auto& p) { return p.first == r; });
    std::erase_if(plan_.work, [&](const Work& w) {
      if (w.id != r->id) return false;
      budget_ += w.new_tokens;
      return true;
    });
  }
  // The planner from scratch: frees first, then the planned operations in order. An operation
  // that no longer fits (first-fit placement can change with more free space) loses its work.
  void replan() {
    const KvAllocator& kv = *input_.kv;
    plan_step_begin(kv, input_.running);
    for (const RequestState* r : preempted_) kv.plan_free(r->id);
    const auto planned = std::exchange(planned_, {});
    for (const auto& [r, new_tokens] : planned)
      if (!plan_kv(*r, new_tokens)) drop_work(r);
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
  const SchedulerInput& input_;
  std::int64_t budget_;     // tokens left this step
  std::int64_t batch_ = 0;  // running requests after this step's preemptions and admissions
  Requests running_, victims_, preempted_;
  // Requests whose KV operation the planner accepted (and their new tokens), in plan order.
  std::vector<std::pair<const RequestState*, std::int64_t>> planned_;
  StepPlan plan_;
};

void PlanBuilder::schedule_running() {
  batch_ = static_cast<std::int64_t>(running_.size());
  // Decodes first: they are what keeps inter-token latency low. A decode with speculative
  // proposals verifies as many as the budget leaves (its newest token first).
  for (const RequestState* r : running_) {
    if (is_preempted(r) || !r->decoding()) continue;
    if (budget_ < 1) break;
    const std::int64_t tokens = std::min(r->schedulable_tokens(), budget_);
    bool fits = plan_kv(*r, tokens);
    while (!fits && preempt_next_victim(r)) fits = plan_kv(*r, tokens);
    if (!fits) {  // nothing left to preempt but itself
      preempt(r);
      continue;
    }
    plan_.work.push_back({r->id, tokens});
    budget_ -= tokens;
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
  bool fits = plan_kv(r);
  if (!fits && policy_.preempt_for_priority) {
    for (auto it = running_.rbegin(); it != running_.rend() && !fits; ++it) {
      const RequestState* victim = *it;
      if (victim->priority >= r.priority || is_preempted(victim)) continue;
      preempt(victim);
      --batch_;
      fits = plan_kv(r);
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

KvOperation kv_operation(const RequestState& r) {
  if (r.is_waiting()) return KvOperation::kv_allocate;
  if (r.decoding() && r.recompute_each_step) return KvOperation::kv_reallocate;
  if (r.decoding() && r.allocated < r.length()) return KvOperation::kv_append;
  return KvOperation::kv_none;
}

void plan_step_begin(const KvAllocator& kv, std::span<const RequestState* const> running) {
  kv.plan_reset();
  for (const RequestState* r : running)
    if (kv_operation(*r) == KvOperation::kv_reallocate) kv.plan_free(r->id);
}

bool plan_work(const KvAllocator& kv, const RequestState& r, std::int64_t new_tokens) {
  switch (kv_operation(r)) {
    case KvOperation::kv_allocate:
      return kv.plan_allocate(
          {r.id, r.tokens, r.length() + r.remaining_output(), &r.prefix_hashes});
    case KvOperation::kv_reallocate:
      return kv.plan_allocate({r.id, r.tokens, r.length(), &r.prefix_hashes});
    case KvOperation::kv_append:
      return kv.plan_append(r.id, r.computed + new_tokens - r.allocated);
    case KvOperation::kv_none:
      break;
  }
  return true;
}

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

StepPlan schedule_static(const SchedulerInput& input, std::int64_t max_batch, bool padding) {
  ContinuousPolicy policy;  // whole prompts, arrival order, no token budget
  policy.max_batch = max_batch;
  policy.max_tokens_per_step = std::numeric_limits<std::int64_t>::max() / 4;
  StepPlan plan;
  if (input.running.empty()) {
    plan = schedule_continuous(input, policy);  // form a new batch
  } else {  // the batch runs to completion: same step logic, but nobody is admitted
    SchedulerInput running_only = input;
    running_only.waiting = {};
    plan = schedule_continuous(running_only, policy);
    for (const RequestState* r : input.waiting)
      plan.deferred.push_back({r->id, "static_batch_running"});
  }
  plan.pad_finished = padding;
  return plan;
}

}  // namespace kvlab
