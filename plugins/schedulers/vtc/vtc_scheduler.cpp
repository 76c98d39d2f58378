// vtc: the Virtual Token Counter of "Fairness in Serving Large Language Models" (Sheng et al.,
// OSDI 2024). Each tenant has a counter of the service it received: input_weight per prompt
// token prefilled and output_weight per token generated (the paper's w_p = 1, w_q = 2). Waiting
// requests are admitted from the tenant with the smallest counter first, charging each
// admission's prompt as it is picked; a tenant that was not waiting has its counter lifted to
// the smallest counter of those waiting (or to the last tenant's that stopped waiting), so
// that idling earns it no credit. Running requests go on as in fcfs.
#include <algorithm>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
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
        output_weight_(params.real("output_weight")) {}

  kvlab::StepPlan schedule(const kvlab::SchedulerInput& input) override {
    lift_new_arrivals(input.waiting);
    rank_waiting(input.waiting);
    hooks_.admission_order = [this](const RequestState& a, const RequestState& b) {
      return rank_.at(a.id) < rank_.at(b.id);
    };
    kvlab::StepPlan plan = ContinuousScheduler::schedule(input);
    charge(plan, input);
    return plan;
  }

 private:
  // Service a request's work buys: its prompt tokens not charged before, and the token it
  // generates when the work reaches the end of its sequence.
  double cost(const RequestState& r, std::int64_t new_tokens) {
    const std::int64_t prompt_end = std::min(r.computed + new_tokens, r.prompt_tokens);
    std::int64_t& charged = prompt_charged(r.id);
    const std::int64_t prompt = std::max<std::int64_t>(prompt_end - charged, 0);
    const bool generates = r.computed + new_tokens == r.length();
    return input_weight_ * static_cast<double>(prompt) + (generates ? output_weight_ : 0.0);
  }
  bool seen(RequestId id) {
    const auto i = static_cast<std::size_t>(id);
    if (i >= seen_.size()) seen_.resize(std::max(i + 1, seen_.size() * 2), false);
    return seen_[i];
  }
  std::int64_t& prompt_charged(RequestId id) {
    const auto i = static_cast<std::size_t>(id);
    if (i >= charged_.size()) charged_.resize(std::max(i + 1, charged_.size() * 2), 0);
    return charged_[i];
  }

  // The paper's counter lift: a tenant that starts waiting again may not bank the service it
  // did not ask for while it was away.
  void lift_new_arrivals(std::span<const RequestState* const> waiting) {
    std::unordered_set<std::string> backlogged;
    double floor = std::numeric_limits<double>::infinity();
    for (const RequestState* r : waiting)
      if (seen(r->id) && backlogged.insert(r->tenant).second)
        floor = std::min(floor, counter_[r->tenant]);
    if (backlogged.empty()) floor = last_left_;
    for (const RequestState* r : waiting) {
      if (seen(r->id)) continue;
      seen_[static_cast<std::size_t>(r->id)] = true;
      if (backlogged.insert(r->tenant).second) {  // its tenant was not waiting: lift it
        double& c = counter_[r->tenant];
        c = std::max(c, floor);
      }
    }
  }

  // The admission order: repeatedly the waiting tenant with the smallest counter (as it would
  // be after the admissions before), its earliest request.
  void rank_waiting(std::span<const RequestState* const> waiting) {
    std::unordered_map<std::string, std::vector<const RequestState*>> queues;
    for (const RequestState* r : waiting) queues[r->tenant].push_back(r);  // arrival order
    std::unordered_map<std::string, std::size_t> next;
    std::unordered_map<std::string, double> projected;
    for (const auto& [tenant, queue] : queues) projected[tenant] = counter_[tenant];
    rank_.clear();
    for (std::size_t position = 0; position < waiting.size(); ++position) {
      const std::string* pick = nullptr;
      for (const auto& [tenant, queue] : queues)
        if (next[tenant] < queue.size() &&
            (!pick || projected[tenant] < projected[*pick] ||
             (projected[tenant] == projected[*pick] &&
              queue[next[tenant]]->id < queues[*pick][next[*pick]]->id)))
          pick = &tenant;
      const RequestState* r = queues[*pick][next[*pick]++];
      rank_[r->id] = position;
      projected[*pick] += input_weight_ * static_cast<double>(std::max<std::int64_t>(
                                              r->prompt_tokens - prompt_charged(r->id), 0));
    }
  }

  // Counters charged with the plan's work; the last tenant whose waiting requests all left.
  void charge(const kvlab::StepPlan& plan, const kvlab::SchedulerInput& input) {
    std::unordered_map<RequestId, const RequestState*> by_id;
    std::unordered_map<std::string, std::int64_t> still_waiting;
    for (const RequestState* r : input.waiting) {
      by_id[r->id] = r;
      ++still_waiting[r->tenant];
    }
    for (const RequestState* r : input.running) by_id[r->id] = r;
    for (const kvlab::Work& w : plan.work) {
      const RequestState& r = *by_id.at(w.id);
      counter_[r.tenant] += cost(r, w.new_tokens);
      prompt_charged(r.id) =
          std::max(prompt_charged(r.id), std::min(r.computed + w.new_tokens, r.prompt_tokens));
      if (r.is_waiting() && --still_waiting[r.tenant] == 0) last_left_ = counter_[r.tenant];
    }
  }

  double input_weight_, output_weight_;
  std::unordered_map<std::string, double> counter_;
  std::vector<bool> seen_;             // by id: shown waiting before
  std::vector<std::int64_t> charged_;  // by id: prompt tokens charged so far
  std::unordered_map<RequestId, std::size_t> rank_;
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
