#include "kvlab/kv/kv_rows.hpp"

namespace kvlab {
namespace {

// Bytes of K and V for `tokens` positions across all layers, in the pool's dtype (what a real
// swap moves; the host buffer holds them widened to fp32, which is exact).
std::int64_t kv_bytes(const KvPoolShape& shape, std::int64_t tokens) {
  return 2 * shape.layers * tokens * shape.slot_width() * shape.element_bytes();
}

}  // namespace

std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<float>& buffer, bool to_host) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t width = shape.slot_width(), tokens = end - first;
  if (to_host && (pool.has_storage() || pool.device() != nullptr))
    buffer.assign(static_cast<std::size_t>(2 * shape.layers * tokens * width), 0.0f);
  if (KvDeviceStorage* device = pool.device()) {  // the K/V live on a GPU
    std::vector<std::int64_t> slots;
    for (std::int64_t p = first; p < end; ++p) slots.push_back(view.slot_of(p));
    if (to_host)
      device->download(slots, buffer.data());
    else
      device->upload(slots, buffer.data());
  } else if (pool.has_storage()) {
    for (std::int64_t layer = 0; layer < shape.layers; ++layer)
      for (std::int64_t p = first; p < end; ++p) {
        const std::int64_t slot = view.slot_of(p);
        float* k = buffer.data() + ((2 * layer) * tokens + (p - first)) * width;
        float* v = buffer.data() + ((2 * layer + 1) * tokens + (p - first)) * width;
        if (to_host) {
          pool.read_row(layer, slot, false, k);
          pool.read_row(layer, slot, true, v);
        } else {
          pool.write_row(layer, slot, false, k);
          pool.write_row(layer, slot, true, v);
        }
      }
  }  // else: bookkeeping only (the simulated backend's pool has no storage)
  return kv_bytes(shape, tokens);
}

}  // namespace kvlab
