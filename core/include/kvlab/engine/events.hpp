#pragma once
// The engine's decisions as typed events, serialised to JSON lines only at the edge
// (events.jsonl). One event per decision: admissions, deferrals (when the reason is news),
// preemptions, swaps, finishes, rejections, prefix-cache evictions.
#include <cstdint>
#include <string>
#include <vector>

#include "kvlab/request.hpp"

namespace kvlab {

enum class EventKind : std::uint8_t {
  event_admit,      // waiting -> running (reason: prefix-cache hit tokens, when any)
  event_defer,      // left waiting (reason: the scheduler's, or kv_full_at_apply)
  event_preempt,    // running -> waiting, KV freed (reason: why)
  event_swap_out,   // running -> swapped (reason: tokens=N)
  event_swap_full,  // a swap preemption fell back to recompute: the swap pool is full
  event_swap_in,    // swapped -> running (reason: tokens=N)
  event_finish,     // eos | max_tokens | context_full | handoff | cancelled (Engine::cancel)
  event_reject,     // can never run (reason)
  event_evict,      // cached prefix blocks reused for other data (blocks, no request)
  event_route,      // a cluster's router sent the request to a replica (reason: the router's)
};
const char* event_kind_name(EventKind kind);  // "admit", "defer", ...

struct EngineEvent {
  std::int64_t step = 0;
  double t = 0;  // the clock's time
  EventKind kind = EventKind::event_admit;
  RequestId request = -1;     // -1 for evict
  std::string reason;         // "" when there is none
  std::int64_t blocks = 0;    // evict only
  std::int64_t replica = -1;  // in a cluster: the replica it happened on; -1: one engine
  bool operator==(const EngineEvent&) const = default;
};

// {"event": ..., "request": ..., "reason": ..., "replica": ..., "step": ..., "t": ...} (keys
// sorted; replica only in a cluster).
std::string event_json(const EngineEvent& event);

// Collects events stamped with the current step and time.
class EventLog {
 public:
  void set_time(std::int64_t step, double t) {
    step_ = step;
    t_ = t;
  }
  void add(EventKind kind, RequestId request, std::string reason = {}) {
    events_.push_back({step_, t_, kind, request, std::move(reason), 0, -1});
  }
  void add_evictions(std::int64_t blocks) {
    events_.push_back({step_, t_, EventKind::event_evict, -1, {}, blocks, -1});
  }
  double time() const { return t_; }
  const std::vector<EngineEvent>& events() const { return events_; }
  std::vector<EngineEvent> take() { return std::move(events_); }

 private:
  std::int64_t step_ = 0;
  double t_ = 0;
  std::vector<EngineEvent> events_;
};

}  // namespace kvlab
