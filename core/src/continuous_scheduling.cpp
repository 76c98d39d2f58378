#include <algorithm>
#include <limits>
#include <unordered_set>
#include <utility>

#include "kvlab/scheduler.hpp"

#include <stdexcept>
#include <string>

#include "kvlab/plugin_params.hpp"

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

// a before b in the policy's order.
bool before(const ScheduledRequest& a, const ScheduledRequest& b, ContinuousPolicy::Order order) {
  switch (order) {
    case ContinuousPolicy::Order::arrival:
      break;
    case ContinuousPolicy::Order::priority:
      if (a.priority != b.priority) return a.priority > b.priority;
      break;
    case ContinuousPolicy::Order::shortest_remaining: {
      const std::int64_t ra =
          a.oracle_remaining >= 0 ? a.oracle_remaining : a.max_new_tokens - a.generated;
      const std::int64_t rb =
          b.oracle_remaining >= 0 ? b.oracle_remaining : b.max_new_tokens - b.generated;
      if (ra != rb) return ra < rb;
      break;
    }
  }
  if (a.arrival_s != b.arrival_s) return a.arrival_s < b.arrival_s;
  return a.id < b.id;
}

}  // namespace

StepPlan schedule_continuous(const SchedulerInput& input, const ContinuousPolicy& policy) {
  StepPlan plan;
  Ledger ledger(*input.kv);
  std::int64_t budget = policy.max_tokens_per_step;

  // Running requests, most important first; victims are taken from the back (latest admitted /
  // lowest priority), as vLLM does.
  std::vector<const ScheduledRequest*> running;
  for (const auto& r : input.running) running.push_back(&r);
  std::stable_sort(running.begin(), running.end(), [&](const auto* a, const auto* b) {
    if (policy.order == ContinuousPolicy::Order::priority && a->priority != b->priority)
      return a->priority > b->priority;
    return a->admitted_step < b->admitted_step ||
           (a->admitted_step == b->admitted_step && a->id < b->id);
  });
  // Victims in the order they give way.
  std::vector<const ScheduledRequest*> victims(running.rbegin(), running.rend());
  if (policy.victim == ContinuousPolicy::Victim::lowest_priority)
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto* a, const auto* b) { return a->priority < b->priority; });
  else if (policy.victim == ContinuousPolicy::Victim::most_kv)
    std::stable_sort(victims.begin(), victims.end(),
                     [](const auto* a, const auto* b) { return a->tokens > b->tokens; });
  plan.swap_preempted = policy.swap;
  std::unordered_set<RequestId> preempted;
  std::int64_t budget_refund = 0;
  auto preempt = [&](const ScheduledRequest* victim) {
    preempted.insert(victim->id);
    plan.preempt.push_back(victim->id);
    ledger.give(ledger.kv().slots_held(victim->id));
    // A victim scheduled earlier in this step gives its tokens back too.
    budget_refund += static_cast<std::int64_t>(std::erase(plan.decode, victim->id));
    for (const auto& c : plan.prefill)
      if (c.id == victim->id) budget_refund += c.tokens;
    std::erase_if(plan.prefill, [&](const PrefillChunk& c) { return c.id == victim->id; });
  };
  auto preempt_last = [&](const ScheduledRequest* keep) -> bool {
    for (const ScheduledRequest* victim : victims) {
      if (victim == keep || preempted.count(victim->id)) continue;
      preempt(victim);
      return true;
    }
    return false;
  };

  std::int64_t batch = 0;
  // Decodes first: they are what keeps inter-token latency low.
  for (const ScheduledRequest* r : running) {
    if (preempted.count(r->id) || !r->decoding()) continue;
    if (budget < 1) break;
    const std::int64_t need = ledger.kv().slots_to_append(r->id, 1);
    bool fits = ledger.take(need);
    while (!fits && preempt_last(r)) fits = ledger.take(need);
    budget += std::exchange(budget_refund, 0);
    if (!fits) {  // nothing left to preempt but itself
      preempt(r);
      continue;
    }
    plan.decode.push_back(r->id);
    --budget;
    ++batch;
  }
  // Then running requests still computing their prompt (chunked prefill).
  for (const ScheduledRequest* r : running) {
    if (preempted.count(r->id) || !r->prefilling()) continue;
    const std::int64_t remaining = r->tokens - r->computed_tokens;
    const std::int64_t chunk = policy.chunked_prefill ? std::min(remaining, budget) : remaining;
    if (chunk <= 0 || chunk > budget) continue;  // slots were allocated at admission
    plan.prefill.push_back({r->id, chunk});
    budget -= chunk;
    ++batch;
  }
  const auto still_running = static_cast<std::int64_t>(running.size() - preempted.size());

  // Admissions. A request preempted this step is not re-admitted in the same step.
  std::vector<const ScheduledRequest*> waiting;
  for (const auto& r : input.waiting) waiting.push_back(&r);
  std::stable_sort(waiting.begin(), waiting.end(),
                   [&](const auto* a, const auto* b) { return before(*a, *b, policy.order); });
  std::int64_t running_count = still_running;
  bool blocked = false;
  for (const ScheduledRequest* r : waiting) {
    if (blocked) {
      plan.deferred.push_back({r->id, "behind_blocked_request"});
      continue;
    }
    if (running_count >= policy.max_batch) {
      plan.deferred.push_back({r->id, "max_batch"});
      blocked = true;
      continue;
    }
    const std::int64_t remaining = r->tokens - r->computed_tokens;  // all of it, unless swapped
    const std::int64_t chunk = policy.chunked_prefill ? std::min(remaining, budget) : remaining;
    if (chunk <= 0 || chunk > budget) {
      plan.deferred.push_back({r->id, "token_budget"});
      blocked = true;
      continue;
    }
    // The prompt (plus anything generated before a preemption) is allocated at admission.
    const AllocateRequest request{r->id, r->token_ids,
                                  r->tokens + (r->max_new_tokens - r->generated)};
    const std::int64_t need = ledger.kv().slots_to_allocate(request);
    bool fits = ledger.take(need);
    if (!fits && policy.preempt_for_priority) {
      // Preempt strictly lower-priority running requests, lowest first, while that helps.
      for (auto it = running.rbegin(); it != running.rend() && !fits; ++it) {
        const ScheduledRequest* victim = *it;
        if (victim->priority >= r->priority || preempted.count(victim->id)) continue;
        preempt(victim);
        --running_count;
        budget += std::exchange(budget_refund, 0);
        fits = ledger.take(need);
      }
    }
    if (!fits) {
      plan.deferred.push_back({r->id, "kv_full"});
      blocked = true;
      continue;
    }
    plan.admit.push_back(r->id);
    plan.prefill.push_back({r->id, chunk});
    budget -= chunk;
    ++running_count;
  }
  return plan;
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
  policy.swap = preemption == "swap";
  const auto victim = victim_policy_from_name(params.string("victim"));
  if (!victim)
    throw std::invalid_argument(
        "victim must be \"last_admitted\", \"lowest_priority\" or \"most_kv\", got \"" +
        params.string("victim") + "\"");
  policy.victim = *victim;
  return policy;
}

StepPlan schedule_static(const SchedulerInput& input, std::int64_t max_batch) {
  if (input.running.empty()) {  // form a new batch: whole prompts, arrival order
    ContinuousPolicy policy;
    policy.max_batch = max_batch;
    policy.max_tokens_per_step = std::numeric_limits<std::int64_t>::max() / 4;
    return schedule_continuous(input, policy);
  }
  // The batch runs to completion: same step logic, but nobody is admitted.
  ContinuousPolicy policy;
  policy.max_batch = max_batch;
  policy.max_tokens_per_step = std::numeric_limits<std::int64_t>::max() / 4;
  SchedulerInput running_only = input;
  running_only.waiting = {};
  StepPlan plan = schedule_continuous(running_only, policy);
  for (const auto& r : input.waiting) plan.deferred.push_back({r.id, "static_batch_running"});
  return plan;
}

}  // namespace kvlab
