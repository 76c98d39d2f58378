// KvPool's KIVI groups (kvlab/kv_pool.hpp, kvlab/kv/kivi_groups.hpp): the open groups' fp16
// rows beside the pool, sealed into per-channel key codes and per-token value rows.
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "kvlab/error.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv_pool.hpp"

namespace kvlab {
namespace {

void widen_halves(const std::uint16_t* halves, std::int64_t n, float* out) {
  convert_to_f32(DType::dtype_f16,
                 {reinterpret_cast<const std::byte*>(halves), static_cast<std::size_t>(2 * n)},
                 {out, static_cast<std::size_t>(n)});
}

void round_to_halves(const float* values, std::int64_t n, std::uint16_t* out) {
  convert_from_f32(DType::dtype_f16, {values, static_cast<std::size_t>(n)},
                   {reinterpret_cast<std::byte*>(out), static_cast<std::size_t>(2 * n)});
}

constexpr std::size_t kMostSpareGroups = 64;

}  // namespace

std::int64_t KvPool::bytes_per_open_group() const {
  return 2 * shape_.layers * kKiviGroup * shape_.slot_width() * 2;
}

std::int64_t KvPool::open_group_bytes() const {
  return open_count_ * bytes_per_open_group();
}

std::uint16_t* KvPool::group_row(OpenGroup& group, std::int64_t layer, bool value,
                                 std::int64_t r) const {
  const std::int64_t half = 2 * layer + (value ? 1 : 0);
  return group.rows.data() + (half * kKiviGroup + r) * shape_.slot_width();
}

const std::uint16_t* KvPool::open_row(std::int64_t layer, std::int64_t slot, bool value) const {
  if (!kivi()) return nullptr;
  const auto& group = open_groups_[static_cast<std::size_t>(slot / kKiviGroup)];
  if (!group || group->open[static_cast<std::size_t>(2 * layer + (value ? 1 : 0))] == 0)
    return nullptr;
  return group_row(*group, layer, value, slot % kKiviGroup);
}

void KvPool::discard_open_groups(std::int64_t first_slot, std::int64_t count) {
  if (!kivi()) return;
  const std::int64_t end = (first_slot + count) / kKiviGroup;
  for (std::int64_t g = (first_slot + kKiviGroup - 1) / kKiviGroup; g < end; ++g) release_group(g);
}

void KvPool::release_group(std::int64_t group) {
  auto& open = open_groups_[static_cast<std::size_t>(group)];
  if (!open) return;
  if (spare_groups_.size() < kMostSpareGroups) spare_groups_.push_back(std::move(open));
  open.reset();
  --open_count_;
}

// The (layer, K or V) half of `group` made open for a write of row r: the group's fp16 rows
// taken (a spare's, or new) when it has none; a sealed half's rows dequantized into them unless
// the write starts the group (r = 0: the rows before it are nobody's).
KvPool::OpenGroup& KvPool::reopen(std::int64_t group, std::int64_t layer, bool value,
                                  std::int64_t r) {
  auto& open = open_groups_[static_cast<std::size_t>(group)];
  if (!open) {
    if (spare_groups_.empty()) {
      open = std::make_unique<OpenGroup>();
      open->rows.resize(static_cast<std::size_t>(bytes_per_open_group() / 2));
    } else {
      open = std::move(spare_groups_.back());
      spare_groups_.pop_back();
    }
    open->open.assign(static_cast<std::size_t>(2 * shape_.layers), 0);
    ++open_count_;
  }
  std::uint8_t& flag = open->open[static_cast<std::size_t>(2 * layer + (value ? 1 : 0))];
  if (flag == 0 && r != 0) fill_from_slots(*open, group, layer, value);
  flag = 1;
  return *open;
}

void KvPool::fill_from_slots(OpenGroup& open, std::int64_t group, std::int64_t layer,
                             bool value) const {
  std::vector<float> rows(static_cast<std::size_t>(kKiviGroup * shape_.head_dim));
  for (std::int64_t h = 0; h < shape_.kv_heads; ++h) {
    kivi_read_head_rows(layer, group * kKiviGroup, kKiviGroup, value, h, rows.data());
    for (std::int64_t r = 0; r < kKiviGroup; ++r)
      round_to_halves(rows.data() + r * shape_.head_dim, shape_.head_dim,
                      group_row(open, layer, value, r) + h * shape_.head_dim);
  }
}

// Quantizes the open half's 32 rows into the slot rows: keys per channel, values per token.
void KvPool::seal(std::int64_t group, std::int64_t layer, bool value) {
  OpenGroup& open = *open_groups_[static_cast<std::size_t>(group)];
  const std::int64_t hd = shape_.head_dim, width = shape_.slot_width(), first = group * kKiviGroup;
  std::vector<float> rows(static_cast<std::size_t>(kKiviGroup * width));  // (32, slot_width)
  for (std::int64_t r = 0; r < kKiviGroup; ++r)
    widen_halves(group_row(open, layer, value, r), width, rows.data() + r * width);
  // K and V rows are as long (KIVI sets both): one head row's bytes and stride serve both.
  const std::int64_t head_bytes = shape_.head_row_bytes(false),
                     stride = shape_.slot_row_bytes(false);
  if (value) {
    for (std::int64_t r = 0; r < kKiviGroup; ++r)
      convert_from_f32(shape_.dtype, {rows.data() + r * width, static_cast<std::size_t>(width)},
                       {value_bytes(layer, first + r), static_cast<std::size_t>(stride)});
  } else {
    std::vector<float> head(static_cast<std::size_t>(kKiviGroup * hd));  // (32, hd)
    for (std::int64_t h = 0; h < shape_.kv_heads; ++h) {
      for (std::int64_t r = 0; r < kKiviGroup; ++r)
        std::copy_n(rows.data() + r * width + h * hd, hd, head.data() + r * hd);
      kivi_seal_key_group(kivi_bits(shape_.dtype), head.data(), hd,
                          key_bytes(layer, first) + h * head_bytes, stride);
    }
  }
  open.open[static_cast<std::size_t>(2 * layer + (value ? 1 : 0))] = 0;
  if (std::all_of(open.open.begin(), open.open.end(), [](std::uint8_t o) { return o == 0; }))
    release_group(group);
}

void KvPool::kivi_write_row(std::int64_t layer, std::int64_t slot, bool value, const float* row) {
  const std::int64_t group = slot / kKiviGroup, r = slot % kKiviGroup;
  OpenGroup& open = reopen(group, layer, value, r);
  round_to_halves(row, shape_.slot_width(), group_row(open, layer, value, r));
}

std::int64_t KvPool::move_slot(std::int64_t source, std::int64_t destination) {
  // (Even at the same row of another group a copy would not do: copying part of a sealed group
  // moves all 32 of its rows, over the destination's other rows.)
  if (!kivi() || source == destination) return copy_slots(source, destination, 1);
  std::vector<float> row(static_cast<std::size_t>(shape_.slot_width()));
  for (std::int64_t layer = 0; layer < shape_.layers; ++layer)
    for (const bool value : {false, true}) {
      kivi_read_row(layer, source, value, row.data());
      kivi_write_row(layer, destination, value, row.data());
    }
  return bytes_per_slot();
}

void KvPool::seal_open_groups(std::int64_t first_slot, std::int64_t count) {
  if (!kivi() || count <= 0) return;
  for (std::int64_t group = first_slot / kKiviGroup; group <= (first_slot + count - 1) / kKiviGroup;
       ++group) {
    const auto& open = open_groups_[static_cast<std::size_t>(group)];  // null once all sealed
    for (std::int64_t half = 0; open && half < 2 * shape_.layers; ++half)
      if (open->open[static_cast<std::size_t>(half)] != 0) seal(group, half / 2, half % 2 == 1);
  }
}

void KvPool::kivi_read_row(std::int64_t layer, std::int64_t slot, bool value, float* out) const {
  if (const std::uint16_t* open = open_row(layer, slot, value))
    return widen_halves(open, shape_.slot_width(), out);
  for (std::int64_t h = 0; h < shape_.kv_heads; ++h)
    kivi_read_head_rows(layer, slot, 1, value, h, out + h * shape_.head_dim);
}

void KvPool::kivi_read_head_rows(std::int64_t layer, std::int64_t slot, std::int64_t count,
                                 bool value, std::int64_t head, float* out) const {
  const std::int64_t hd = shape_.head_dim, head_bytes = shape_.head_row_bytes(value);
  const std::int64_t stride = shape_.slot_row_bytes(value), offset = head * head_bytes;
  std::vector<float> scales(static_cast<std::size_t>(hd)), mins(scales.size());
  for (std::int64_t done = 0; done < count;) {  // one group's rows at a time
    const std::int64_t at = slot + done, r0 = at % kKiviGroup;
    const std::int64_t n = std::min(count - done, kKiviGroup - r0);
    float* rows = out + done * hd;
    if (const std::uint16_t* open = open_row(layer, at, value)) {
      for (std::int64_t j = 0; j < n; ++j)
        widen_halves(open + j * shape_.slot_width() + head * hd, hd, rows + j * hd);
    } else if (value) {
      for (std::int64_t j = 0; j < n; ++j)
        convert_to_f32(shape_.dtype,
                       {value_bytes(layer, at + j) + offset, static_cast<std::size_t>(head_bytes)},
                       {rows + j * hd, static_cast<std::size_t>(hd)});
    } else {
      const int bits = kivi_bits(shape_.dtype);
      kivi_key_params(bits, key_bytes(layer, at - r0) + offset, stride, hd, scales.data(),
                      mins.data());
      for (std::int64_t j = 0; j < n; ++j)
        kivi_key_row_to_f32(bits, key_bytes(layer, at + j) + offset, hd, scales.data(), mins.data(),
                            rows + j * hd);
    }
    done += n;
  }
}

// After copy_slots moved the slot bytes: each destination group gets its source's open rows
// (or, for a sealed source, its whole group's slot rows, where the copy took part of them: the
// params are spread over all 32).
void KvPool::kivi_copy_groups(std::int64_t source, std::int64_t destination, std::int64_t count) {
  if (source == destination || count == 0) return;
  if ((source - destination) % kKiviGroup != 0)
    throw Error(fmt::format(
        "internal: a KIVI KV pool copies slots between groups of {} (from slot {} to {})",
        kKiviGroup, source, destination));
  const std::int64_t shift = (destination - source) / kKiviGroup;
  const std::int64_t first = source / kKiviGroup, last = (source + count - 1) / kKiviGroup;
  for (std::int64_t i = 0; i <= last - first; ++i) {  // in memmove's order
    const std::int64_t from = shift > 0 ? last - i : first + i, to = from + shift;
    const std::int64_t r0 = std::max(source, from * kKiviGroup) - from * kKiviGroup;
    const std::int64_t r1 = std::min(source + count, (from + 1) * kKiviGroup) - from * kKiviGroup;
    OpenGroup* open = open_groups_[static_cast<std::size_t>(from)].get();
    for (std::int64_t layer = 0; layer < shape_.layers; ++layer)
      for (const bool value : {false, true}) {
        if (open != nullptr && open->open[static_cast<std::size_t>(2 * layer + value)] != 0) {
          OpenGroup& target = reopen(to, layer, value, r0);
          for (std::int64_t r = r0; r < r1; ++r)
            std::copy_n(group_row(*open, layer, value, r), shape_.slot_width(),
                        group_row(target, layer, value, r));
          continue;
        }
        if (r1 - r0 < kKiviGroup) {  // part of a sealed group: all of its rows
          const auto bytes = static_cast<std::size_t>(kKiviGroup * shape_.slot_row_bytes(value));
          std::memmove(
              value ? value_bytes(layer, to * kKiviGroup) : key_bytes(layer, to * kKiviGroup),
              value ? value_bytes(layer, from * kKiviGroup) : key_bytes(layer, from * kKiviGroup),
              bytes);
        }
        if (auto& target = open_groups_[static_cast<std::size_t>(to)])
          target->open[static_cast<std::size_t>(2 * layer + value)] = 0;
      }
    auto& target = open_groups_[static_cast<std::size_t>(to)];
    if (target && std::all_of(target->open.begin(), target->open.end(),
                              [](std::uint8_t o) { return o == 0; }))
      release_group(to);
  }
}

}  // namespace kvlab
