#include "kvlab/kv_pool.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <span>

#include <fmt/format.h>

#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/memory_limit.hpp"

namespace kvlab {

namespace {

constexpr DType kHostPoolDtypes[] = {
    DType::dtype_f32,     DType::dtype_f16,   DType::dtype_bf16, DType::dtype_f8_e4m3,
    DType::dtype_kv_int8, DType::dtype_q8_0,  DType::dtype_q4_0, DType::dtype_q4_1,
    DType::dtype_kv_int2, DType::dtype_kivi2, DType::dtype_kivi4};

}  // namespace

bool kv_pool_holds(DType dtype) {
  return std::find(std::begin(kHostPoolDtypes), std::end(kHostPoolDtypes), dtype) !=
         std::end(kHostPoolDtypes);
}

std::string kv_pool_dtype_names() {
  std::string names;
  for (DType dtype : kHostPoolDtypes)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", dtype_short_name(dtype));
  return names;
}

DType kv_pool_dtype(std::string_view name, std::string_view what) {
  const auto dtype = dtype_from_short_name(name);
  if (!dtype || !kv_pool_holds(*dtype))
    throw Error(fmt::format("{} must be one of {}, not \"{}\"", what, kv_pool_dtype_names(), name));
  return *dtype;
}

bool pairs_key_channels(DType dtype) {
  return dtype_is_kv_block_format(dtype);
}

void key_row_to_f32(DType dtype, const std::byte* row, std::int64_t head_dim, float* out) {
  const auto n = static_cast<std::size_t>(head_dim);
  const std::span<const std::byte> bytes{
      row, static_cast<std::size_t>(dtype_row_bytes(dtype, head_dim))};
  if (!pairs_key_channels(dtype)) return convert_to_f32(dtype, bytes, {out, n});
  thread_local std::vector<float> stored;
  stored.resize(n);
  convert_to_f32(dtype, bytes, stored);
  for (std::int64_t d = 0; d < head_dim; ++d)
    out[d] = stored[static_cast<std::size_t>(paired_key_position(d, head_dim))];
}

void key_row_from_f32(DType dtype, const float* values, std::int64_t head_dim, std::byte* row) {
  const auto n = static_cast<std::size_t>(head_dim);
  const std::span<std::byte> bytes{row, static_cast<std::size_t>(dtype_row_bytes(dtype, head_dim))};
  if (!pairs_key_channels(dtype)) return convert_from_f32(dtype, {values, n}, bytes);
  thread_local std::vector<float> stored;
  stored.resize(n);
  for (std::int64_t d = 0; d < head_dim; ++d)
    stored[static_cast<std::size_t>(paired_key_position(d, head_dim))] = values[d];
  convert_from_f32(dtype, stored, bytes);
}

KvPool::KvPool(const KvPoolShape& shape, KvStorage storage) : shape_(shape) {
  if (shape.layers < 0 || shape.kv_heads < 0 || shape.head_dim < 0 || shape.slots < 0)
    throw Error(
        fmt::format("KV pool shape must be non-negative: {} layers, {} KV heads, head_dim "
                    "{}, {} slots",
                    shape.layers, shape.kv_heads, shape.head_dim, shape.slots));
  if (shape.hadamard_rotated &&
      (shape.head_dim <= 0 || (shape.head_dim & (shape.head_dim - 1)) != 0))
    throw Error(fmt::format(
        "a Hadamard-rotated KV pool needs head_dim to be a power of two, not {}", shape.head_dim));
  for (const bool value : {false, true})
    if (!dtype_row_fits(shape.dtype_of(value), shape.head_dim))
      throw Error(
          fmt::format("a {} KV pool needs head_dim to be a multiple of 32 (its blocks), not {}",
                      dtype_short_name(shape.dtype_of(value)), shape.head_dim));
  if (shape.splits_dtypes() && (dtype_is_kivi(shape.dtype) || dtype_is_kivi(shape.dtype_of(true))))
    throw Error(fmt::format(
        "KIVI quantizes K per channel and V per token at one width: K {} and V {} cannot be "
        "split (give kivi2 or kivi4 to both)",
        dtype_short_name(shape.dtype), dtype_short_name(shape.dtype_of(true))));
  if (!kivi_residual_valid(shape.kivi_residual))
    throw Error(fmt::format("a KIVI residual of {} tokens: a multiple of {} in [0, {}] expected",
                            shape.kivi_residual, kKiviGroup, kKiviResidualMost));
  const auto rows = checked_product<std::int64_t>({shape.layers, shape.slots, shape.kv_heads});
  const auto bytes = rows ? checked_product<std::int64_t>(
                                {*rows, shape.head_row_bytes(false) + shape.head_row_bytes(true)})
                          : std::nullopt;
  if (!bytes)
    throw Error(fmt::format("KV pool of {} slots x {} layers x {} floats overflows 64 bits",
                            shape.slots, shape.layers, shape.kv_heads * shape.head_dim));
  // Without storage the dtype only sizes swaps and memory (a simulated device's fp8 KV).
  if (storage == KvStorage::host) provide_host_storage();
}

void KvPool::provide_host_storage() {
  if (has_storage()) return;
  for (const bool value : {false, true})
    if (!kv_pool_holds(shape_.dtype_of(value)))
      throw Error(fmt::format("a KV pool holds {}, not {}", kv_pool_dtype_names(),
                              dtype_short_name(shape_.dtype_of(value))));
  const std::int64_t bytes = bytes_per_slot() * shape_.slots;  // checked in the constructor
  check_allocation(
      static_cast<std::uint64_t>(bytes),
      fmt::format("the KV pool ({} slots x {} layers x {} KV heads x head_dim {}, "
                  "K in {}, V in {}; kv_cache.slots or kv_cache.memory_mib)",
                  shape_.slots, shape_.layers, shape_.kv_heads, shape_.head_dim,
                  dtype_short_name(shape_.dtype), dtype_short_name(shape_.dtype_of(true))));
  if (bytes == 0) return;  // no slots: nothing to hold (has_storage() stays false)
  keys_ = allocate(shape_.layers * shape_.slots * shape_.slot_row_bytes(false));
  values_ = allocate(shape_.layers * shape_.slots * shape_.slot_row_bytes(true));
  if (dtype_is_kivi(shape_.dtype))
    open_groups_.resize(static_cast<std::size_t>((shape_.slots + kKiviGroup - 1) / kKiviGroup));
}

float* KvPool::as_floats(std::byte* p, bool value) const {
  if (shape_.dtype_of(value) != DType::dtype_f32)
    throw Error(fmt::format("internal: float access to a {} KV pool",
                            dtype_short_name(shape_.dtype_of(value))));
  return reinterpret_cast<float*>(p);
}

void KvPool::read_row(std::int64_t layer, std::int64_t slot, bool value, float* out) const {
  if (kivi()) return kivi_read_row(layer, slot, value, out);
  const std::byte* row = value ? value_bytes(layer, slot) : key_bytes(layer, slot);
  const auto hd = static_cast<std::size_t>(shape_.head_dim),
             head_bytes = static_cast<std::size_t>(shape_.head_row_bytes(value));
  for (std::int64_t h = 0; h < shape_.kv_heads; ++h, row += head_bytes, out += hd) {
    if (value)
      convert_to_f32(shape_.dtype_of(true), {row, head_bytes}, {out, hd});
    else
      key_row_to_f32(shape_.dtype, row, shape_.head_dim, out);
  }
}

void KvPool::write_row(std::int64_t layer, std::int64_t slot, bool value, const float* row) {
  if (kivi()) return kivi_write_row(layer, slot, value, row);
  std::byte* target = value ? value_bytes(layer, slot) : key_bytes(layer, slot);
  const auto hd = static_cast<std::size_t>(shape_.head_dim),
             head_bytes = static_cast<std::size_t>(shape_.head_row_bytes(value));
  for (std::int64_t h = 0; h < shape_.kv_heads; ++h, target += head_bytes, row += hd) {
    if (value)
      convert_from_f32(shape_.dtype_of(true), {row, hd}, {target, head_bytes});
    else
      key_row_from_f32(shape_.dtype, row, shape_.head_dim, target);
  }
}

void KvPool::read_head_rows(std::int64_t layer, std::int64_t slot, std::int64_t count, bool value,
                            std::int64_t head, float* out) const {
  if (kivi()) return kivi_read_head_rows(layer, slot, count, value, head, out);
  const std::int64_t hd = shape_.head_dim, offset = head * shape_.head_row_bytes(value);
  const auto head_bytes = static_cast<std::size_t>(shape_.head_row_bytes(value));
  for (std::int64_t j = 0; j < count; ++j, out += hd) {
    const std::byte* row =
        (value ? value_bytes(layer, slot + j) : key_bytes(layer, slot + j)) + offset;
    if (value)
      convert_to_f32(shape_.dtype_of(true), {row, head_bytes}, {out, static_cast<std::size_t>(hd)});
    else
      key_row_to_f32(shape_.dtype, row, hd, out);
  }
}

// AddressSanitizer checks heap blocks, not mappings: there the pool stays a heap block, so that
// a row written past its end is still reported.
#if defined(__SANITIZE_ADDRESS__)
#define KVLAB_POOL_ON_HEAP 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVLAB_POOL_ON_HEAP 1
#endif
#endif

void KvPool::Release::operator()(std::byte* p) const {
  if (p == nullptr) return;
  if (mapped_bytes == 0)
    std::free(p);
  else
    munmap(p, mapped_bytes);
}

KvPool::Buffer KvPool::allocate(std::int64_t size) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const auto bytes = static_cast<std::size_t>(size);
  const std::size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
#ifdef KVLAB_POOL_ON_HEAP
  void* heap = std::aligned_alloc(kHugePage, rounded);
  if (heap == nullptr)
    throw Error(fmt::format("cannot allocate {} bytes for the KV pool", rounded));
  std::fill_n(static_cast<std::byte*>(heap), rounded, std::byte{0});
  return Buffer(static_cast<std::byte*>(heap), Release());
#else
  // Map a huge page more than needed, then unmap the ends so the pool starts on a 2 MiB boundary.
  const std::size_t mapped = rounded + kHugePage;
  void* memory = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED)
    throw Error(fmt::format("cannot allocate {} bytes for the KV pool", rounded));
  auto* first = static_cast<std::byte*>(memory);
  const std::size_t lead =
      (kHugePage - reinterpret_cast<std::uintptr_t>(first) % kHugePage) % kHugePage;
  if (lead > 0) munmap(first, lead);
  munmap(first + lead + rounded, kHugePage - lead);  // lead < kHugePage: a tail is left
  std::byte* pool = first + lead;
