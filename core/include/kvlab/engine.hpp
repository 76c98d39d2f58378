#pragma once
// The engine: the step loop of a serving system.
//   1. plan   = Scheduler::schedule(queues, read-only allocator)
//   2. apply  = the allocator commits: preemptions free, admissions allocate (prefix hits),
//               decodes append a slot for their newest token
//   3. run    = Backend::forward over the mixed batch
//   4. sample = each request with its own seeded sampler
//   5. update = append tokens, stop conditions, free finished KV, metrics and event log
// Requests that can never fit (prompt + max tokens beyond the context or the KV capacity) are
// rejected with a reason at arrival: submitted = finished + rejected, always.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/cost_model.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/metrics.hpp"
#include "kvlab/scheduler.hpp"
#include "kvlab/workload.hpp"

namespace kvlab {

enum class EngineClock {
  virtual_clock,  // time advances by each step's modelled duration: reproducible to the byte
  offline,        // every request arrives at t = 0, then as virtual_clock
  wall,      // arrivals replayed in real time; time advances as it really passes (not reproducible)
  measured,  // as virtual_clock, but each step lasts what Backend::forward really took (+ the
             // modelled swap copies): a real backend's timeline without sleeping through idle
             // gaps, and what a cost model's predictions are validated against
};

// The virtual clock's step-time model (seconds); the measured forward time is recorded too.
struct StepTimeModel {
  double step_overhead_s = 2e-3;
  double prefill_token_s = 2e-4;
  double decode_token_s = 1e-3;
  double kv_token_read_s = 0;  // per cached token attended to by decodes
};

struct EngineOptions {
  EngineClock clock = EngineClock::virtual_clock;
  StepTimeModel time_model;
  // When set, the virtual clock's step time is this model's prediction instead of time_model's
  // (the simulated backend's device); with the measured clock it is recorded next to the
  // measured time (predicted_s) to validate a calibration.
  const CostModel* cost_model = nullptr;
  std::int64_t max_seq_len = 0;  // the model's context
  std::vector<std::int32_t> eos_token_ids;
  std::optional<std::int64_t> window;  // sliding-window attention: release older KV
  bool caches_kv = true;               // false: recompute every sequence every step
  std::int64_t max_idle_steps = 1000;  // steps without progress before giving up (a scheduler bug)
  // Swap preemption: KV moves to a host swap pool of `swap_slots` tokens over a link of
  // `swap_gb_per_s` (the copy time is added to the step on the virtual clock).
  KvPool* pool = nullptr;
  std::int64_t swap_slots = 0;
  double swap_gb_per_s = 16.0;
};

struct StepRecord {
  std::int64_t step = 0;
  double start_s = 0, duration_s = 0, measured_forward_s = 0;
  double measured_step_s = 0;  // plan + apply + forward, as it really took
  double predicted_s = 0;      // the cost model's prediction (0 without one)
  std::int64_t batch = 0, prefill_tokens = 0, decode_tokens = 0, preempted = 0;
  std::int64_t waiting = 0, running = 0;
  KvAllocatorStats kv;
};

struct EngineResult {
  std::vector<RequestTimeline> requests;          // in submission order
  std::vector<std::vector<std::int32_t>> tokens;  // generated tokens per request
  std::vector<StepRecord> steps;
  std::vector<std::string> events;  // JSONL: admit / defer / preempt / finish / reject
  double duration_s = 0;
};

class Engine {
 public:
  Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler, EngineOptions options);
  // Throws kvlab::Error only for engine-level faults (a scheduler that stalls); bad requests
  // are rejected and reported, never thrown.
  EngineResult run(const std::vector<WorkloadRequest>& requests);

 private:
  Backend& backend_;
  KvAllocator& allocator_;
  Scheduler& scheduler_;
  EngineOptions options_;
};

}  // namespace kvlab
