#include "kvlab/kv/block_table.hpp"

#include <algorithm>

namespace kvlab {

PagedBlocks::PagedBlocks(KvPool& pool, std::int64_t block_size, bool caching,
                         EvictionOrder reuse_order)
    : kv_(pool),
      block_size_(block_size),
      blocks_(pool.shape().slots / block_size, block_size, caching, reuse_order) {}

BlockId PagedBlocks::take() {
  const BlockId b = blocks_.take();
  kv_.discard_open_groups(std::int64_t{b} * block_size_, block_size_);
  return b;
}

void PagedBlocks::release(BlockId b) {
  blocks_.release(b);
  if (blocks_.ref_count(b) > 0) return;
  if (blocks_.hash_of(b) != 0)  // kept in the prefix cache: its KIVI groups quantized for reuse
    kv_.seal_open_groups(std::int64_t{b} * block_size_, block_size_);
  else
    kv_.discard_open_groups(std::int64_t{b} * block_size_, block_size_);
}

void PagedBlocks::hold_all(const BlockTable& table) {
  for (BlockId b : table.blocks)
    if (b >= 0) blocks_.hold(b);
}

void PagedBlocks::release_all(const BlockTable& table) {
  for (auto b = table.blocks.rbegin(); b != table.blocks.rend(); ++b)
    if (*b >= 0) release(*b);
}

// A copy of block b's first `slots` slots in a block of its own, b released.
BlockId PagedBlocks::copy_of(BlockId b, std::int64_t slots) {
  const BlockId copy = take();
  bytes_copied_ +=
      kv_.copy_slots(std::int64_t{b} * block_size_, std::int64_t{copy} * block_size_, slots);
  release(b);
  if (copied_.empty()) copied_.resize(static_cast<std::size_t>(blocks_.blocks()));
  copied_[static_cast<std::size_t>(copy)] = true;
  return copy;
}

std::vector<bool> PagedBlocks::take_copied() {
  std::vector<bool> copied(static_cast<std::size_t>(blocks_.blocks()), false);
  copied.swap(copied_);
  copied.resize(static_cast<std::size_t>(blocks_.blocks()), false);
  return copied;
}

void PagedBlocks::reserve(BlockTable& t, std::int64_t slots) {
  const std::int64_t needed = blocks_for(slots);
  while (static_cast<std::int64_t>(t.blocks.size()) < needed) t.blocks.push_back(take());
}

void PagedBlocks::fill_from(const BlockTable& t, std::int64_t from) {
  detail::fill_blocks(blocks_, t, from, written_blocks(t));
}

void PagedBlocks::release_before(BlockTable& t, std::int64_t position) {
  if (t.dropped_positions()) {   // positions before `position` dropped like an eviction's
    if (!own_blocks(t)) return;  // no room to unshare: nothing freed (allowed)
    for (std::int64_t& p : t.slot_positions)
      if (p < position) p = -1;
    return release_dropped(t);
  }
  const std::int64_t whole_blocks = std::min(position, t.length) / block_size_;
  if (t.first_block >= whole_blocks) return;
  for (; t.first_block < whole_blocks; ++t.first_block) {
    release(t.blocks[index(t.first_block)]);
    t.blocks[index(t.first_block)] = -1;
  }
  rebuild_view(t);
}

bool PagedBlocks::drop_positions(BlockTable& t, std::span<const std::int64_t> kept) {
  if (!own_blocks(t)) return false;
  number_slots(t);
  std::size_t k = 0;
  for (std::int64_t& p : t.slot_positions) {
    if (p < 0) continue;
    while (k < kept.size() && kept[k] < p) ++k;
    if (k == kept.size() || kept[k] != p) p = -1;
  }
  release_dropped(t);
  return true;
}

// Whole blocks past the new end are released (last first); a cut inside a block leaves it the
// table's last, partly filled. Blocks mark_computed registered are never cut, so no hash of a
// rolled-back token is in the prefix cache, and a cut inside a shared block is refused: its
// other holders see its fill.
bool PagedBlocks::truncate(BlockTable& t, std::int64_t length) {
  if (length < 0 || length > t.length || length < t.computed_blocks * block_size_) return false;
  if (t.dropped_positions()) return truncate_dropped(t, length);
  if (length < t.first_block * block_size_) return false;
  const std::int64_t keep = blocks_for(length);
  if (length < t.length && length % block_size_ != 0 &&
      blocks_.ref_count(t.blocks[index(keep - 1)]) > 1)
    return false;
  while (static_cast<std::int64_t>(t.blocks.size()) > keep) {
    release(t.blocks.back());
    t.blocks.pop_back();
  }
  t.length = t.slots = length;
  t.tokens.resize(index(length));
  t.hashes.resize(std::min(t.hashes.size(), index(length / block_size_)));
  if (keep > 0 && t.blocks.back() >= 0)
    blocks_.set_fill(t.blocks.back(), length - (keep - 1) * block_size_);
  rebuild_view(t);
  return true;
}

// A table with dropped positions holds its positions in increasing slot order, the appended
// ones last: the slots of positions from `length` on are given back from the end, and the
// dropped slots before them (the table then ends at a held slot, in a held block, or is empty).
bool PagedBlocks::truncate_dropped(BlockTable& t, std::int64_t length) {
  std::int64_t slots = t.slots;
  while (slots > 0 &&
         (t.slot_positions[index(slots - 1)] >= length || t.slot_positions[index(slots - 1)] < 0))
    --slots;
  const std::int64_t keep = blocks_for(slots);
  if (slots < t.slots && slots % block_size_ != 0 &&
      blocks_.ref_count(t.blocks[index(keep - 1)]) > 1)
    return false;
  while (static_cast<std::int64_t>(t.blocks.size()) > keep) {
    if (t.blocks.back() >= 0) release(t.blocks.back());
    t.blocks.pop_back();
  }
  t.slots = slots;
  t.slot_positions.resize(index(slots));
  t.length = length;
  t.tokens.resize(index(length));
  t.hashes.resize(std::min(t.hashes.size(), index(length / block_size_)));
  rebuild_view(t);
  return true;
}

void PagedBlocks::rebuild_view(BlockTable& t) {
  t.view.extents.clear();
  t.view.positions.clear();
  if (t.dropped_positions()) return rebuild_dropped_view(t);
  t.view.first_position = t.first_block * block_size_;
  detail::extend_view(t, t.first_block, written_blocks(t), block_size_);
}

// A table that has dropped positions: its held slots in order with their positions, and each
// block's fill the slots it still holds.
void PagedBlocks::rebuild_dropped_view(BlockTable& t) {
  auto& extents = t.view.extents;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(t.blocks.size()); ++b) {
    if (t.blocks[index(b)] < 0) continue;
    std::int64_t fill = 0;
    for (std::int64_t i = b * block_size_; i < std::min(t.slots, (b + 1) * block_size_); ++i) {
      const std::int64_t position = t.slot_positions[index(i)];
      if (position < 0) continue;
      const std::int64_t slot = std::int64_t{t.blocks[index(b)]} * block_size_ + i % block_size_;
      if (!extents.empty() && extents.back().start_slot + extents.back().length == slot)
        ++extents.back().length;
      else
        extents.push_back({slot, 1});
      t.view.positions.push_back(position);
      ++fill;
    }
    blocks_.set_fill(t.blocks[index(b)], fill);
  }
  t.view.first_position = t.view.positions.empty() ? t.length : t.view.positions.front();
}

