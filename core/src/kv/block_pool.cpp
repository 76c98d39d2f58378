#include "kvlab/kv/block_pool.hpp"

#include <algorithm>
#include <bit>

#include "kvlab/error.hpp"

namespace kvlab {

BlockHashIndex::BlockHashIndex(std::int64_t max_entries) {
  std::size_t slots = 16;
  while (slots < 2 * static_cast<std::size_t>(std::max<std::int64_t>(max_entries, 1))) slots *= 2;
  entries_.assign(slots, Entry{});
  mask_ = slots - 1;
  shift_ = 64 - std::countr_zero(slots);
}

std::optional<BlockId> BlockHashIndex::find(std::uint64_t hash) const {
  if (hash == 0) return std::nullopt;
  const Entry& e = entries_[probe(hash)];
  if (e.hash == 0) return std::nullopt;
  return e.block;
}

bool BlockHashIndex::insert(std::uint64_t hash, BlockId block) {
  if (hash == 0) return false;
  if (static_cast<std::size_t>(2 * (size_ + 1)) > entries_.size())
    throw Error("internal: the block hash index holds one entry a block, and is full");
  Entry& e = entries_[probe(hash)];
  if (e.hash == hash) return false;
  e = {hash, block};
  ++size_;
  return true;
}

void BlockHashIndex::grow_if_full() {
  if (static_cast<std::size_t>(2 * (size_ + 1)) <= entries_.size()) return;
  BlockHashIndex bigger(static_cast<std::int64_t>(entries_.size()));  // twice the slots
  for (const Entry& e : entries_)
    if (e.hash != 0) bigger.insert(e.hash, e.block);
  *this = std::move(bigger);
}

bool BlockHashIndex::insert_growing(std::uint64_t hash, BlockId block) {
  grow_if_full();
  return insert(hash, block);
}

// Backward-shift deletion: each later entry of the probe run that may sit in the hole moves up,
// so no lookup ever stops early at it.
void BlockHashIndex::erase(std::uint64_t hash) {
  if (hash == 0) return;
  std::size_t hole = probe(hash);
  if (entries_[hole].hash == 0) return;
  for (std::size_t next = (hole + 1) & mask_; entries_[next].hash != 0; next = (next + 1) & mask_) {
    const std::size_t wanted = home(entries_[next].hash);
    // The entry at `next` may fill the hole when its home is not in (hole, next] (cyclically).
    if (((next - wanted) & mask_) >= ((next - hole) & mask_)) {
      entries_[hole] = entries_[next];
      hole = next;
    }
  }
  entries_[hole] = Entry{};
  --size_;
}

BlockPool::BlockPool(std::int64_t blocks, std::int64_t block_size, bool caching,
                     EvictionOrder reuse_order)
    : block_size_(block_size),
      caching_(caching),
      reusable_(caching ? blocks : 0, reuse_order),
      blocks_(static_cast<std::size_t>(blocks)) {
  // Taken from the back: blocks 0, 1, 2, ... come out in order, so fresh sequences get
  // physically adjacent blocks (their views merge into few extents).
  free_plain_.reserve(blocks_.size());
  for (auto b = static_cast<BlockId>(blocks) - 1; b >= 0; --b) free_plain_.push_back(b);
  if (caching_) {
    tokens_.resize(static_cast<std::size_t>(blocks * block_size));
    cache_ = BlockHashIndex(blocks);  // at most one entry a block
  }
}

BlockId BlockPool::take() {
  BlockId b;
  if (!free_plain_.empty()) {
    b = free_plain_.back();
    free_plain_.pop_back();
  } else {  // reuse a cached block: its prefix is forgotten
    b = reusable_.victim();
    const Block& evicted = blocks_[index(b)];
    if (sink_ != nullptr)
      sink_->evicted(b, evicted.hash, tokens_of(b), evicted.uses, evicted.position);
    cache_.erase(evicted.hash);
    blocks_[index(b)].hash = 0;
    ++evictions_;
  }
  blocks_[index(b)].ref_count = 1;
  blocks_[index(b)].uses = 1;
  blocks_[index(b)].fill = 0;  // (a free block's fill is not in live_fill_)
  return b;
}

void BlockPool::hold(BlockId b) {
  Block& block = blocks_[index(b)];
  if (block.ref_count == 0) {  // a free cached block comes back to life
    reusable_.remove(b);
    live_fill_ += block.fill;
  }
  ++block.ref_count;
  ++block.uses;
}

void BlockPool::release(BlockId b) {
  Block& block = blocks_[index(b)];
  if (--block.ref_count > 0) return;
  live_fill_ -= block.fill;
  if (block.hash != 0)
    reusable_.add(b, {++clock_, block.uses});
  else
    free_plain_.push_back(b);
}

std::span<const std::int32_t> BlockPool::tokens_of(BlockId b) const {
  const auto size = static_cast<std::size_t>(block_size_);
  return std::span<const std::int32_t>(tokens_).subspan(index(b) * size, size);
}

std::optional<BlockId> BlockPool::cached(std::uint64_t hash,
                                         std::span<const std::int32_t> tokens) const {
  const std::optional<BlockId> found = cache_.find(hash);
  if (!found) return std::nullopt;
  const std::span<const std::int32_t> held = tokens_of(*found);
  if (!std::equal(held.begin(), held.end(), tokens.begin(), tokens.end())) return std::nullopt;
  return found;
}

void BlockPool::register_prefix(BlockId b, std::uint64_t hash, std::span<const std::int32_t> tokens,
                                std::int64_t position) {
  Block& block = blocks_[index(b)];
  if (!caching_ || block.hash != 0 || !cache_.insert(hash, b)) return;
  block.hash = hash;
  block.position = position;
  std::copy(tokens.begin(), tokens.end(),
            tokens_.begin() +
                static_cast<std::ptrdiff_t>(index(b) * static_cast<std::size_t>(block_size_)));
}

void BlockPool::set_fill(BlockId b, std::int64_t fill) {
  Block& block = blocks_[index(b)];
  live_fill_ += fill - block.fill;
  block.fill = fill;
}

}  // namespace kvlab
