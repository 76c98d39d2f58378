#include "kvlab/engine/live_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

using TokenObserver = std::function<void(RequestId, std::int32_t, const GeneratedLogprobs*)>;

EngineOptions live_options(EngineOptions options, bool paced, TokenObserver own,
                           FrameObserver* frames) {
  options.clock = paced ? EngineClock::paced : EngineClock::wall;
  options.frame_observer = frames;
  TokenObserver theirs = std::move(options.observers.on_token);
  options.observers.on_token = [own = std::move(own), theirs = std::move(theirs)](
                                   RequestId id, std::int32_t token,
                                   const GeneratedLogprobs* logprobs) {
    own(id, token, logprobs);
    if (theirs) theirs(id, token, logprobs);
  };
  return options;
}

// What a submission adds to a load before the engine has taken it.
void add_submission(ReplicaLoad& load, const Submission& r) {
  const auto prompt = static_cast<std::int64_t>(r.prompt.size());
  ++load.waiting;
  load.queued_tokens += prompt + r.output_tokens;
  load.queued_prefill_tokens += prompt;
}

}  // namespace

LiveEngine::LiveEngine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler,
                       EngineOptions options, LiveOptions live)
    : engine_(backend, allocator, scheduler,
              live_options(
                  std::move(options), live.paced,
                  [this](RequestId id, std::int32_t token, const GeneratedLogprobs* logprobs) {
                    view_tokens_.emplace_back(id, engine_.now());
                    const auto it = in_flight_.find(id);
                    if (it != in_flight_.end() && it->second.on_token)
                      it->second.on_token(token, logprobs);
                  },
                  this)),
      live_(live) {
  engine_.start(none_);
  load_ = engine_.load();
  clock_start_ = std::chrono::steady_clock::now();
  thread_ = std::thread([this] { loop(); });
}

LiveEngine::~LiveEngine() {
  (void)shutdown(false);
}

SubmitResult LiveEngine::submit(Submission request, LiveCallbacks callbacks) {
  return enqueue({std::move(request), std::move(callbacks), {}, std::nullopt, {}}, true);
}

SubmitResult LiveEngine::submit_for_prefill(Submission request, LiveCallbacks callbacks,
                                            HandoffCallback on_handoff) {
  return enqueue(
      {std::move(request), std::move(callbacks), {}, std::nullopt, std::move(on_handoff)}, true);
}

SubmitResult LiveEngine::submit_with_kv(Submission request, KvHandoff handoff,
                                        LiveCallbacks callbacks, bool cancelled) {
  return enqueue({std::move(request), std::move(callbacks), {}, std::move(handoff), {}}, false,
                 cancelled);
}

// A submission, given the next id and its arrival time now; `limited`: refused when the queue
// is full; `cancelled`: its cancel taken with it (the engine thread admits, then cancels).
SubmitResult LiveEngine::enqueue(Pending pending, bool limited, bool cancelled) {
  std::lock_guard lock(mutex_);
  if (stopping_) return {SubmitStatus::shutting_down, -1, {}};
  if (limited &&
      waiting_in_engine_ + static_cast<std::int64_t>(pending_.size()) >= live_.max_queued)
    return {SubmitStatus::queue_full, -1, {}};
  pending.request.id = next_id_++;
  pending.submitted = std::chrono::steady_clock::now();
  if (cancelled) cancels_.push_back(pending.request.id);
  pending_.push_back(std::move(pending));
  wake_.notify_one();
  return {SubmitStatus::accepted, pending_.back().request.id, {}};
}

void LiveEngine::cancel(RequestId id) {
  std::lock_guard lock(mutex_);
  if (id < 0 || id >= next_id_) return;
  cancels_.push_back(id);
  wake_.notify_one();
}

ShutdownReport LiveEngine::shutdown(bool drain) {
  {
    std::lock_guard lock(mutex_);
    if (!stopping_) {
      stopping_ = true;
      drain_ = drain;
    }
    wake_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mutex_);
  return std::exchange(report_, {});
}

EngineResult LiveEngine::take_result() {
  {
    std::lock_guard lock(mutex_);
    if (!ended_) throw Error("LiveEngine::take_result() before shutdown()");
  }
  return engine_.take_result();
}

LiveStats LiveEngine::stats() const {
  std::lock_guard lock(mutex_);
  LiveStats stats = stats_;
  stats.queued = static_cast<std::int64_t>(pending_.size());
  return stats;
}

