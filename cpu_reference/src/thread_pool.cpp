#include "thread_pool.hpp"

#include <omp.h>
#include <strings.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <system_error>

namespace kvlab::cpu {
namespace {

constexpr std::uint64_t kClosed = 1;
constexpr std::uint64_t kOneJoined = 2;
constexpr std::uint64_t generation_of(std::uint64_t state) {
  return state >> 32;
}
constexpr std::uint64_t joined_of(std::uint64_t state) {
  return (state >> 1) & 0x7fffffffu;
}

// An idle worker polls for the next region this long (a decode step's regions come every few
// tens of microseconds), then yields between polls for as long again x 10, then sleeps.
constexpr auto kIdleSpin = std::chrono::microseconds(100);
constexpr auto kIdleYield = std::chrono::microseconds(1000);

bool passive_waits() {
  static const bool passive = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy != nullptr && strcasecmp(policy, "passive") == 0;
  }();
  return passive;
}

std::atomic<int> g_threads{0};  // set_num_threads' count; 0: not set yet

// A region's threads call BLAS single-threaded: OpenBLAS (its OpenMP build) threads a call by
// the calling thread's OpenMP ICV, and returns at once without touching its global count when
// that is 1. Held by the caller for the region; workers set theirs once.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas() : saved_(omp_get_max_threads()) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~SingleThreadedBlas() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_;
};

}  // namespace

int spin_polls() {
  return passive_waits() ? 0 : 4096;
}

RegionSeat& region_seat() {
  thread_local RegionSeat seat;
  return seat;
}

int configured_threads() {
  const int threads = g_threads.load(std::memory_order_relaxed);
  if (threads > 0) return threads;
  static const int from_environment =
      std::max(1, std::min(omp_get_max_threads(), omp_get_thread_limit()));
  return from_environment;
}

void configure_threads(int threads) {
  g_threads.store(std::max(1, threads));
}

ThreadPool* pool_for_region() {
  if (region_seat().pool != nullptr || omp_in_parallel()) return nullptr;
  const int threads = configured_threads();
  if (threads <= 1) return nullptr;
  thread_local std::unique_ptr<ThreadPool> pool;
  if (!pool || pool->requested_threads() != threads) {
    pool.reset();
    pool = std::make_unique<ThreadPool>(threads);
  }
  return pool.get();
}

ThreadPool::LoopCounter& ThreadPool::loop(int ordinal) {
  if (ordinal >= kMaxLoops) {  // a programming error, on a worker thread: no one to throw to
    std::fprintf(stderr, "kvlab: a parallel region holds more than %d shared loops\n", kMaxLoops);
    std::abort();
  }
  return loops_[ordinal];
}

ThreadPool::ThreadPool(int threads) : requested_(threads) {
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_main(); });
  } catch (const std::system_error&) {  // out of threads (RLIMIT_NPROC): run with those started
  }
}

ThreadPool::~ThreadPool() {
  stopping_.store(true);
  wake_.fetch_add(1);
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_erased(void (*job)(void*), void* context) {
  job_ = job;
  context_ = context;
  for (auto& loop : loops_) {
    loop.next.store(0, std::memory_order_relaxed);
    loop.done.store(0, std::memory_order_relaxed);
  }
  const std::uint64_t generation = generation_of(state_.load(std::memory_order_relaxed)) + 1;
  state_.store(generation << 32);  // open, nobody joined; publishes the job and the counters
  if (sleepers_.load() > 0) {
    wake_.fetch_add(1);
    wake_.notify_all();
  }
  {
    const SingleThreadedBlas blas;
    region_seat() = {this, 0};
    job(context);
    region_seat() = {};
  }
  state_.fetch_or(kClosed);  // no one joins from here on
  spin_then_yield([&] { return joined_of(state_.load(std::memory_order_acquire)) == 0; });
}

// Joins the open region if it is new to this worker and runs its share; false when there was
// none to join (none new, or closed before this worker came).
bool ThreadPool::try_join(std::uint64_t& seen_generation) {
  std::uint64_t state = state_.load(std::memory_order_acquire);
  while (generation_of(state) != seen_generation) {
    if (state & kClosed) {
      seen_generation = generation_of(state);
      return false;
    }
    if (state_.compare_exchange_weak(state, state + kOneJoined, std::memory_order_acq_rel)) {
      seen_generation = generation_of(state);
      region_seat() = {this, 0};
      job_(context_);
      region_seat() = {};
      state_.fetch_sub(kOneJoined, std::memory_order_release);
      return true;
    }
  }
  return false;
}

void ThreadPool::worker_main() {
  omp_set_num_threads(1);  // BLAS called from a region's item runs on this thread alone
  std::uint64_t seen = generation_of(state_.load());
  const auto news = [&] { return generation_of(state_.load()) != seen || stopping_.load(); };
  while (!stopping_.load()) {
    if (try_join(seen)) continue;
    const auto start = std::chrono::steady_clock::now();
    const auto waited = [&] { return std::chrono::steady_clock::now() - start; };
    const bool passive = passive_waits();
    bool found = false;
    for (int poll = 1; !found && !passive; ++poll) {
      found = news();
      if (found || (poll % 64 == 0 && waited() > kIdleSpin)) break;
      cpu_relax();
    }
    while (!found && !passive && waited() < kIdleYield) {
      std::this_thread::yield();
      found = news();
    }
    if (found) continue;
    const std::uint32_t ticket = wake_.load();
    sleepers_.fetch_add(1);
    if (!news()) wake_.wait(ticket);
    sleepers_.fetch_sub(1);
  }
}

}  // namespace kvlab::cpu