#ifdef MADV_HUGEPAGE
  madvise(pool, rounded, MADV_HUGEPAGE);  // a hint: without huge pages it works as before
#endif
  return Buffer(pool, Release(rounded));  // zero-filled by the kernel, page by page on first touch
#endif
}

std::int64_t KvPool::bytes_per_slot() const {
  return shape_.layers * (shape_.slot_row_bytes(false) + shape_.slot_row_bytes(true));
}

std::int64_t KvPool::copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) {
  assert(source >= 0 && destination >= 0 && source + count <= shape_.slots &&
         destination + count <= shape_.slots);
  if (device_ != nullptr) device_->copy_slots(source, destination, count);
  if (!has_storage()) return count * bytes_per_slot();
  const auto key_bytes_count = static_cast<std::size_t>(count * shape_.slot_row_bytes(false)),
             value_bytes_count = static_cast<std::size_t>(count * shape_.slot_row_bytes(true));
  for (std::int64_t layer = 0; layer < shape_.layers; ++layer) {
    std::memmove(key_bytes(layer, destination), key_bytes(layer, source), key_bytes_count);
    std::memmove(value_bytes(layer, destination), value_bytes(layer, source), value_bytes_count);
  }
  if (kivi()) kivi_copy_groups(source, destination, count);
  return count * bytes_per_slot();
}

std::int64_t KvView::length() const {
  std::int64_t total = 0;
  for (const auto& e : extents) total += e.length;
  return total;
}

std::int64_t KvView::index_at_or_after(std::int64_t position) const {
  if (positions.empty()) return std::clamp(position - first_position, std::int64_t{0}, length());
  return std::lower_bound(positions.begin(), positions.end(), position) - positions.begin();
}

std::int64_t KvView::slot_at(std::int64_t index) const {
  for (const auto& e : extents) {
    if (index < e.length) return e.start_slot + index;
    index -= e.length;
  }
  assert(false && "KvView::slot_at: index outside the view");
  return -1;
}

std::int64_t KvView::slot_of(std::int64_t position) const {
  const std::int64_t index = index_at_or_after(position);
  assert(index < length() && position_at(index) == position && "KvView::slot_of: not held");
  return slot_at(index);
}

}  // namespace kvlab