ReplicaLoad LiveEngine::load() const {
  std::lock_guard lock(mutex_);
  ReplicaLoad load = load_;
  for (const Pending& p : pending_) add_submission(load, p.request);
  return load;
}

std::string LiveEngine::fault() const {
  std::lock_guard lock(mutex_);
  return fault_;
}

// The engine thread: take what clients sent, step while there is work, sleep when there is none;
// at a shutdown, drain or abort what is in flight, then end.
void LiveEngine::loop() {
  std::vector<Pending> arrivals;
  std::vector<RequestId> cancels;
  try {
    while (take_work(arrivals, cancels)) {
      admit(arrivals);
      for (const RequestId id : cancels) engine_.cancel(id);
      const std::size_t steps_before = engine_.steps().size();
      if (engine_.has_work()) (void)engine_.step();
      report_handoffs();
      report_ends();
      update_stats(steps_before);
    }
  } catch (const std::exception& e) {  // an engine-level fault: every request still ends
    std::lock_guard lock(mutex_);
    fault_ = e.what();
  }
  finish_shutdown();
}

// Moves the clients' submissions and cancellations out; waits while there is nothing to do.
// False when the loop should end: stopping, and (draining) nothing in flight.
bool LiveEngine::take_work(std::vector<Pending>& arrivals, std::vector<RequestId>& cancels) {
  std::unique_lock lock(mutex_);
  const auto idle = [&] { return pending_.empty() && cancels_.empty() && !engine_.has_work(); };
  if (idle() && !stopping_)
    wake_.wait_for(lock, std::chrono::duration<double>(live_.idle_wait_s),
                   [&] { return !idle() || stopping_; });
  if (stopping_ && !drain_) {  // abort: what is in flight is cancelled by finish_shutdown
    arrivals.clear();
    cancels.clear();
    return false;
  }
  arrivals = std::move(pending_);
  pending_.clear();
  waiting_in_engine_ += static_cast<std::int64_t>(arrivals.size());    // queued there from now on
  for (const Pending& p : arrivals) add_submission(load_, p.request);  // until the step's end
  cancels = std::move(cancels_);
  cancels_.clear();
  return !(stopping_ && arrivals.empty() && cancels.empty() && !engine_.has_work());
}

// Submissions reach the engine in id order (the engine's ids are the same), arrived when they
// were submitted: during the step that just ended, or the idle wait.
void LiveEngine::admit(std::vector<Pending>& arrivals) {
  for (Pending& p : arrivals) {
    const double submitted = std::chrono::duration<double>(p.submitted - clock_start_).count();
    p.request.arrival_s = std::max(submitted, 0.0);
    const Submission& stored = requests_.emplace_back(std::move(p.request));
    view_arrivals_.push_back(&stored);  // a deque: the address stays
    const RequestId id = p.handoff      ? engine_.submit_with_kv(stored, std::move(*p.handoff))
                         : p.on_handoff ? engine_.submit_for_prefill(stored)
                                        : engine_.submit(stored);
    if (id != stored.id)
      throw Error(fmt::format("internal: live request {} became engine request {}", stored.id, id));
    in_flight_.emplace(id, std::move(p.callbacks));
    if (p.on_handoff) handoff_to_.emplace(id, std::move(p.on_handoff));
  }
  arrivals.clear();
}

// The counters after a step (and its queue length, which submit() reads).
void LiveEngine::update_stats(std::size_t steps_before) {
  const std::vector<StepRecord>& steps = engine_.steps();
  const ReplicaLoad load = engine_.load();
  std::lock_guard lock(mutex_);
  waiting_in_engine_ = load.waiting;
  load_ = load;
  for (std::size_t i = steps_before; i < steps.size(); ++i) {
    const StepRecord& s = steps[i];
    ++stats_.steps;
    stats_.prefill_tokens += s.prefill_tokens;
    stats_.decode_tokens += s.decode_tokens;
    stats_.preemptions += s.preempted;
    stats_.swap_bytes += s.swap_bytes;
    stats_.waiting = s.waiting;
    stats_.running = s.running;
    stats_.kv = s.kv;
  }
  // Now, not as of the last step record: a step that only applied cancels records none.
  stats_.waiting = load.waiting;
  stats_.running = load.running;
  stats_.kv.used = load.kv_used;
  stats_.kv.capacity = load.kv_capacity;
  update_view(steps_before);
}

