#pragma once
// Copying a sequence's KV between the pool (its host storage, or the device it is attached to)
// and a host buffer: the engine's swap preemption and the swap-link measurement (sim/).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

// Bytes of one position's K (or V) row of one layer in a host buffer of copy_kv_rows: the pool's
// own slot row (its dtype, scales included: a quantized cache moves as it is stored), or fp32
// rows when the pool's K/V live on a device.
std::int64_t swap_row_bytes(const KvPool& pool);

// The KV of positions [first, end) of `view` between the pool and `buffer`, laid out (layers,
// K then V, positions, swap_row_bytes); to_host: swap-out (the buffer is resized), else swap-in.
// Returns the bytes a swap moves: K and V of those positions in every layer, in the pool's dtype.
std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<std::byte>& buffer, bool to_host);

}  // namespace kvlab
