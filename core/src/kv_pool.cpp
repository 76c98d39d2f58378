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
      floats ? checked_product<std::int64_t>({*floats, 2, shape.element_bytes()}) : std::nullopt;
  if (!bytes)
    throw Error(fmt::format("KV pool of {} slots x {} layers x {} floats overflows 64 bits",
                            shape.slots, shape.layers, shape.kv_heads * shape.head_dim));
  // Without storage the dtype only sizes swaps and memory (a simulated device's fp8 KV).
  if (storage == KvStorage::host) provide_host_storage();
}

void KvPool::provide_host_storage() {
  if (has_storage()) return;
  if (shape_.dtype != DType::dtype_f32 && shape_.dtype != DType::dtype_f16 &&
      shape_.dtype != DType::dtype_bf16)
    throw Error(
        fmt::format("a KV pool holds f32, f16 or bf16, not {}", dtype_short_name(shape_.dtype)));
  const std::int64_t bytes = bytes_per_slot() * shape_.slots;  // checked in the constructor
  check_allocation(static_cast<std::uint64_t>(bytes),
                   fmt::format("the KV pool ({} slots x {} layers x {} KV heads x head_dim {}, "
                               "K and V in {}; kv_cache.slots or kv_cache.memory_mib)",
                               shape_.slots, shape_.layers, shape_.kv_heads, shape_.head_dim,
                               dtype_short_name(shape_.dtype)));
  if (bytes == 0) return;  // no slots: nothing to hold (has_storage() stays false)
  keys_ = allocate(bytes / 2);
  values_ = allocate(bytes / 2);
}

float* KvPool::as_floats(std::byte* p) const {
  if (shape_.dtype != DType::dtype_f32)
    throw Error(
        fmt::format("internal: float access to a {} KV pool", dtype_short_name(shape_.dtype)));
  return reinterpret_cast<float*>(p);
}

void KvPool::read_row(std::int64_t layer, std::int64_t slot, bool value, float* out) const {
  const auto width = static_cast<std::size_t>(shape_.slot_width());
  const std::byte* row = value ? value_bytes(layer, slot) : key_bytes(layer, slot);
  convert_to_f32(shape_.dtype, {row, width * dtype_size(shape_.dtype)}, {out, width});
}

void KvPool::write_row(std::int64_t layer, std::int64_t slot, bool value, const float* row) {
  const auto width = static_cast<std::size_t>(shape_.slot_width());
  std::byte* target = value ? value_bytes(layer, slot) : key_bytes(layer, slot);
  convert_from_f32(shape_.dtype, {row, width}, {target, width * dtype_size(shape_.dtype)});
}

KvPool::Buffer KvPool::allocate(std::int64_t size) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const auto bytes = static_cast<std::size_t>(size);
  const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* memory = std::aligned_alloc(kHugePage, rounded);
  if (memory == nullptr)
    throw Error(fmt::format("cannot allocate {} bytes for the KV pool", rounded));
#ifdef MADV_HUGEPAGE
  madvise(memory, rounded, MADV_HUGEPAGE);  // a hint: without huge pages it works as before
#endif
  std::memset(memory, 0, bytes);
  return Buffer(static_cast<std::byte*>(memory));
}

std::int64_t KvPool::bytes_per_slot() const {
  return 2 * shape_.layers * shape_.slot_width() * shape_.element_bytes();
}

std::int64_t KvPool::copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) {
  assert(source >= 0 && destination >= 0 && source + count <= shape_.slots &&
         destination + count <= shape_.slots);
  if (device_ != nullptr) device_->copy_slots(source, destination, count);
  if (!has_storage()) return count * bytes_per_slot();
  const auto bytes = static_cast<std::size_t>(count * shape_.slot_width() * shape_.element_bytes());
  for (std::int64_t layer = 0; layer < shape_.layers; ++layer) {
    std::memmove(key_bytes(layer, destination), key_bytes(layer, source), bytes);
    std::memmove(value_bytes(layer, destination), value_bytes(layer, source), bytes);
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
