// Parallel regions and loops of the CPU backend, on its own thread pool (thread_pool.hpp).
//
// A region that would get one thread is a plain loop or call on the calling thread, with no
// synchronisation at all: one thread set (every test, under OMP_THREAD_LIMIT=1), or inside a
// region already. (libgomp ended every region with a futex wake, even a region of one thread: a
// forward pass made ~57,000 system calls in a 0.5 s one-thread test, and on a CI host where
// each waited for a slice beside another test, that test ran 47x slower.)
//
// Loops share their items out in guided chunks claimed from a counter (no static halves): a
// thread that is descheduled holds back at most the chunk it holds, and the others take the rest.
#pragma once

#include <algorithm>
#include <cstdint>

#include "thread_pool.hpp"

namespace kvlab::cpu {

// Runs `region` on the pool's threads (each that joins in time runs all of it, as an OpenMP
// parallel region does), or once on the calling thread. `region` shares its work through
// shared_loop; it must not throw.
template <class Region>
void parallel_region(Region&& region) {
  ThreadPool* pool = pool_for_region();
  if (pool == nullptr) {
    region();  // a shared_loop inside runs whole on this thread
    return;
  }
  pool->run(region);
}

// How a loop's items are claimed: `chunked` in guided chunks (a quarter of what is left for two
// threads, then less, down to one item: few claims, and the threads finish together, whichever
// ran behind or was descheduled), `one_at_a_time` for few items of uneven cost.
enum class LoopSchedule { chunked, one_at_a_time };

// Runs the items of [0, n) this thread claims from `counter` until none is left, counting them
// done. Returns without waiting for the items other threads hold.
template <LoopSchedule S, class Body>
void claim_and_run(ThreadPool::LoopCounter& counter, std::int64_t threads, std::int64_t n,
                   Body& body) {
  std::int64_t begin = counter.next.load(std::memory_order_relaxed);
  while (begin < n) {
    const std::int64_t size = S == LoopSchedule::one_at_a_time
                                  ? 1
                                  : std::max<std::int64_t>(1, (n - begin) / (2 * threads));
    if (!counter.next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed))
      continue;  // `begin` now holds the counter's value: try again from there
    const std::int64_t end = std::min(n, begin + size);
    for (std::int64_t i = begin; i < end; ++i) body(i);
    counter.done.fetch_add(end - begin, std::memory_order_release);
    begin = counter.next.load(std::memory_order_relaxed);
  }
}

// Inside parallel_region: the region's threads share items [0, n) (an orphaned `omp for`), and
// each returns once every item is done. Outside a region: a plain loop.
template <LoopSchedule S = LoopSchedule::chunked, class Body>
void shared_loop(std::int64_t n, Body&& body) {
  RegionSeat& seat = region_seat();
  if (seat.pool == nullptr) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  ThreadPool::LoopCounter& counter = seat.pool->loop(seat.next_loop++);
  claim_and_run<S>(counter, seat.pool->threads(), n, body);
  spin_then_yield([&] { return counter.done.load(std::memory_order_acquire) >= n; });
}

// A region of one shared loop over [0, n), or a plain loop when fewer than `parallel_from` items
// (too little work to share) or one thread would run it.
template <LoopSchedule S = LoopSchedule::chunked, class Body>
void parallel_for(std::int64_t n, Body&& body, std::int64_t parallel_from = 2) {
  ThreadPool* pool = n < parallel_from ? nullptr : pool_for_region();
  if (pool == nullptr) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // No wait at the loop's end: the region's end waits for every thread that joined, and a thread
  // leaves only once the items it claimed are done (one hand-off fewer a region).
  auto region = [&] { claim_and_run<S>(pool->loop(0), pool->threads(), n, body); };
  pool->run(region);
}

}  // namespace kvlab::cpu
