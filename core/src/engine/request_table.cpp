#include "kvlab/engine/request_table.hpp"

#include <algorithm>
#include <cassert>

namespace kvlab {

RequestTable::RequestTable(std::span<const Submission> submitted, bool arrivals_at_zero)
    : arrivals_at_zero_(arrivals_at_zero) {
  for (const Submission& w : submitted) add(w);
  std::stable_sort(arrival_order_.begin(), arrival_order_.end(), [&](RequestId a, RequestId b) {
    return states_[index(a)].arrival_s < states_[index(b)].arrival_s;
  });
}

RequestId RequestTable::add(const Submission& w) {
  const auto id = static_cast<RequestId>(states_.size());
  RequestState& r = states_.emplace_back();
  r.id = id;
  r.arrival_s = arrivals_at_zero_ ? 0.0 : w.arrival_s;
  r.priority = w.priority;
  r.tenant = w.tenant;
  r.prefix_hashes.salt = cache_salt_hash(w.cache_salt);
  if (w.slo.ttft_s) r.ttft_deadline_s = r.arrival_s + *w.slo.ttft_s;
  r.prompt_tokens = static_cast<std::int64_t>(w.prompt.size());
  r.max_new_tokens = w.output_tokens;
  RequestTimeline& timeline = timelines_.emplace_back();
  timeline.id = r.id;
  timeline.priority = w.priority;
  timeline.tenant = w.tenant;
  timeline.slo = w.slo;
  timeline.prompt_tokens = r.prompt_tokens;
  timeline.arrival_s = r.arrival_s;
  logprobs_.emplace_back();
  SamplingParams& sampling = sampling_.emplace_back(w.sampling);
  sampling.max_tokens = static_cast<std::int32_t>(w.output_tokens);
  ignore_eos_.push_back(w.sampling.ignore_eos);
  arrived_flags_.push_back(false);
  hands_off_.push_back(false);
  handed_in_.emplace_back();
  samplers_.emplace_back();
  submitted_.push_back(&w);
  arrival_order_.push_back(id);
  return id;
}

RequestId RequestTable::submit(const Submission& request) {
  const RequestId id = add(request);
  // Among the requests not arrived yet, in (arrival, id) order: after every equal arrival.
  const double arrival = states_[index(id)].arrival_s;
  arrival_order_.pop_back();
  const auto first = arrival_order_.begin() + static_cast<std::ptrdiff_t>(arrived_);
  arrival_order_.insert(std::upper_bound(first, arrival_order_.end(), arrival,
                                         [&](double t, RequestId other) {
                                           return t < states_[index(other)].arrival_s;
                                         }),
                        id);
  return id;
}

RequestId RequestTable::submit_for_prefill(const Submission& request) {
  const RequestId id = submit(request);
  hands_off_[index(id)] = true;
  return id;
}

RequestId RequestTable::submit_with_kv(const Submission& request, KvHandoff handoff) {
  const RequestId id = submit(request);
  handoff.kv.transferred = true;
  handed_in_[index(id)] = std::move(handoff);
  return id;
}

std::optional<RequestId> RequestTable::next_arrival() const {
  if (arrived_ == arrival_order_.size()) return std::nullopt;
  return arrival_order_[arrived_];
}

RequestId RequestTable::arrive() {
  const RequestId id = arrival_order_.at(arrived_++);
  arrived_flags_[index(id)] = true;
  RequestState& r = at(id);
  r.tokens = submitted_[index(id)]->prompt;
  samplers_[index(id)].emplace(sampling_[index(id)]);
  if (std::optional<KvHandoff>& in = handed_in_[index(id)]) {  // its first tokens, their KV
    r.tokens.insert(r.tokens.end(), in->generated.begin(), in->generated.end());
    r.computed = in->tokens_with_kv;
    r.swap = std::move(in->kv);
    r.status = RequestStatus::swapped;
    if (sampling_[index(id)].temperature > 0)  // one draw per token already generated
      for (std::size_t t = 0; t < in->generated.size(); ++t)
        (void)samplers_[index(id)]->next_uniform();
    in.reset();
  }
  // Arrivals come in (arrival, id) order, after everyone already waiting.
  waiting();
  waiting_.push_back(&r);
  return id;
}

void RequestTable::reject(RequestId id, std::string reason) {
  RequestState& r = at(id);
  assert(r.is_waiting());
  waiting();  // settles earlier admissions
  std::erase(waiting_, &r);
  r.status = RequestStatus::rejected;
  RequestTimeline& timeline = timelines_[index(id)];
  timeline.rejected = true;
  timeline.reject_reason = std::move(reason);
  samplers_[index(id)].reset();
  ++done_;
}

std::span<const RequestState* const> RequestTable::waiting() const {
  if (waiting_has_admitted_) {
    std::erase_if(waiting_, [](const RequestState* r) { return !r->is_waiting(); });
    waiting_has_admitted_ = false;
  }
  return waiting_;
}

void RequestTable::start_running(RequestId id, std::int64_t step) {
  RequestState& r = at(id);
  assert(r.is_waiting());
  waiting_has_admitted_ = true;
  r.status = RequestStatus::running;
  r.admitted_step = step;
  running_.push_back(&r);
}

void RequestTable::stop_running(RequestId id, RequestStatus to) {
  RequestState& r = at(id);
  assert(r.status == RequestStatus::running &&
         (to == RequestStatus::waiting || to == RequestStatus::swapped));
  std::erase(running_, &r);
  r.status = to;
  r.admitted_step = -1;
  insert_waiting(&r);
}

void RequestTable::finish(RequestId id, double now) {
  RequestState& r = at(id);
  assert(r.status == RequestStatus::running);
  std::erase(running_, &r);
  r.status = RequestStatus::finished;
  timelines_[index(id)].finish_s = now;
  samplers_[index(id)].reset();
  ++done_;
}

void RequestTable::cancel(RequestId id, double now) {
  RequestState& r = at(id);
  assert(r.is_waiting() || r.status == RequestStatus::running);
  if (r.status == RequestStatus::running) {
    std::erase(running_, &r);
  } else {
    waiting();  // settles earlier admissions
    std::erase(waiting_, &r);
  }
  if (r.status == RequestStatus::swapped && !r.swap.transferred)
    add_swap_tokens(-(r.computed - r.swap.first));
  r.swap = {};
  r.status = RequestStatus::finished;
  RequestTimeline& timeline = timelines_[index(id)];
  timeline.finish_s = now;
  timeline.finish_reason = "cancelled";
  samplers_[index(id)].reset();
  ++done_;
}

void RequestTable::insert_waiting(const RequestState* r) {
  waiting();  // settles earlier admissions
  const auto by_arrival = [](const RequestState* a, const RequestState* b) {
    return a->arrival_s < b->arrival_s || (a->arrival_s == b->arrival_s && a->id < b->id);
  };
  waiting_.insert(std::upper_bound(waiting_.begin(), waiting_.end(), r, by_arrival), r);
}

std::vector<std::vector<std::int32_t>> RequestTable::generated_tokens() const {
  std::vector<std::vector<std::int32_t>> out(states_.size());
  for (std::size_t i = 0; i < states_.size(); ++i) {
    const RequestState& r = states_[i];
    if (r.length() > r.prompt_tokens)
      out[i].assign(r.tokens.begin() + r.prompt_tokens, r.tokens.end());
  }
  return out;
}

}  // namespace kvlab
