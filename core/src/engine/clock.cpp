#include "kvlab/engine/clock.hpp"

#include <algorithm>
#include <thread>

namespace kvlab {

double StepTiming::virtual_step_s() const {
  const double compute =
      tier_copies_overlap ? std::max(predicted_s, modelled_tier_s) : predicted_s + modelled_tier_s;
  return modelled_propose_s + compute + modelled_swap_s;
}

namespace {

// A step lasts the cost model's price of it.
class VirtualClock : public Clock {
 public:
  explicit VirtualClock(bool arrivals_at_zero) : arrivals_at_zero_(arrivals_at_zero) {}
  bool all_arrive_at_zero() const override { return arrivals_at_zero_; }
  double advance(const StepTiming& cost) override {
    const double duration = cost.virtual_step_s();
    now_ += duration;
    return duration;
  }

 private:
  bool arrivals_at_zero_;
};

// A step lasts what the proposer, the backend, the swap copies and the KV tier copies really
// took (the cpu backend's copies run on the cores that compute, one after the other).
class MeasuredClock : public Clock {
 public:
  double advance(const StepTiming& cost) override {
    const double duration = cost.measured_propose_s + cost.measured_forward_s +
                            cost.measured_swap_s + cost.measured_tier_s;
    now_ += duration;
    return duration;
  }
};

// Each step lasts 1.
class StepCountingClock : public Clock {
 public:
  double advance(const StepTiming&) override {
    now_ += 1;
    return 1;
  }
};

// Real time since the run started; idling sleeps until the next arrival.
class WallClock : public Clock {
 public:
  void idle_until(double arrival_s) override {
    std::this_thread::sleep_until(start_ + std::chrono::duration<double>(arrival_s));
    now_ = elapsed();
  }
  void catch_up(std::optional<double>, bool) override { now_ = std::max(now_, elapsed()); }
  double advance(const StepTiming&) override {
    const double started = now_;
    now_ = elapsed();
    return now_ - started;
  }

 protected:
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Real time, each step lasting at least its price: the engine sleeps until the step's scheduled
// end and records that end, so the sleep's overshoot (tens of microseconds, more on a busy
// machine) is not added to every step. The simulated hardware keeps its schedule through the
// host's hiccups: a step the host finishes late (another thread had the core) still ends on
// schedule, and the steps after it run without sleeping until the schedule is caught up (a
// simulated step's own work takes microseconds). Only a host more than kMostLag behind cannot
// keep the hardware's pace: then time follows the host.
// Likewise a step that an arrival starts (the engine idle) starts at that arrival, not when the
// engine thread woke to it: the simulated hardware has no wake-up.
class PacedClock : public WallClock {
 public:
  void catch_up(std::optional<double> next_arrival, bool busy) override {
    const double real = elapsed();
    if (busy) {  // steps back to back: no time passed idle
      if (real - now_ > kMostLag) now_ = real;
      return;
    }
    // Idle since now(): the step starts at the arrival that woke the engine thread, or (nothing
    // to receive: a cancel, an idle wait that timed out) at the present.
    const bool woken_by_it =
        next_arrival && *next_arrival <= real && real - *next_arrival <= kMostLag;
    now_ = std::max(now_, woken_by_it ? *next_arrival : real);
  }
  void idle_until(double arrival_s) override {
    WallClock::idle_until(arrival_s);
    if (now_ - arrival_s <= kMostLag) now_ = arrival_s;
  }
  double advance(const StepTiming& cost) override {
    const double started = now_;
    const double scheduled_end = started + cost.virtual_step_s();
    const double real = elapsed();
    if (real < scheduled_end)
      std::this_thread::sleep_until(start_ + std::chrono::duration<double>(scheduled_end));
    now_ = real - scheduled_end <= kMostLag ? scheduled_end : real;
    return now_ - started;
  }

  // How far behind its schedule the host may fall and still catch up (a few simulated steps;
  // on 2 busy cores a thread waits 5-20 ms for a core now and then).
  static constexpr double kMostLag = 0.05;
};

}  // namespace

const char* clock_name(EngineClock clock) {
  switch (clock) {
    case EngineClock::virtual_clock:
      return "virtual";
    case EngineClock::offline:
      return "offline";
    case EngineClock::wall:
      return "wall";
    case EngineClock::measured:
      return "measured";
    case EngineClock::steps:
      return "steps";
    case EngineClock::paced:
      return "paced";
  }
  return "?";
}

std::optional<EngineClock> clock_from_name(std::string_view name) {
  for (const EngineClock c : {EngineClock::virtual_clock, EngineClock::offline, EngineClock::wall,
                              EngineClock::measured, EngineClock::steps})
    if (name == clock_name(c)) return c;
  return std::nullopt;
}

std::unique_ptr<Clock> make_clock(EngineClock kind) {
  switch (kind) {
    case EngineClock::offline:
      return std::make_unique<VirtualClock>(true);
    case EngineClock::measured:
      return std::make_unique<MeasuredClock>();
    case EngineClock::wall:
      return std::make_unique<WallClock>();
    case EngineClock::steps:
      return std::make_unique<StepCountingClock>();
    case EngineClock::paced:
      return std::make_unique<PacedClock>();
    case EngineClock::virtual_clock:
      break;
  }
  return std::make_unique<VirtualClock>(false);
}

}  // namespace kvlab