// Before its first drop, a table's slot index i holds position i (or nothing, in a block a
// sliding window released): slot_positions says so from now on.
void PagedBlocks::number_slots(BlockTable& t) const {
  if (t.dropped_positions() || t.slots == 0) return;
  t.slot_positions.resize(index(t.slots));
  for (std::int64_t i = 0; i < t.slots; ++i)
    t.slot_positions[index(i)] = t.blocks[index(i / block_size_)] < 0 ? -1 : i;
  t.first_block = 0;  // released blocks are the table's -1 entries from now on
}

// After positions were dropped: blocks holding none are released (the last one excepted: the
// next token goes there); once the dropped slots in held blocks make a whole block, the held
// slots move down into the first held blocks, in order, and the blocks left empty go.
void PagedBlocks::release_dropped(BlockTable& t) {
  std::int64_t dropped = 0;
  const auto blocks = static_cast<std::int64_t>(t.blocks.size());
  for (std::int64_t b = 0; b < blocks; ++b) {
    if (t.blocks[index(b)] < 0) continue;
    const std::int64_t end = std::min(t.slots, (b + 1) * block_size_);
    std::int64_t held = 0;
    for (std::int64_t i = b * block_size_; i < end; ++i) held += t.slot_positions[index(i)] >= 0;
    if (held == 0 && b + 1 < blocks) {
      release(t.blocks[index(b)]);
      t.blocks[index(b)] = -1;
    } else {
      dropped += end - b * block_size_ - held;
    }
  }
  if (dropped >= block_size_) compact(t);
  rebuild_view(t);
}

// Copies each block the table shares (a fork's) into one of its own, so that dropping positions
// leaves the other holders' KV and fills alone; false (nothing changed) when too few are free.
bool PagedBlocks::own_blocks(BlockTable& t) {
  const auto shared = std::count_if(t.blocks.begin(), t.blocks.end(),
                                    [&](BlockId b) { return b >= 0 && blocks_.ref_count(b) > 1; });
  if (shared > blocks_.free_blocks()) return false;
  for (BlockId& b : t.blocks) {
    if (b < 0 || blocks_.ref_count(b) == 1) continue;
    const std::int64_t fill = blocks_.fill(b);
    b = copy_of(b, block_size_);
    blocks_.set_fill(b, fill);
  }
  return true;
}

// Moves each held slot to the next free place in the table's (own) held blocks, in order (never
// up: no slot is overwritten before it is read).
void PagedBlocks::compact(BlockTable& t) {
  std::vector<BlockId> held_blocks;
  for (BlockId b : t.blocks)
    if (b >= 0) held_blocks.push_back(b);
  std::vector<std::int64_t> positions;
  for (std::int64_t i = 0; i < t.slots; ++i) {
    const std::int64_t position = t.slot_positions[index(i)];
    if (position < 0) continue;
    const auto d = static_cast<std::int64_t>(positions.size());
    const std::int64_t from =
        std::int64_t{t.blocks[index(i / block_size_)]} * block_size_ + i % block_size_;
    const std::int64_t to =
        std::int64_t{held_blocks[index(d / block_size_)]} * block_size_ + d % block_size_;
    if (from != to) bytes_copied_ += kv_.move_slot(from, to);
    positions.push_back(position);
  }
  const auto kept_blocks = blocks_for(static_cast<std::int64_t>(positions.size()));
  for (std::size_t b = index(kept_blocks); b < held_blocks.size(); ++b) release(held_blocks[b]);
  held_blocks.resize(index(kept_blocks));
  t.blocks = std::move(held_blocks);
  t.slots = static_cast<std::int64_t>(positions.size());
  t.slot_positions = std::move(positions);
}

}  // namespace kvlab
