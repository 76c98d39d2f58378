#pragma once
// The engine's clock, a strategy: when requests arrive, how long a step lasts, what idling does.
//   virtual   a step lasts the cost model's price of it (a hardware profile's roofline) plus
//             its swap and KV tier copies over the profile's links: reproducible to the byte
//   offline   every request arrives at t = 0, then as virtual
//   measured  a step lasts what Backend::forward and the swap copies really took: a real
//             backend's timeline without sleeping through idle gaps
//   wall      arrivals replayed in real time; time passes as it really does (not reproducible)
//   steps     every step lasts 1: time counts engine steps (arrivals at a given step; for
//             tools and tests that need an order of events, not a duration)
//   paced     real time, but a step lasts at least the virtual clock's price of it (the engine
//             thread sleeps until then; the steps keep to that schedule through the host's
//             hiccups and late wake-ups, up to 50 ms behind): a simulated backend answering live
//             clients as fast as the hardware profile says (kvlab serve; not an experiment
//             file's clock)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

namespace kvlab {

enum class EngineClock { virtual_clock, offline, wall, measured, steps, paced };

// "virtual", "offline", "wall", "measured", "steps" (experiment files and summary.json), and
// "paced" (clock_name only: clock_from_name does not take it).
const char* clock_name(EngineClock clock);
std::optional<EngineClock> clock_from_name(std::string_view name);

// What a step cost, for the clock to price.
struct StepTiming {
  double predicted_s = 0;            // the cost model's price of the step (virtual clocks)
  double measured_forward_s = 0;     // what Backend::forward really took (measured clock)
  double modelled_swap_s = 0;        // host <-> device KV copies over the profile's link
  double measured_swap_s = 0;        // the same copies as they really took here
  double modelled_tier_s = 0;        // KV tier copies (host, disk) over the profile's links
  double measured_tier_s = 0;        // the same copies as they really took here
  bool tier_copies_overlap = false;  // the profile's: tier copies run beside the compute
  // Speculative decoding's proposals before the step: the proposer's time here, and the draft
  // model's steps as the cost model prices them (0 without a draft).
  double measured_propose_s = 0;
  double modelled_propose_s = 0;
  // The virtual clock's step: the compute and the tier copies (the longer of the two when they
  // overlap, else both), then the swap copies.
  double virtual_step_s() const;
};

class Clock {
 public:
  virtual ~Clock() = default;
  double now() const { return now_; }
  // Every request arrives at t = 0, whatever its arrival_s (the offline clock).
  virtual bool all_arrive_at_zero() const { return false; }
  // Nothing waits or runs: time moves to the next arrival (the wall clock sleeps until then).
  virtual void idle_until(double arrival_s) { now_ = arrival_s; }
  // Before a step: a real-time clock that was left idle (a live engine waiting for requests)
  // moves to the present; the others stay. `next_arrival`: the earliest request not yet
  // received, if any (the paced clock starts the step at its arrival when it woke just after);
  // `busy`: requests waited or ran after the last step (no idle time passed since it).
  virtual void catch_up(std::optional<double> next_arrival, bool busy) {
    (void)next_arrival;
    (void)busy;
  }
  // A step ran nothing (everyone waits for memory): time moves to the next arrival, if later.
  void skip_to(double arrival_s) { now_ = std::max(now_, arrival_s); }
  // A step that started at now() ran: advances now() and returns the step's duration.
  virtual double advance(const StepTiming& cost) = 0;

 protected:
  double now_ = 0;
};

std::unique_ptr<Clock> make_clock(EngineClock kind);

}  // namespace kvlab
