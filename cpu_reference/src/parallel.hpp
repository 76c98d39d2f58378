// OpenMP regions that cost nothing when they would run on one thread.
//
// libgomp ends every parallel region with a futex wake, even a region of one thread or one whose
// `if` clause is false: one system call a region (strace: 10,000 regions, 10,000 futex calls).
// A forward pass opens about ten regions a layer, so a one-thread run (every test, under
// OMP_THREAD_LIMIT=1) made ~57,000 system calls in a 0.5 s test; on a CI host where each waited
// for a scheduler slice beside another test, that test ran 47x slower. Here a region that would
// get one thread is a plain loop or call on the calling thread, with no OpenMP entry at all.
#pragma once

#include <omp.h>

#include <cstdint>

namespace kvlab::cpu {

// Whether a region opened here would get more than one thread: not when OpenMP is set to one
// thread, nor inside a region already (nested regions are inactive: one thread each).
inline bool region_gets_threads() {
  return omp_get_max_threads() > 1 && !omp_in_parallel();
}

// `#pragma omp parallel` around `region`, which may hold orphaned `#pragma omp for` loops (they
// bind to this region's team, or run whole on the calling thread when it calls `region` alone).
template <class Region>
void parallel_region(Region&& region) {
  if (omp_get_max_threads() == 1 && !omp_in_parallel()) {
    region();  // outside any region: an orphaned `omp for` binds to this thread alone
    return;
  }
#pragma omp parallel
  region();
}

enum class LoopSchedule { static_chunks, guided, dynamic };

// `#pragma omp parallel for schedule(S)` over [0, n), or a plain loop when fewer than
// `parallel_from` items (too little work to share) or one thread would run it.
template <LoopSchedule S = LoopSchedule::static_chunks, class Body>
void parallel_for(std::int64_t n, Body&& body, std::int64_t parallel_from = 2) {
  if (n < parallel_from || !region_gets_threads()) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  if constexpr (S == LoopSchedule::static_chunks) {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) body(i);
  } else if constexpr (S == LoopSchedule::guided) {
#pragma omp parallel for schedule(guided)
    for (std::int64_t i = 0; i < n; ++i) body(i);
  } else {
#pragma omp parallel for schedule(dynamic)
    for (std::int64_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace kvlab::cpu
