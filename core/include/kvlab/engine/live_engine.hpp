#pragma once
// The engine under live traffic (issue 39's server loop, without the HTTP): requests come from any
// thread while steps run on the engine's own thread, on the wall clock. Each request streams its
// tokens to its callbacks and ends exactly once (finished, cancelled or rejected with the reason);
// a bounded queue refuses what it cannot hold instead of growing; shutdown drains or aborts what
// is in flight and says how many. The run's record (EngineResult) is a `kvlab run`'s: every
// request in it, in submission order.
//
//   client threads: submit(request, callbacks) -> id | queue_full | shutting_down; cancel(id)
//   engine thread:  submissions -> Engine::submit (arrived when submitted), cancels -> cancel,
//                   Engine::step(), each token -> on_token, each end -> on_done
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvlab/engine/engine.hpp"
#include "kvlab/engine/live_view.hpp"
#include "kvlab/router.hpp"

namespace kvlab {

// How a request ended: finish_reason "eos" | "max_tokens" | "context_full" | "cancelled", or
// rejected with the engine's reason (it can never fit the context or the pool).
struct LiveOutcome {
  RequestId id = -1;
  std::string finish_reason;
  bool rejected = false;
  std::string reject_reason;
};

// Called on the engine thread, never under the live engine's lock (a callback may cancel()).
struct LiveCallbacks {
  // Each token as it is chosen, with its log-probabilities when the request's sampling asks for
  // them (else nullptr; valid during the call only).
  std::function<void(std::int32_t, const GeneratedLogprobs*)> on_token;
  std::function<void(const LiveOutcome&)> on_done;  // once, last
};

// Where a request only prefilled here hands its KV (on the engine thread, once).
using HandoffCallback = std::function<void(KvHandoff&&)>;

// failed: nothing could take it (a cluster's router failed; `reason` says how).
enum class SubmitStatus { accepted, queue_full, shutting_down, failed };
struct SubmitResult {
  SubmitStatus status = SubmitStatus::accepted;
  RequestId id = -1;  // accepted: the engine's id (submission order)
  std::string reason;
};

struct LiveOptions {
  // Requests accepted but not yet admitted (still to reach the engine, or waiting in it) that
  // the queue holds; one more is refused (queue_full: a server's 429).
  std::int64_t max_queued = 256;
  // How long the engine thread sleeps when there is nothing to do, before looking again (a
  // submission wakes it at once).
  double idle_wait_s = 0.05;
  // The paced clock instead of the wall clock: each step lasts at least the cost model's price
  // of it (a simulated backend answering as fast as its hardware profile; needs a cost model).
  bool paced = false;
};

// The engine for a server's /metrics: queue lengths and KV use as of the latest loop turn, the
// rest as the last step record left them (counts cumulative since the start).
struct LiveStats {
  std::int64_t steps = 0;
  std::int64_t queued = 0;   // accepted, not yet taken by the engine thread
  std::int64_t waiting = 0;  // in the engine's queue (swapped-out requests included)
  std::int64_t running = 0;
  std::int64_t prefill_tokens = 0, decode_tokens = 0, preemptions = 0, swap_bytes = 0;
  std::int64_t finished = 0, cancelled = 0, rejected = 0;
  std::int64_t handed_off = 0;  // prefilled here, their KV handed to a decode engine
  KvAllocatorStats kv;          // after the last step (prefix and tier counters are cumulative)
};

struct ShutdownReport {
  std::int64_t drained = 0;  // in flight at the shutdown and finished since
  std::int64_t aborted = 0;  // in flight at the shutdown and cancelled by it
};

class LiveEngine : private FrameObserver {
 public:
  // The engine's parts, as Engine takes them; the clock is the wall clock whatever `options`
  // says, and options.observers.on_token is chained after the live engine's own. Starts the
  // engine thread.
  LiveEngine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler, EngineOptions options,
             LiveOptions live = {});
  ~LiveEngine();  // an abort shutdown, if none was asked
  LiveEngine(const LiveEngine&) = delete;
  LiveEngine& operator=(const LiveEngine&) = delete;

