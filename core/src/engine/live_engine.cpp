#include "kvlab/engine/live_engine.hpp"

#include <fmt/format.h>

#include <chrono>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

EngineOptions live_options(EngineOptions options,
                           std::function<void(RequestId, std::int32_t)> own) {
  options.clock = EngineClock::wall;
  std::function<void(RequestId, std::int32_t)> theirs = std::move(options.observers.on_token);
  options.observers.on_token = [own = std::move(own), theirs = std::move(theirs)](
                                   RequestId id, std::int32_t token) {
    own(id, token);
    if (theirs) theirs(id, token);
  };
  return options;
}

}  // namespace

LiveEngine::LiveEngine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler,
                       EngineOptions options, LiveOptions live)
    : engine_(backend, allocator, scheduler,
              live_options(std::move(options),
                           [this](RequestId id, std::int32_t token) {
                             const auto it = in_flight_.find(id);
                             if (it != in_flight_.end() && it->second.on_token)
                               it->second.on_token(token);
                           })),
      live_(live) {
  engine_.start(none_);
  thread_ = std::thread([this] { loop(); });
}

LiveEngine::~LiveEngine() {
  (void)shutdown(false);
}

SubmitResult LiveEngine::submit(WorkloadRequest request, LiveCallbacks callbacks) {
  std::lock_guard lock(mutex_);
  if (stopping_) return {SubmitStatus::shutting_down, -1};
  if (waiting_in_engine_ + static_cast<std::int64_t>(pending_.size()) >= live_.max_queued)
    return {SubmitStatus::queue_full, -1};
  request.id = next_id_++;
  pending_.push_back({std::move(request), std::move(callbacks)});
  wake_.notify_one();
  return {SubmitStatus::accepted, pending_.back().request.id};
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
      if (engine_.has_work()) (void)engine_.step();
      report_ends();
      std::lock_guard lock(mutex_);
      waiting_in_engine_ = engine_.load().waiting;
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
  waiting_in_engine_ += static_cast<std::int64_t>(arrivals.size());  // queued there from now on
  cancels = std::move(cancels_);
  cancels_.clear();
  return !(stopping_ && arrivals.empty() && cancels.empty() && !engine_.has_work());
}

// Submissions reach the engine arriving now, in id order (the engine's ids are the same).
void LiveEngine::admit(std::vector<Pending>& arrivals) {
  for (Pending& p : arrivals) {
    p.request.arrival_s = engine_.now();
    const WorkloadRequest& stored = requests_.emplace_back(std::move(p.request));
    const RequestId id = engine_.submit(stored);
    if (id != stored.id)
      throw Error(fmt::format("internal: live request {} became engine request {}", stored.id, id));
    in_flight_.emplace(id, std::move(p.callbacks));
  }
  arrivals.clear();
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
    {
      std::lock_guard lock(mutex_);
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
  std::lock_guard lock(mutex_);
  if (!fault.empty()) fault_ = fault;
  ended_ = true;
}

}  // namespace kvlab
