// vtc: the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng et al.,
// OSDI 2024). Each tenant has a counter of the service it received: input_weight per prompt
// token prefilled and output_weight per token generated (the paper's w_p = 1, w_q = 2). Waiting
// requests are admitted from the tenant with the smallest counter first, charging each
// admission's prompt as it is picked; a tenant that was not waiting has its counter lifted to
// the smallest counter of those waiting (or to the last tenant's that stopped waiting), so
// that idling earns it no credit. Running requests go on as in fcfs.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <queue>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kvlab/continuous_scheduler.hpp"

namespace {

using kvlab::RequestId;
using kvlab::RequestState;

class VtcScheduler final : public kvlab::ContinuousScheduler {
 public:
  VtcScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                                     .chunked_prefill = params.boolean("chunked_prefill"),
                                     .preempt_for_priority = false}),
        input_weight_(params.real("input_weight")),
        output_weight_(params.real("output_weight")),
        ranked_(static_cast<std::size_t>(params.integer("max_batch")) + 1) {}

  kvlab::StepPlan schedule(const kvlab::SchedulerInput& input) override {
    index_requests(input);
    lift_new_arrivals(input.waiting);
    rank_waiting(input.waiting);
    hooks_.admission_order = [this](const RequestState& a, const RequestState& b) {
      return rank_[slot(a.id)] < rank_[slot(b.id)];
    };
    kvlab::StepPlan plan = ContinuousScheduler::schedule(input);
    charge(plan, input.waiting);
    return plan;
  }

 private:
  // What the scheduler keeps per request id (ids are dense submission indices).
  struct PerRequest {
    int tenant = -1;                      // index into counter_; -1 until first seen
    bool seen_waiting = false;            // shown waiting before
    std::int64_t prompt_charged = 0;      // prompt tokens charged so far
    const RequestState* state = nullptr;  // this step's
  };
  static std::size_t slot(RequestId id) { return static_cast<std::size_t>(id); }
  PerRequest& of(RequestId id) {
    if (slot(id) >= requests_.size())
      requests_.resize(std::max(slot(id) + 1, 2 * requests_.size()));
    return requests_[slot(id)];
  }
  // Each request's tenant as an index (names interned once per request) and its state.
  void index_requests(const kvlab::SchedulerInput& input) {
    for (auto list : {input.waiting, input.running})
      for (const RequestState* r : list) {
        PerRequest& p = of(r->id);
        p.state = r;
        if (p.tenant >= 0) continue;
        const auto [it, added] = tenant_index_.try_emplace(r->tenant, counter_.size());
        if (added) counter_.push_back(0);
        p.tenant = static_cast<int>(it->second);
      }
    rank_.resize(requests_.size());
  }
  double& counter(RequestId id) { return counter_[static_cast<std::size_t>(of(id).tenant)]; }

  // Service a request's work buys: its prompt tokens not charged before, and the token it
  // generates when the work reaches the end of its sequence.
  double cost(const RequestState& r, std::int64_t new_tokens) {
    const std::int64_t prompt_end = std::min(r.computed + new_tokens, r.prompt_tokens);
    const std::int64_t prompt = std::max<std::int64_t>(prompt_end - of(r.id).prompt_charged, 0);
    const bool generates = r.computed + new_tokens == r.length();
    return input_weight_ * static_cast<double>(prompt) + (generates ? output_weight_ : 0.0);
  }

  // The paper's counter lift: a tenant that starts waiting again may not bank the service it
  // did not ask for while it was away.
  void lift_new_arrivals(std::span<const RequestState* const> waiting) {
    std::vector<char> backlogged(counter_.size(), 0);
    double floor = std::numeric_limits<double>::infinity();
    for (const RequestState* r : waiting)
      if (const PerRequest& p = of(r->id); p.seen_waiting) {
        backlogged[static_cast<std::size_t>(p.tenant)] = 1;
        floor = std::min(floor, counter(r->id));
      }
    if (std::isinf(floor)) floor = last_left_;
    for (const RequestState* r : waiting) {
      PerRequest& p = of(r->id);
      if (p.seen_waiting) continue;
      p.seen_waiting = true;
      if (char& waits = backlogged[static_cast<std::size_t>(p.tenant)]; !waits) {
        waits = 1;  // its tenant was not waiting: lift it
        counter(r->id) = std::max(counter(r->id), floor);
      }
    }
  }

  // The admission order: repeatedly the waiting tenant with the smallest counter (as it would
  // be after the admissions before; ties: the earliest request), its earliest request. A heap
  // of tenants. Only the first max_batch + 1 positions are ranked: a step admits at most
  // max_batch and stops at the first refusal; the rest keep arrival order behind them.
  void rank_waiting(std::span<const RequestState* const> waiting) {
    std::vector<std::vector<const RequestState*>>& queues = queues_;  // capacity kept across steps
    queues.resize(counter_.size());
    for (auto& queue : queues) queue.clear();
    for (const RequestState* r : waiting) {  // each tenant's in arrival order
      queues[static_cast<std::size_t>(of(r->id).tenant)].push_back(r);
      rank_[slot(r->id)] = std::numeric_limits<std::size_t>::max();
    }
    using Head = std::tuple<double, RequestId, std::size_t>;  // counter, front id, tenant
    std::priority_queue<Head, std::vector<Head>, std::greater<>> heads;
    std::vector<std::size_t> next(queues.size(), 0);
    for (std::size_t t = 0; t < queues.size(); ++t)
      if (!queues[t].empty()) heads.emplace(counter_[t], queues[t].front()->id, t);
    for (std::size_t position = 0; position < ranked_ && !heads.empty(); ++position) {
      const auto [projected, id, t] = heads.top();
      heads.pop();
      const RequestState* r = queues[t][next[t]++];
      rank_[slot(id)] = position;
      const double charge = input_weight_ * static_cast<double>(std::max<std::int64_t>(
                                                r->prompt_tokens - of(id).prompt_charged, 0));
      if (next[t] < queues[t].size()) heads.emplace(projected + charge, queues[t][next[t]]->id, t);
    }
  }

  // Counters charged with the plan's work; the last tenant whose waiting requests all left.
  void charge(const kvlab::StepPlan& plan, std::span<const RequestState* const> waiting) {
    std::vector<std::int64_t> still_waiting(counter_.size(), 0);
    for (const RequestState* r : waiting)
      ++still_waiting[static_cast<std::size_t>(of(r->id).tenant)];
    for (const kvlab::Work& w : plan.work) {
      PerRequest& p = of(w.id);
      const RequestState& r = *p.state;
      counter(w.id) += cost(r, w.new_tokens);
      p.prompt_charged =
          std::max(p.prompt_charged, std::min(r.computed + w.new_tokens, r.prompt_tokens));
      if (r.is_waiting() && --still_waiting[static_cast<std::size_t>(p.tenant)] == 0)
        last_left_ = counter(w.id);
    }
  }

  double input_weight_, output_weight_;
  std::size_t ranked_;  // admission positions ranked per step
  std::unordered_map<std::string, std::size_t> tenant_index_;
  std::vector<double> counter_;  // by tenant index: service received
  std::vector<PerRequest> requests_;
  std::vector<std::size_t> rank_;                         // by id: this step's admission position
  std::vector<std::vector<const RequestState*>> queues_;  // by tenant: this step's waiting
  double last_left_ = 0;
};

constexpr auto kParams =
    kvlab::with_own_params(kvlab::continuous_scheduler_params("8192", "\"last_admitted\""),
                           std::array<kvlab::ParamSpec, 3>{{
                               kvlab::kChunkedPrefillParam,
                               {"input_weight", kvlab::ParamType::param_real,
                                "service counted per prompt token (w_p)", "1.0", 0, 1e6},
                               {"output_weight", kvlab::ParamType::param_real,
                                "service counted per generated token (w_q)", "2.0", 0, 1e6},
                           }});

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, VtcScheduler, "vtc",
             "fair share across tenants: the Virtual Token Counter (OSDI 2024)", kParams)