  // Any thread. The request arrives now (its arrival_s is this call's time on the engine's
  // clock, so a step under way counts in its TTFT) and its id is given now; its callbacks are
  // called on the engine thread.
  SubmitResult submit(Submission request, LiveCallbacks callbacks);
  // Any thread: a request only prefilled here (disaggregated prefill and decode). When its first
  // token is out and did not end it, its KV goes to `on_handoff` instead of an on_done: the
  // request goes on elsewhere (submit_with_kv). Its first token streams to callbacks.on_token.
  SubmitResult submit_for_prefill(Submission request, LiveCallbacks callbacks,
                                  HandoffCallback on_handoff);
  // Any thread: a request whose prompt and first tokens another engine computed, arriving now
  // with their KV (`handoff`, from that engine's on_handoff). Its queue limit does not apply: it
  // was accepted where it started.
  // `cancelled`: its client already went; it arrives and ends cancelled before any step, so the
  // record has it and its KV is freed.
  SubmitResult submit_with_kv(Submission request, KvHandoff handoff, LiveCallbacks callbacks,
                              bool cancelled = false);
  // Any thread: the request's client went away. Nothing for an id that ended or was never given.
  void cancel(RequestId id);
  // Stops taking requests; `drain`: the ones in flight run to their end, else they are
  // cancelled. Returns when the engine thread has ended (once; later calls report zeros).
  ShutdownReport shutdown(bool drain);
  // After shutdown: the run's record. Throws kvlab::Error before it.
  EngineResult take_result();
  // Any thread: the counters (LiveStats says as of when).
  LiveStats stats() const;
  // Any thread: this engine as a router sees it now: the engine's load after its latest loop
  // turn, with what clients submitted since counted as waiting (prompt and output tokens to go).
  ReplicaLoad load() const;
  // An engine-level fault that ended the loop (a scheduler that stalls, NaN logits), or "".
  std::string fault() const;
  // Any thread: the latest steps, events, requests and pool frames (about 10 a second) as one
  // run of kvlab view's data (kvlab/engine/live_view.hpp), named `name`, in `detail`.
  std::string view_json(const std::string& name, LiveViewDetail detail) const;

 private:
  struct Pending {
    Submission request;
    LiveCallbacks callbacks;
    std::chrono::steady_clock::time_point submitted;  // its arrival, whenever the engine takes it
    std::optional<KvHandoff> handoff;                 // submit_with_kv's
    HandoffCallback on_handoff;                       // submit_for_prefill's
  };
  SubmitResult enqueue(Pending pending, bool limited, bool cancelled = false);
  void loop();
  bool take_work(std::vector<Pending>& arrivals, std::vector<RequestId>& cancels);
  void admit(std::vector<Pending>& arrivals);
  void report_handoffs();
  void report_ends();
  void finish_shutdown();
  void update_stats(std::size_t steps_before);
  void update_view(std::size_t steps_before);
  bool wants_frame() override;
  void on_frame(StepFrame frame) override;

  Engine engine_;
  LiveOptions live_;
  std::vector<Submission> none_;                  // Engine::start's (empty) list
  std::deque<Submission> requests_;               // every submitted request: they outlive the run
  std::map<RequestId, LiveCallbacks> in_flight_;  // engine thread only
  std::map<RequestId, HandoffCallback> handoff_to_;  // engine thread only: prefill-only requests
  std::size_t events_seen_ = 0;                      // engine thread only
  // Engine thread only, for the view: what arrived, the tokens' times, the latest frame.
  std::vector<const Submission*> view_arrivals_;
  std::vector<std::pair<RequestId, double>> view_tokens_;
  std::optional<StepFrame> view_frame_;
  std::size_t view_events_seen_ = 0;
  std::chrono::steady_clock::time_point last_frame_{};
  std::chrono::steady_clock::time_point clock_start_;  // the engine clock's 0, about

  mutable std::mutex mutex_;  // guards what follows
  std::condition_variable wake_;
  std::vector<Pending> pending_;
  std::vector<RequestId> cancels_;
  RequestId next_id_ = 0;
  std::int64_t waiting_in_engine_ = 0;  // after the last step
  bool stopping_ = false, drain_ = true, ended_ = false;
  ShutdownReport report_;
  LiveStats stats_;
  ReplicaLoad load_;  // as of the latest loop turn, plus what was taken since
  std::string fault_;
  LiveViewFeed view_;

  std::thread thread_;  // last: started once everything above exists
};

}  // namespace kvlab
