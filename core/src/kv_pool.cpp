#include "kvlab/kv_pool.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstring>

#include <fmt/format.h>

#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"

namespace kvlab {

KvPool::KvPool(const KvPoolShape& shape, KvStorage storage) : shape_(shape) {
  if (shape.layers < 0 || shape.kv_heads < 0 || shape.head_dim < 0 || shape.slots < 0)
    throw Error(
        fmt::format("KV pool shape must be non-negative: {} layers, {} KV heads, head_dim "
                    "{}, {} slots",
                    shape.layers, shape.kv_heads, shape.head_dim, shape.slots));
  const auto floats =
      checked_product<std::int64_t>({shape.layers, shape.slots, shape.kv_heads, shape.head_dim});
  const auto bytes =
      floats ? checked_product<std::int64_t>({*floats, 2, sizeof(float)}) : std::nullopt;
  if (!bytes)
    throw Error(fmt::format("KV pool of {} slots x {} layers x {} floats overflows 64 bits",
                            shape.slots, shape.layers, shape.kv_heads * shape.head_dim));
  if (storage == KvStorage::none) return;
  check_allocation(static_cast<std::uint64_t>(*bytes),
                   fmt::format("the KV pool ({} slots x {} layers x {} KV heads x head_dim {}, "
                               "K and V in fp32; kv_cache.slots or kv_cache.memory_mib)",
                               shape.slots, shape.layers, shape.kv_heads, shape.head_dim));
  keys_ = allocate(*floats);
  values_ = allocate(*floats);
}

KvPool::Buffer KvPool::allocate(std::int64_t floats) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t bytes = static_cast<std::size_t>(std::max<std::int64_t>(floats, 1)) * sizeof(float);
  const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* memory = std::aligned_alloc(kHugePage, rounded);
  if (memory == nullptr)
    throw Error(fmt::format("cannot allocate {} bytes for the KV pool", rounded));
#ifdef MADV_HUGEPAGE
  madvise(memory, rounded, MADV_HUGEPAGE);  // a hint: without huge pages it works as before
#endif
  std::memset(memory, 0, bytes);
  return Buffer(static_cast<float*>(memory));
}

std::int64_t KvPool::bytes_per_slot() const {
  return 2 * shape_.layers * shape_.slot_width() * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t KvPool::copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) {
  assert(source >= 0 && destination >= 0 && source + count <= shape_.slots &&
         destination + count <= shape_.slots);
  if (device_ != nullptr) device_->copy_slots(source, destination, count);
  if (!has_storage()) return count * bytes_per_slot();
  const auto bytes = static_cast<std::size_t>(count * shape_.slot_width()) * sizeof(float);
  for (std::int64_t layer = 0; layer < shape_.layers; ++layer) {
    std::memmove(key(layer, destination), key(layer, source), bytes);
    std::memmove(value(layer, destination), value(layer, source), bytes);
  }
  return count * bytes_per_slot();
}

std::int64_t KvView::length() const {
  std::int64_t total = 0;
  for (const auto& e : extents) total += e.length;
  return total;
}

std::int64_t KvView::slot_of(std::int64_t position) const {
  std::int64_t offset = position - first_position;
  for (const auto& e : extents) {
    if (offset < e.length) return e.start_slot + offset;
    offset -= e.length;
  }
  assert(false && "KvView::slot_of: position outside the view");
  return -1;
}

}  // namespace kvlab
