#pragma once
// Copying a sequence's KV between the pool (its host storage, or the device it is attached to)
// and a host buffer: the engine's swap preemption and the swap-link measurement (sim/).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

// Bytes of one position's K (or V) row of one layer in a host buffer of copy_kv_rows: the pool's
// own slot row (its dtype, scales included: a quantized cache moves as it is stored; the longer
// of K's and V's when their dtypes differ, the shorter padded), or fp32 rows when the pool's K/V
// live on a device.
std::int64_t swap_row_bytes(const KvPool& pool);

// The KV of positions [first, end) of `view` between the pool and `buffer`, laid out (layers,
// K then V, positions, swap_row_bytes); to_host: swap-out (the buffer is resized), else swap-in.
// Returns the bytes a swap moves: K and V of those positions in every layer, in the pool's dtype.
// A KIVI pool (kvlab/kv/kivi_groups.hpp) adds its open group's rows after those: an int64 count
// of trailing positions whose rows were open, then their fp16 rows (layers, K then V, count,
// slot_width); their slot rows in the first part are unused. The bytes returned count them.
// A swap-in reopens their group (KvPool::write_row).
std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<std::byte>& buffer, bool to_host);
// The buffer copy_kv_rows made for `tokens` positions, less its first `skip` positions (skip <=
// the first open position): a swap-in whose leading positions the prefix cache serves.
std::vector<std::byte> swapped_positions_from(const KvPool& pool, std::vector<std::byte>& buffer,
                                              std::int64_t tokens, std::int64_t skip);

}  // namespace kvlab
