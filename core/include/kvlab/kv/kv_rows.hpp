#pragma once
// Copying a sequence's KV between the pool (its host storage, or the device it is attached to)
// and a host buffer: the engine's swap preemption and the swap-link measurement (sim/).
#include <cstdint>
#include <vector>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

// The KV of positions [first, end) of `view` between the pool and `buffer`, host fp32 laid out
// (layers, K then V, positions, slot width); to_host: swap-out (the buffer is resized), else
// swap-in. Returns the bytes a swap moves: K and V of those positions in every layer, in the
// pool's dtype.
std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<float>& buffer, bool to_host);

}  // namespace kvlab
