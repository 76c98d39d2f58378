#pragma once
// The request table: every submitted request's state for the whole run, in one place — its
// tokens, how many have KV, its status, its swap buffer, its sampler and its timeline.
// Schedulers read it through SchedulerInput (waiting(), running()); apply_plan and
// apply_tokens (apply.hpp) are the only code that changes it, but for the sampled tokens'
// log-probabilities, which the engine records as it samples.
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/engine/metrics.hpp"
#include "kvlab/engine/sampling.hpp"
#include "kvlab/engine/submission.hpp"
#include "kvlab/request.hpp"

namespace kvlab {

// A request's KV handed from a prefill replica to a decode replica (disaggregated prefill and
// decode): its tokens generated so far (the first), and its KV as a swap buffer holds it
// (positions [kv.first, tokens_with_kv); no data on a pool without storage).
struct KvHandoff {
  RequestId id = 0;  // in the engine that handed it off
  std::vector<std::int32_t> generated;
  SwapBuffer kv;
  std::int64_t tokens_with_kv = 0;
  std::int64_t bytes = 0;  // K and V of those positions, every layer, in the pool's dtype
  double copy_out_s = 0;   // what copying them out really took here
  double time_s = 0;       // the handing engine's clock at the end of the step
};

class RequestTable {
 public:
  // Request i of `submitted` gets id i. With `arrivals_at_zero` (the offline clock) everyone
  // arrives at t = 0; otherwise at its arrival_s. Arrivals are taken in time order, ties by id.
  // `submitted` must outlive the table: prompts are copied in as requests arrive.
  RequestTable(std::span<const Submission> submitted, bool arrivals_at_zero);
  // One more request, while the run goes on (a cluster's router hands it to this replica): the
  // next id, arriving at its arrival_s (at 0 with arrivals_at_zero), which must not be earlier
  // than requests that already arrived. `request` must outlive the table.
  RequestId submit(const Submission& request);
  // Disaggregated prefill and decode. A request submitted for prefill finishes once it has its
  // first token (finish reason "handoff", unless that token ends it anyway) and the engine hands
  // its KV off. One submitted with a handoff arrives (at request.arrival_s) with those tokens
  // generated, their KV waiting as a transferred swap buffer, and its sampler past their draws.
  RequestId submit_for_prefill(const Submission& request);
  RequestId submit_with_kv(const Submission& request, KvHandoff handoff);
  bool hands_off(RequestId id) const { return hands_off_[index(id)]; }

  std::size_t size() const { return states_.size(); }
  const RequestState& at(RequestId id) const { return states_[index(id)]; }
  RequestState& at(RequestId id) { return states_[index(id)]; }
  RequestTimeline& timeline(RequestId id) { return timelines_[index(id)]; }
  const RequestTimeline& timeline(RequestId id) const { return timelines_[index(id)]; }
  Sampler& sampler(RequestId id) { return *samplers_[index(id)]; }
  // Each generated token's log-probabilities, for a request whose sampling asks for them
  // (SamplingParams::logprobs >= 0); empty for the others.
  std::vector<GeneratedLogprobs>& logprobs(RequestId id) { return logprobs_[index(id)]; }
  bool ignores_eos(RequestId id) const { return ignore_eos_[index(id)]; }
  // Arrived (a scheduler has been shown it), whatever its state now.
  bool has_arrived(RequestId id) const { return arrived_flags_[index(id)]; }

  // Waiting and swapped requests by (arrival, id); running requests by admission.
  std::span<const RequestState* const> waiting() const;
  std::span<const RequestState* const> running() const { return running_; }
  // The next request not yet arrived, if any; all of them, in arrival order.
  std::optional<RequestId> next_arrival() const;
  std::span<const RequestId> not_arrived() const {
    return std::span<const RequestId>(arrival_order_).subspan(arrived_);
  }
  bool all_done() const { return done_ == states_.size(); }
  // Tokens of KV held in the host swap pool by swapped requests.
  std::int64_t swap_used_tokens() const { return swap_used_; }

  // Status changes. Each checks the request is in the state it leaves.
  RequestId arrive();                                   // the next arrival -> waiting
  void reject(RequestId id, std::string reason);        // just arrived or waiting -> rejected
  void start_running(RequestId id, std::int64_t step);  // waiting or swapped -> running
  void stop_running(RequestId id, RequestStatus to);    // running -> waiting or swapped
  void finish(RequestId id, double now);                // running -> finished
  // Waiting, swapped or running -> finished with reason "cancelled" (a client that went away):
  // a swapped request's host KV is dropped here; a running one's pool KV is the caller's to free.
  void cancel(RequestId id, double now);
  void add_swap_tokens(std::int64_t tokens) { swap_used_ += tokens; }

  // The run's record: timelines and generated tokens, in submission order.
  std::vector<RequestTimeline> take_timelines() { return std::move(timelines_); }
  std::vector<std::vector<GeneratedLogprobs>> take_logprobs() { return std::move(logprobs_); }
  std::vector<std::vector<std::int32_t>> generated_tokens() const;

 private:
  std::size_t index(RequestId id) const { return static_cast<std::size_t>(id); }
  void insert_waiting(const RequestState* r);
  RequestId add(const Submission& request);  // appended to arrival_order_, unsorted

  bool arrivals_at_zero_ = false;
  std::vector<const Submission*> submitted_;
  std::deque<RequestState> states_;  // a deque: waiting_ and running_ point into it as it grows
  std::vector<RequestTimeline> timelines_;
  std::vector<std::vector<GeneratedLogprobs>> logprobs_;
  std::vector<std::optional<Sampler>> samplers_;  // made on arrival, dropped when done
  std::vector<SamplingParams> sampling_;
  std::vector<bool> ignore_eos_;
  std::vector<bool> arrived_flags_;
  std::vector<bool> hands_off_;
  std::vector<std::optional<KvHandoff>> handed_in_;  // until the request arrives
  std::vector<RequestId> arrival_order_;
  std::size_t arrived_ = 0, done_ = 0;
  // Admissions leave their entries in waiting_ until the next read (one pass per step instead of
  // one erase per admission).
  mutable std::vector<const RequestState*> waiting_;
  mutable bool waiting_has_admitted_ = false;
  std::vector<const RequestState*> running_;
  std::int64_t swap_used_ = 0;
};

}  // namespace kvlab
