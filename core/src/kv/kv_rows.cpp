#include "kvlab/kv/kv_rows.hpp"

#include <algorithm>
#include <cstring>

namespace kvlab {

std::int64_t swap_row_bytes(const KvPool& pool) {
  const KvPoolShape& shape = pool.shape();
  return pool.device() != nullptr
             ? pool.device()->host_row_bytes()
             : std::max(shape.slot_row_bytes(false), shape.slot_row_bytes(true));
}

namespace {

// The positions of [first, end) whose rows are in an open KIVI group (the last ones: the open
// group is a sequence's last, partly filled one).
std::int64_t open_tail(const KvPool& pool, const KvView& view, std::int64_t first,
                       std::int64_t end) {
  std::int64_t open = 0;
  while (end - open > first && pool.open_row(0, view.slot_of(end - open - 1), false) != nullptr)
    ++open;
  return open;
}

// copy_kv_rows for a KIVI pool: the slot rows, then the open tail's count (an int64) and its
// fp16 rows (layers, K then V, open tail, slot_width). A swap-in writes the tail through
// write_row, which reopens its group.
std::int64_t copy_kivi_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                            std::vector<std::byte>& buffer, bool to_host) {
  const KvPoolShape& shape = pool.shape();
  // (K and V rows are as long: KIVI sets both.)
  const std::int64_t row = shape.slot_row_bytes(false), tokens = end - first;
  const std::int64_t width = shape.slot_width();
  const std::int64_t main = 2 * shape.layers * tokens * row;
  std::int64_t open = 0;
  if (to_host) {
    open = open_tail(pool, view, first, end);
    buffer.resize(static_cast<std::size_t>(main + 8 + 2 * shape.layers * open * width * 2));
    std::memcpy(buffer.data() + main, &open, 8);
  } else {
    std::memcpy(&open, buffer.data() + main, 8);
  }
  auto* tail = reinterpret_cast<std::uint16_t*>(buffer.data() + main + 8);  // main is even
  std::vector<float> widened(static_cast<std::size_t>(width));
  for (std::int64_t layer = 0; layer < shape.layers; ++layer)
    for (std::int64_t p = first; p < end; ++p) {
      const std::int64_t slot = view.slot_of(p), at = p - first, sealed = tokens - open;
      for (const bool value : {false, true}) {
        const std::int64_t half = 2 * layer + (value ? 1 : 0);
        std::byte* bytes = value ? pool.value_bytes(layer, slot) : pool.key_bytes(layer, slot);
        std::byte* stored = buffer.data() + (half * tokens + at) * row;
        if (to_host) {
          std::memcpy(stored, bytes, static_cast<std::size_t>(row));
          if (at >= sealed)
            std::copy_n(pool.open_row(layer, slot, value), width,
                        tail + (half * open + at - sealed) * width);
          continue;
        }
        std::memcpy(bytes, stored, static_cast<std::size_t>(row));
        if (at < sealed) continue;
        convert_to_f32(
            DType::dtype_f16,
            {reinterpret_cast<const std::byte*>(tail + (half * open + at - sealed) * width),
             static_cast<std::size_t>(2 * width)},
            widened);
        pool.write_row(layer, slot, value, widened.data());
      }
    }
  return 2 * shape.layers * ((tokens - open) * row + open * width * 2);
}

}  // namespace

std::vector<std::byte> swapped_positions_from(const KvPool& pool, std::vector<std::byte>& buffer,
                                              std::int64_t tokens, std::int64_t skip) {
  const std::int64_t width = swap_row_bytes(pool), keep = tokens - skip;
  const std::int64_t halves = 2 * pool.shape().layers, main = halves * tokens * width;
  std::vector<std::byte> part(static_cast<std::size_t>(halves * keep * width));
  for (std::int64_t half = 0; half < halves; ++half)
    std::copy_n(buffer.data() + (half * tokens + skip) * width, keep * width,
                part.data() + half * keep * width);
  part.insert(part.end(), buffer.begin() + main, buffer.end());  // a KIVI pool's open tail
  return part;
}

std::int64_t copy_kv_rows(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                          std::vector<std::byte>& buffer, bool to_host) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t row = swap_row_bytes(pool), tokens = end - first;
  if (to_host && (pool.has_storage() || pool.device() != nullptr))
    buffer.assign(static_cast<std::size_t>(2 * shape.layers * tokens * row), std::byte{0});
  if (KvDeviceStorage* device = pool.device()) {  // the K/V live on a GPU, in its row format
    std::vector<std::int64_t> slots;
    for (std::int64_t p = first; p < end; ++p) slots.push_back(view.slot_of(p));
    if (to_host)
      device->download(slots, buffer.data());
    else
      device->upload(slots, buffer.data());
  } else if (dtype_is_kivi(shape.dtype) && pool.has_storage()) {
    return copy_kivi_rows(pool, view, first, end, buffer, to_host);
  } else if (pool.has_storage()) {  // the pool's own bytes, whatever its dtypes
    const auto key_size = static_cast<std::size_t>(shape.slot_row_bytes(false)),
               value_size = static_cast<std::size_t>(shape.slot_row_bytes(true));
    for (std::int64_t layer = 0; layer < shape.layers; ++layer)
      for (std::int64_t p = first; p < end; ++p) {
        const std::int64_t slot = view.slot_of(p);
        std::byte* k = buffer.data() + ((2 * layer) * tokens + (p - first)) * row;
        std::byte* v = buffer.data() + ((2 * layer + 1) * tokens + (p - first)) * row;
        if (to_host) {
          std::memcpy(k, pool.key_bytes(layer, slot), key_size);
          std::memcpy(v, pool.value_bytes(layer, slot), value_size);
        } else {
          std::memcpy(pool.key_bytes(layer, slot), k, key_size);
          std::memcpy(pool.value_bytes(layer, slot), v, value_size);
        }
      }
  }  // else: bookkeeping only (the simulated backend's pool has no storage)
  return tokens * pool.bytes_per_slot();  // what a real swap moves
}

}  // namespace kvlab
