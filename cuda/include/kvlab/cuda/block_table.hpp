#pragma once
// A sequence's K/V slots as the attention kernels look them up (AttentionEntry, kernels.hpp): a
// table of block start slots, each block 2^shift consecutive slots, the sequence's first token
// `lead` slots into its first block. Built on the host from an allocator's KvView in
// O(extents + blocks), not O(tokens): a paged allocator's view becomes its own block table, a
// contiguous one a single entry. Host code only (the backend and its tests).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvlab/kv_pool.hpp"

namespace kvlab::cuda {

struct BlockLayout {
  std::int32_t shift = 0;  // blocks of 2^shift slots
  std::int32_t lead = 0;   // the first token's offset in the first block
};

// The largest power-of-two block in which every extent of `view` but the first starts on a
// block boundary and every extent but the last ends on one: the interior extents' lengths are
// multiples of it, and the first extent is shifted by `lead` to end on a boundary. Without
// interior extents, one block holds the first extent and ceil(last / block) the last.
inline BlockLayout block_layout(const KvView& view) {
  constexpr std::int32_t kMaxShift = 30;
  const std::vector<KvExtent>& x = view.extents;
  if (x.empty()) return {};
  std::int64_t interior = 0;  // gcd of the lengths between the first and the last extent
  for (std::size_t i = 1; i + 1 < x.size(); ++i) interior = std::gcd(interior, x[i].length);
  std::int32_t shift = 0;
  if (interior > 0) {
    shift = std::countr_zero(static_cast<std::uint64_t>(interior));
  } else {
    const std::int64_t longest = std::max(x.front().length, x.back().length);
    shift = static_cast<std::int32_t>(std::bit_width(static_cast<std::uint64_t>(longest - 1)));
  }
  shift = std::min(shift, kMaxShift);
  const std::int64_t block = std::int64_t{1} << shift;
  const std::int64_t lead = x.size() > 1 ? (block - x.front().length % block) % block : 0;
  return {shift, static_cast<std::int32_t>(lead)};
}

// Appends the block start slots of `view` under `layout` to `table`: virtual offset
// v = position - first_position + lead lives in slot table[v >> shift] + (v & (2^shift - 1)).
// (The first block's start may lie `lead` slots before the extent: those slots are never read.)
inline void append_block_table(const KvView& view, const BlockLayout& layout,
                               std::vector<std::int64_t>& table) {
  const std::int64_t block = std::int64_t{1} << layout.shift;
  std::int64_t v = layout.lead;  // the virtual offset of the extent's first slot
  for (const KvExtent& e : view.extents) {
    for (std::int64_t b = v / block * block; b < v + e.length; b += block)
      table.push_back(e.start_slot + (b - v));
    v += e.length;
  }
}

}  // namespace kvlab::cuda
