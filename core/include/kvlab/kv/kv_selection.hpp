#pragma once
// What KV policies (kvlab/kv_policy.hpp) share: keeping the ends of a sequence's positions and
// the best-scored of the rest.
#include <cstdint>
#include <span>

namespace kvlab {

// Keeps the `first` oldest and the `recent` newest of `positions` (increasing), and of the
// others the `top` with the highest `scores` (one per position; ties: the older position),
// writing the kept positions, increasing, into `kept` (room for positions.size()). Returns
// their count. Keeps everything when first + recent + top >= positions.size().
std::int64_t keep_ends_and_top(std::span<const std::int64_t> positions,
                               std::span<const double> scores, std::int64_t first,
                               std::int64_t recent, std::int64_t top, std::span<std::int64_t> kept);

// Each value replaced by the maximum over the `kernel` values centred on it (SnapKV's pooling,
// which keeps a chosen position's neighbours with it); kernel 1 leaves them as they are.
void max_pool(std::span<double> values, std::int64_t kernel);

}  // namespace kvlab
