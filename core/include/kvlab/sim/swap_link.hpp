#pragma once
// The swap link as the engine uses it: its swap copy (copy_kv_rows) timed over several sizes and
// fitted to the profile's [link] model, one copy of B bytes = latency + B / bandwidth. On the
// cpu backend the copy is the host pool's rows to and from a host buffer; with a GPU backend
// attached to the pool it is the device's download and upload, whatever memory and conversions
// they use — so the virtual clock prices a swap as the measured clock times it.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

struct LinkSample {
  std::int64_t tokens = 0;
  double bytes = 0;  // K and V of those tokens in every layer, in the pool's dtype
  double seconds = 0;
  bool to_host = true;  // swap-out; false: swap-in
};

struct SwapLink {
  double gb_per_s = 0;   // 10^9 bytes/s
  double latency_s = 0;  // per copy, >= 0
  std::vector<LinkSample> samples;
};

// Least squares on relative errors, seconds = latency + bytes / bandwidth (latency held at 0
// when the free fit's is negative). kvlab::Error with fewer than two sizes, a sample that is not
// positive, or copies that do not grow with their size.
SwapLink fit_swap_link(std::span<const LinkSample> samples);

// Times swap-out and swap-in of 1, 4, 16, ... up to `max_tokens` tokens (slots 0 onward of
// `pool`, which needs storage or an attached device), the median of `repeats` each, and fits
// the link to them. The pool's K/V in those slots come back unchanged.
SwapLink measure_swap_link(KvPool& pool, std::int64_t max_tokens, int repeats);

}  // namespace kvlab
