#include "kvlab/kv/kv_rows.hpp"

#include <cstring>

namespace kvlab {

std::int64_t swap_row_bytes(const KvPool& pool) {
  const KvPoolShape& shape = pool.shape();
  return pool.device() != nullptr ? shape.slot_width() * static_cast<std::int64_t>(sizeof(float))
                                  : shape.slot_row_bytes();
}

std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<std::byte>& buffer, bool to_host) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t row = swap_row_bytes(pool), tokens = end - first;
  if (to_host && (pool.has_storage() || pool.device() != nullptr))
    buffer.assign(static_cast<std::size_t>(2 * shape.layers * tokens * row), std::byte{0});
  if (KvDeviceStorage* device = pool.device()) {  // the K/V live on a GPU, moved as fp32
    std::vector<std::int64_t> slots;
    for (std::int64_t p = first; p < end; ++p) slots.push_back(view.slot_of(p));
    auto* floats = reinterpret_cast<float*>(buffer.data());  // operator new: aligned for float
    if (to_host)
      device->download(slots, floats);
    else
      device->upload(slots, floats);
  } else if (pool.has_storage()) {  // the pool's own bytes, whatever its dtype
    const auto size = static_cast<std::size_t>(row);
    for (std::int64_t layer = 0; layer < shape.layers; ++layer)
      for (std::int64_t p = first; p < end; ++p) {
        const std::int64_t slot = view.slot_of(p);
        std::byte* k = buffer.data() + ((2 * layer) * tokens + (p - first)) * row;
        std::byte* v = buffer.data() + ((2 * layer + 1) * tokens + (p - first)) * row;
        if (to_host) {
          std::memcpy(k, pool.key_bytes(layer, slot), size);
          std::memcpy(v, pool.value_bytes(layer, slot), size);
        } else {
          std::memcpy(pool.key_bytes(layer, slot), k, size);
          std::memcpy(pool.value_bytes(layer, slot), v, size);
        }
      }
  }  // else: bookkeeping only (the simulated backend's pool has no storage)
  return 2 * shape.layers * tokens * shape.slot_row_bytes();  // what a real swap moves
}

}  // namespace kvlab
