#include "replica_stepper.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

#include "kvlab/engine/engine.hpp"

namespace kvlab {

namespace {

// Waits until value != `from` (spinning first for about kSpin, then sleeping); returns it.
int wait_for_change(const std::atomic<int>& value, int from) {
  constexpr auto kSpin = std::chrono::microseconds(200);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (const int now = value.load(std::memory_order_acquire); now != from) return now;
    if (i % 64 == 0 && std::chrono::steady_clock::now() - start > kSpin) break;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  while (true) {
    value.wait(from, std::memory_order_acquire);
    if (const int now = value.load(std::memory_order_acquire); now != from) return now;
  }
}

}  // namespace

ReplicaStepper::ReplicaStepper(std::span<Engine* const> replicas, int threads)
    : replicas_(replicas), errors_(replicas.size()) {
  const auto total =
      std::clamp<std::size_t>(static_cast<std::size_t>(std::max(threads, 1)), 1, replicas.size());
  for (std::size_t t = 1; t < total; ++t) helpers_.emplace_back([this] { helper_loop(); });
}

ReplicaStepper::~ReplicaStepper() {
  stopping_.store(true, std::memory_order_release);
  round_.fetch_add(1, std::memory_order_release);
  round_.notify_all();
}  // the helpers are joined here

bool ReplicaStepper::behind(const Engine& e) const {
  return e.has_work() && e.now() < target_;
}

void ReplicaStepper::advance_to(double time) {
  target_ = time;
  const auto busy = std::count_if(replicas_.begin(), replicas_.end(),
                                  [&](const Engine* e) { return behind(*e); });
  if (busy == 0) return;
  next_.store(0, std::memory_order_relaxed);
  if (helpers_.empty() || busy == 1) {  // not worth a round
    work();
  } else {
    helpers_in_round_.store(static_cast<int>(helpers_.size()), std::memory_order_relaxed);
    round_.fetch_add(1, std::memory_order_release);
    round_.notify_all();
    work();
    for (int left = helpers_in_round_.load(std::memory_order_acquire); left != 0;)
      left = wait_for_change(helpers_in_round_, left);
  }
  std::exception_ptr first;
  for (std::exception_ptr& error : errors_) {
    if (!first) first = std::exchange(error, nullptr);
    error = nullptr;
  }
  if (first) std::rethrow_exception(first);
}

void ReplicaStepper::work() {
  for (std::size_t i = next_++; i < replicas_.size(); i = next_++) {
    Engine& e = *replicas_[i];
    try {
      while (behind(e)) (void)e.step();
    } catch (...) {
      errors_[i] = std::current_exception();
    }
  }
}

void ReplicaStepper::helper_loop() {
  // From round 0, the value before any round began: a helper that starts late still sees the
  // round already under way as new.
  for (int seen = 0;;) {
    seen = wait_for_change(round_, seen);
    if (stopping_.load(std::memory_order_acquire)) return;
    work();
    helpers_in_round_.fetch_sub(1, std::memory_order_acq_rel);
    helpers_in_round_.notify_one();
  }
}

}  // namespace kvlab
