#include "kvlab/engine/clock.hpp"

#include <thread>

namespace kvlab {
namespace {

// A step lasts its modelled duration: the cost model's prediction when there is one, else the
// step-time model.
class VirtualClock : public Clock {
 public:
  VirtualClock(const StepTimeModel& model, bool arrivals_at_zero)
      : model_(model), arrivals_at_zero_(arrivals_at_zero) {}
  bool all_arrive_at_zero() const override { return arrivals_at_zero_; }
  double advance(const StepTiming& cost) override {
    const double duration = (cost.predicted_s ? *cost.predicted_s : modelled(cost)) + cost.swap_s;
    now_ += duration;
    return duration;
  }

 private:
  double modelled(const StepTiming& cost) const {
    std::int64_t kv_tokens_read = 0;
    for (const auto& e : cost.batch)
      kv_tokens_read += e.view.end_position() - e.view.first_position;
    return model_.step_overhead_s +
           model_.prefill_token_s * static_cast<double>(cost.prefill_tokens) +
           model_.decode_token_s * static_cast<double>(cost.decode_tokens) +
           model_.kv_token_read_s * static_cast<double>(kv_tokens_read);
  }
  StepTimeModel model_;
  bool arrivals_at_zero_;
};

// A step lasts what the backend really took, plus the modelled swap copies.
class MeasuredClock : public Clock {
 public:
  double advance(const StepTiming& cost) override {
    const double duration = cost.measured_forward_s + cost.swap_s;
    now_ += duration;
    return duration;
  }
};

// Real time since the run started; idling sleeps until the next arrival.
class WallClock : public Clock {
 public:
  void idle_until(double arrival_s) override {
    std::this_thread::sleep_until(start_ + std::chrono::duration<double>(arrival_s));
    now_ = elapsed();
  }
  double advance(const StepTiming&) override {
    const double started = now_;
    now_ = elapsed();
    return now_ - started;
  }

 private:
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

std::unique_ptr<Clock> make_clock(EngineClock kind, const StepTimeModel& model) {
  switch (kind) {
    case EngineClock::offline:
      return std::make_unique<VirtualClock>(model, true);
    case EngineClock::measured:
      return std::make_unique<MeasuredClock>();
    case EngineClock::wall:
      return std::make_unique<WallClock>();
    case EngineClock::virtual_clock:
      break;
  }
  return std::make_unique<VirtualClock>(model, false);
}

}  // namespace kvlab
