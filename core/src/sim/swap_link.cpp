#include "kvlab/sim/swap_link.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "kvlab/error.hpp"
#include "kvlab/kv/kv_rows.hpp"

namespace kvlab {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median, the two middle values' mean for an even count (numpy's linear interpolation).
double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

}  // namespace

SwapLink fit_swap_link(std::span<const LinkSample> samples) {
  // Weighted least squares on relative errors (weights 1 / seconds^2): a 1-token copy's error
  // counts as much as a 1,024-token one's.
  std::set<double> sizes;
  double w = 0, wx = 0, wy = 0, wxx = 0, wxy = 0;
  for (const LinkSample& s : samples) {
    if (!(s.seconds > 0) || !(s.bytes > 0))
      throw Error(fmt::format("swap link: a copy of {} bytes in {} s", s.bytes, s.seconds));
    sizes.insert(s.bytes);
    const double weight = 1.0 / (s.seconds * s.seconds);
    w += weight;
    wx += weight * s.bytes;
    wy += weight * s.seconds;
    wxx += weight * s.bytes * s.bytes;
    wxy += weight * s.bytes * s.seconds;
  }
  if (sizes.size() < 2)
    throw Error(fmt::format("swap link: {} copy size(s) measured; a fit needs two", sizes.size()));
  double slope = (w * wxy - wx * wy) / (w * wxx - wx * wx);  // seconds per byte
  double latency = (wy - slope * wx) / w;
  if (latency < 0) {  // through the origin instead
    latency = 0;
    slope = wxy / wxx;
  }
  if (!(slope > 0)) throw Error("swap link: the measured copies did not take longer as they grew");
  SwapLink link;
  link.gb_per_s = 1.0 / slope / 1e9;
  link.latency_s = latency;
  link.samples.assign(samples.begin(), samples.end());
  return link;
}

SwapLink measure_swap_link(KvPool& pool, std::int64_t max_tokens, int repeats) {
  max_tokens = std::min(max_tokens, pool.shape().slots);
  if (max_tokens < 4 || repeats < 1)
    throw Error(
        fmt::format("swap link: {} tokens x {} repeats is too little to fit", max_tokens, repeats));
  if (!pool.has_storage() && pool.device() == nullptr)
    throw Error("swap link: the pool holds no K/V (no storage, no device) to copy");
  const KvView view{{{0, max_tokens}}, 0, {}};
  std::vector<LinkSample> medians;
  for (std::int64_t tokens = 1;; tokens = std::min(tokens * 4, max_tokens)) {
    std::vector<double> out_s, in_s;
    std::int64_t bytes = 0;
    for (int r = 0; r < repeats; ++r) {
      // As the engine swaps: out into a new buffer (the request's), back in from it (the same
      // K/V to the same slots: the pool ends as it began).
      std::vector<std::byte> buffer;
      auto start = std::chrono::steady_clock::now();
      bytes = copy_kv_rows(pool, view, 0, tokens, buffer, true);
      out_s.push_back(seconds_since(start));
      start = std::chrono::steady_clock::now();
      copy_kv_rows(pool, view, 0, tokens, buffer, false);
      in_s.push_back(seconds_since(start));
    }
    medians.push_back({tokens, static_cast<double>(bytes), median(std::move(out_s)), true});
    medians.push_back({tokens, static_cast<double>(bytes), median(std::move(in_s)), false});
    if (tokens == max_tokens) break;
  }
  return fit_swap_link(medians);
}

}  // namespace kvlab
