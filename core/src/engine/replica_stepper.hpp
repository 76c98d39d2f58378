#pragma once
// Steps a cluster's replicas up to a time on several threads. Between two routings the replicas
// share nothing (each has its own backend, allocator, scheduler and clock), so stepping them at
// once, in any order, gives the very runs that stepping them one at a time does.
#include <atomic>
#include <exception>
#include <span>
#include <thread>
#include <vector>

namespace kvlab {

class Engine;

class ReplicaStepper {
 public:
  // `threads` (the calling one included) at most; 1: everything on the calling thread.
  ReplicaStepper(std::span<Engine* const> replicas, int threads);
  ~ReplicaStepper();
  ReplicaStepper(const ReplicaStepper&) = delete;
  ReplicaStepper& operator=(const ReplicaStepper&) = delete;

  // Steps each replica with work until its clock reaches `time` or its work runs out. Rethrows
  // the error of the first replica (in order) whose step threw.
  void advance_to(double time);

 private:
  void work();         // takes replicas until none is left
  void helper_loop();  // a helper thread: one work() a round
  bool behind(const Engine& e) const;

  std::span<Engine* const> replicas_;
  double target_ = 0;                       // written before a round starts
  std::atomic<std::size_t> next_{0};        // the next replica to take this round
  std::vector<std::exception_ptr> errors_;  // per replica, this round
  // A round starts when round_ changes and ends when no helper is left in it. Rounds come
  // thousands of times a second in a trace replay: both sides spin a while before they sleep,
  // since waking a sleeping thread costs more than the rounds' work.
  std::atomic<int> round_{0}, helpers_in_round_{0};
  std::atomic<bool> stopping_{false};
  std::vector<std::jthread> helpers_;
};

}  // namespace kvlab
