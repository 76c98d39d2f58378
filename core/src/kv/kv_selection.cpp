#include "kvlab/kv/kv_selection.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

namespace kvlab {

std::int64_t keep_ends_and_top(std::span<const std::int64_t> positions,
                               std::span<const double> scores, std::int64_t first,
                               std::int64_t recent, std::int64_t top,
                               std::span<std::int64_t> kept) {
  const auto n = static_cast<std::int64_t>(positions.size());
  first = std::clamp<std::int64_t>(first, 0, n);
  recent = std::clamp<std::int64_t>(recent, 0, n - first);
  const std::int64_t middle = n - first - recent;
  top = std::clamp<std::int64_t>(top, 0, middle);
  std::vector<std::int64_t> chosen(static_cast<std::size_t>(middle));  // indices into positions
  std::iota(chosen.begin(), chosen.end(), first);
  if (top == 0) {
    chosen.clear();  // scores may be empty: none is read
  } else if (top < middle) {
    auto better = [&](std::int64_t a, std::int64_t b) {
      const double sa = scores[static_cast<std::size_t>(a)],
                   sb = scores[static_cast<std::size_t>(b)];
      return sa != sb ? sa > sb : a < b;
    };
    std::nth_element(chosen.begin(), chosen.begin() + top, chosen.end(), better);
    chosen.resize(static_cast<std::size_t>(top));
    std::sort(chosen.begin(), chosen.end());
  }
  std::int64_t count = 0;
  auto keep = [&](std::int64_t index) {
    kept[static_cast<std::size_t>(count++)] = positions[static_cast<std::size_t>(index)];
  };
  for (std::int64_t i = 0; i < first; ++i) keep(i);
  for (std::int64_t i : chosen) keep(i);
  for (std::int64_t i = n - recent; i < n; ++i) keep(i);
  return count;
}

void max_pool(std::span<double> values, std::int64_t kernel) {
  const std::int64_t half = kernel / 2, n = static_cast<std::int64_t>(values.size());
  if (half <= 0 || n == 0) return;
  const std::vector<double> source(values.begin(), values.end());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t begin = std::max<std::int64_t>(0, i - half), end = std::min(n, i + half + 1);
    values[static_cast<std::size_t>(i)] =
        *std::max_element(source.begin() + begin, source.begin() + end);
  }
}

}  // namespace kvlab
