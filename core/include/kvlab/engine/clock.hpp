#pragma once
// The engine's clock, a strategy: when requests arrive, how long a step lasts, what idling does.
//   virtual   a step lasts its modelled duration (time model, or a cost model's prediction):
//             reproducible to the byte
//   offline   every request arrives at t = 0, then as virtual
//   measured  a step lasts what Backend::forward really took (+ the modelled swap copies): a
//             real backend's timeline without sleeping through idle gaps
//   wall      arrivals replayed in real time; time passes as it really does (not reproducible)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

#include "kvlab/backend.hpp"

namespace kvlab {

enum class EngineClock { virtual_clock, offline, wall, measured };

// The virtual clock's step-time model (seconds), when no cost model predicts steps.
struct StepTimeModel {
  double step_overhead_s = 2e-3;
  double prefill_token_s = 2e-4;
  double decode_token_s = 1e-3;
  double kv_token_read_s = 0;  // per cached token attended to
};

// What a step did, for the clock to price.
struct StepTiming {
  std::span<const BatchEntry> batch;
  std::int64_t prefill_tokens = 0, decode_tokens = 0;
  double measured_forward_s = 0;
  const double* predicted_s = nullptr;  // the cost model's prediction, when there is one
  double swap_s = 0;                    // host <-> device KV copies
};

class Clock {
 public:
  virtual ~Clock() = default;
  double now() const { return now_; }
  // Every request arrives at t = 0, whatever its arrival_s (the offline clock).
  virtual bool all_arrive_at_zero() const { return false; }
  // Nothing waits or runs: time moves to the next arrival (the wall clock sleeps until then).
  virtual void idle_until(double arrival_s) { now_ = arrival_s; }
  // A step ran nothing (everyone waits for memory): time moves to the next arrival, if later.
  void skip_to(double arrival_s) { now_ = std::max(now_, arrival_s); }
  // A step that started at now() ran: advances now() and returns the step's duration.
  virtual double advance(const StepTiming& cost) = 0;

 protected:
  double now_ = 0;
};

std::unique_ptr<Clock> make_clock(EngineClock kind, const StepTimeModel& model);

}  // namespace kvlab
