// The CPU backend's threads: a pool of its own in place of OpenMP's, so that a step stays fair on
// a shared machine (issue 67).
//
// libgomp's threads either spin at every join (fast on a quiet machine; on an oversubscribed one a
// region waits a whole scheduler slice for a descheduled thread, and every one of the ~200
// regions of a decode step does) or sleep (fair, but every region then pays a futex wake: 2.4x
// slower at batch 1). This pool differs in three ways, as ggml's does:
//   - a region's items are claimed in chunks from a shared counter: a thread that is not
//     running holds back at most the chunk it holds, and one that has not yet woken holds back
//     nothing: the region ends without it (threads join a region; the caller does not wait for
//     a thread that never joined);
//   - waits spin a short bound, then yield the processor, then (idle workers only) sleep on a
//     futex, so a waiting thread gives its core to the one it waits for;
//   - threads inside a region run BLAS single-threaded (their OpenMP ICV is 1), never nested.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace kvlab::cpu {

// One pause of a spin-wait (x86 PAUSE: lets the sibling hyperthread run, saves power).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

class ThreadPool {
 public:
  // `threads` counts the caller: threads - 1 workers are started (fewer if the system refuses
  // more threads: the pool runs with those it got).
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  int requested_threads() const { return requested_; }

  // Runs `job()` on the calling thread and on every worker that joins before the caller has
  // finished its own share; returns once each thread that joined has left `job`. `job` shares its
  // work out through shared_loop (below); it must not throw.
  template <class Job>
  void run(Job& job) {
    run_erased([](void* context) { (*static_cast<Job*>(context))(); }, &job);
  }

  // The shared counters of the loops of the region running now (a region holds at most
  // kMaxLoops loops, in the same order on every thread).
  static constexpr int kMaxLoops = 4;
  struct alignas(64) LoopCounter {
    std::atomic<std::int64_t> next{0};              // the first item not yet claimed
    alignas(64) std::atomic<std::int64_t> done{0};  // items finished
  };
  LoopCounter& loop(int ordinal);

 private:
  void run_erased(void (*job)(void*), void* context);
  void worker_main();
  bool try_join(std::uint64_t& seen_generation);

  int requested_ = 1;
  std::vector<std::thread> workers_;
  // generation << 32 | joined << 1 | closed: a region is open for joining until the caller
  // closes it; the next region starts once every thread that joined has left.
  alignas(64) std::atomic<std::uint64_t> state_{1};
  alignas(64) std::atomic<std::uint32_t> wake_{0};  // the futex sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stopping_{false};
  void (*job_)(void*) = nullptr;
  void* context_ = nullptr;
  LoopCounter loops_[kMaxLoops];
};

// How many times a wait polls before it yields: 4096 (~20-50 us, a region's straggler on a quiet
// machine), or 0 under OMP_WAIT_POLICY=passive (the test suite's setting: two tests share the
// cores), where idle workers also sleep at once instead of polling for the next region.
int spin_polls();

// Waits until `done()`: polls a short bound (a pause each), then yields the processor between
// polls, so that on a busy machine the thread waited for can run here.
template <class Done>
void spin_then_yield(Done&& done) {
  const int polls = spin_polls();
  for (int poll = 0; !done(); ++poll) {
    if (poll < polls)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

// The region this thread runs a share of, if any: its pool and the next loop's ordinal.
struct RegionSeat {
  ThreadPool* pool = nullptr;
  int next_loop = 0;
};
RegionSeat& region_seat();

// The pool of the calling thread with the thread count set_num_threads chose (built, or rebuilt
// after a change, on first use; one per calling thread, as OpenMP keeps a team per thread), or
// nullptr when a region here would get one thread: one thread set, inside a region already (a
// nested region runs on its own thread), or inside an OpenMP region.
ThreadPool* pool_for_region();

// The thread count set_num_threads last set (OMP_NUM_THREADS / the processors before that).
int configured_threads();
void configure_threads(int threads);

}  // namespace kvlab::cpu
