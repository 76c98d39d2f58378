#include "kvlab/kv/kv_selection.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvlab {

std::int64_t mark_ends_and_top(std::span<const double> scores, std::int64_t first,
                               std::int64_t recent, std::int64_t top,
                               std::span<std::uint8_t> mark) {
  const auto n = static_cast<std::int64_t>(mark.size());
  first = std::clamp<std::int64_t>(first, 0, n);
  recent = std::clamp<std::int64_t>(recent, 0, n - first);
  const std::int64_t middle = n - first - recent;
  top = std::clamp<std::int64_t>(top, 0, middle);
  for (std::int64_t i = 0; i < first; ++i) mark[static_cast<std::size_t>(i)] = 1;
  for (std::int64_t i = n - recent; i < n; ++i) mark[static_cast<std::size_t>(i)] = 1;
  if (top == 0) return first + recent;  // scores may be empty: none is read
  std::vector<std::int64_t> chosen(static_cast<std::size_t>(middle));  // indices into mark
  std::iota(chosen.begin(), chosen.end(), first);
  if (top < middle) {
    auto better = [&](std::int64_t a, std::int64_t b) {
      const double sa = scores[static_cast<std::size_t>(a)],
                   sb = scores[static_cast<std::size_t>(b)];
      return sa != sb ? sa > sb : a < b;
    };
    std::nth_element(chosen.begin(), chosen.begin() + top, chosen.end(), better);
    chosen.resize(static_cast<std::size_t>(top));
  }
  for (std::int64_t i : chosen) mark[static_cast<std::size_t>(i)] = 1;
  return first + recent + top;
}

std::int64_t mark_every_head(const KvKeep& keep, std::span<const std::uint8_t> mark) {
  const auto marked = std::count(mark.begin(), mark.end(), std::uint8_t{1});
  for (std::int64_t l = 0; l < keep.layers; ++l)
    for (std::int64_t h = 0; h < keep.kv_heads; ++h)
      std::copy(mark.begin(), mark.end(), keep.head(l, h).begin());
  return marked * keep.layers * keep.kv_heads;
}

std::vector<double> summed_scores(const KvPolicyStep& step) {
  std::vector<double> sums(step.positions.size(), 0.0);
  if (step.scores.empty()) return sums;
  for (std::int64_t l = 0; l < step.layers; ++l)
    for (std::int64_t h = 0; h < step.kv_heads; ++h) {
      const std::span<const float> head = step.head_scores(l, h);
      for (std::size_t i = 0; i < sums.size(); ++i) sums[i] += head[i];
    }
  return sums;
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

std::vector<double> snapkv_votes(const KvPolicyStep& step, std::int64_t layer, std::int64_t kv_head,
                                 std::int64_t window, std::int64_t kernel) {
  const std::int64_t n = step.count(), older = std::max<std::int64_t>(0, n - window);
  std::vector<double> votes(static_cast<std::size_t>(n), 0.0);
  if (step.scores.empty()) return votes;
  const std::span<const float> scores = step.head_scores(layer, kv_head);
  std::copy(scores.begin(), scores.begin() + older, votes.begin());
  max_pool(std::span<double>(votes).first(static_cast<std::size_t>(older)), kernel);
  for (std::int64_t i = 0; i < older; ++i)  // what the head dropped ranks last
    if (!step.sees(layer, kv_head, i))
      votes[static_cast<std::size_t>(i)] = -std::numeric_limits<double>::infinity();
  return votes;
}

std::int64_t snapkv_mark(const KvPolicyStep& step, std::int64_t layer, std::int64_t kv_head,
                         std::int64_t window, std::int64_t kernel, std::int64_t keep,
                         std::span<std::uint8_t> mark) {
  const std::int64_t n = step.count(), recent = std::min(window, n);
  if (n <= keep) {
    std::fill(mark.begin(), mark.end(), std::uint8_t{1});
    return n;
  }
  const std::vector<double> votes = snapkv_votes(step, layer, kv_head, window, kernel);
  return mark_ends_and_top(votes, 0, recent, std::max<std::int64_t>(0, keep - recent), mark);
}

ObservationWindow ObservationWindow::from(const PluginParams& params, const char* policy) {
  ObservationWindow w{params.integer("budget"), params.integer("window"), params.integer("kernel"),
                      params.boolean("one_shot")};
  if (w.window >= w.budget)
    throw std::invalid_argument(std::string(policy) +
                                ": the observation window must be below the budget");
  return w;
}

std::int64_t mark_all(const KvKeep& keep) {
  std::fill(keep.cells.begin(), keep.cells.end(), std::uint8_t{1});
  return static_cast<std::int64_t>(keep.cells.size());
}

}  // namespace kvlab