// (Under the lock.) The view's feed gets the loop turn's arrivals, steps, events (which move the
// requests' lanes), tokens and frame.
void LiveEngine::update_view(std::size_t steps_before) {
  for (const Submission* r : view_arrivals_) view_.arrived(*r);
  view_arrivals_.clear();
  view_.add_steps(std::span(engine_.steps()).subspan(steps_before));
  const std::vector<EngineEvent>& events = engine_.events();
  view_.add_events(std::span(events).subspan(view_events_seen_));
  view_events_seen_ = events.size();
  for (const auto& [id, t] : view_tokens_) view_.token(id, t);
  view_tokens_.clear();
  if (view_frame_) view_.add_frame(*view_frame_);
  view_frame_.reset();
}

// A pool frame for the view about ten times a second, not every step: a frame costs O(blocks).
bool LiveEngine::wants_frame() {
  const auto now = std::chrono::steady_clock::now();
  if (now - last_frame_ < std::chrono::milliseconds(100)) return false;
  last_frame_ = now;
  return true;
}

void LiveEngine::on_frame(StepFrame frame) {
  view_frame_ = std::move(frame);
}

std::string LiveEngine::view_json(const std::string& name, LiveViewDetail detail) const {
  std::lock_guard lock(mutex_);
  return view_.json_text(name, detail);
}

// Each request the last step prefilled for another engine hands its KV to its on_handoff, and
// leaves this engine's requests in flight (its finish here, "handoff", is not an end).
void LiveEngine::report_handoffs() {
  for (KvHandoff& handoff : engine_.take_handoffs()) {
    const auto it = handoff_to_.find(handoff.id);
    if (it == handoff_to_.end()) continue;
    HandoffCallback to = std::move(it->second);
    handoff_to_.erase(it);
    in_flight_.erase(handoff.id);
    {
      std::lock_guard lock(mutex_);
      ++stats_.handed_off;
    }
    to(std::move(handoff));
  }
}

// Each request the last step ended (finished, cancelled or rejected) gets its on_done, once.
void LiveEngine::report_ends() {
  const std::vector<EngineEvent>& events = engine_.events();
  for (; events_seen_ < events.size(); ++events_seen_) {
    const EngineEvent& e = events[events_seen_];
    if (e.kind != EventKind::event_finish && e.kind != EventKind::event_reject) continue;
    const auto it = in_flight_.find(e.request);
    if (it == in_flight_.end()) continue;
    LiveOutcome outcome;
    outcome.id = e.request;
    if (e.kind == EventKind::event_reject) {
      outcome.rejected = true;
      outcome.reject_reason = e.reason;
    } else {
      outcome.finish_reason = e.reason;
    }
    LiveCallbacks callbacks = std::move(it->second);
    in_flight_.erase(it);
    handoff_to_.erase(e.request);  // a prefill-only request that ended here: no handoff now
    {
      std::lock_guard lock(mutex_);
      ++(outcome.rejected                       ? stats_.rejected
         : outcome.finish_reason == "cancelled" ? stats_.cancelled
                                                : stats_.finished);
      if (stopping_ && !outcome.rejected)
        ++(outcome.finish_reason == "cancelled" ? report_.aborted : report_.drained);
    }
    if (callbacks.on_done) callbacks.on_done(outcome);
  }
}

// The loop has ended: an abort cancels what is in flight (submissions not yet admitted included,
// so they are in the record too) and lets the engine apply it; after a fault every request still
// in flight ends rejected with the fault. Then no request is left without its on_done.
void LiveEngine::finish_shutdown() {
  std::vector<Pending> arrivals;
  std::string fault;
  {
    std::lock_guard lock(mutex_);
    arrivals = std::move(pending_);
    pending_.clear();
    stopping_ = true;
    fault = fault_;
  }
  if (fault.empty()) {
    try {
      admit(arrivals);
      for (const auto& [id, callbacks] : in_flight_) engine_.cancel(id);
      while (engine_.has_work() && engine_.step()) {
      }
      report_handoffs();
      report_ends();
    } catch (const std::exception& e) {
      fault = e.what();
    }
  }
  for (Pending& p : arrivals)  // a fault before they were admitted
    if (p.callbacks.on_done)
      p.callbacks.on_done({p.request.id, {}, true, "engine fault: " + fault});
  for (auto& [id, callbacks] : in_flight_)
    if (callbacks.on_done) callbacks.on_done({id, {}, true, "engine fault: " + fault});
  in_flight_.clear();
  handoff_to_.clear();
  std::lock_guard lock(mutex_);
  if (!fault.empty()) fault_ = fault;
  ended_ = true;
}

}  // namespace kvlab
