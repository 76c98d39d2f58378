#include "kvlab/kv/block_pool.hpp"

#include <algorithm>

namespace kvlab {

LruEviction::LruEviction(std::int64_t blocks)
    : previous_(static_cast<std::size_t>(blocks), -1),
      next_(static_cast<std::size_t>(blocks), -1) {}

void LruEviction::add(BlockId block) {
  const auto b = static_cast<std::size_t>(block);
  previous_[b] = tail_;
  next_[b] = -1;
  if (tail_ >= 0)
    next_[static_cast<std::size_t>(tail_)] = block;
  else
    head_ = block;
  tail_ = block;
  ++size_;
}

void LruEviction::remove(BlockId block) {
  const auto b = static_cast<std::size_t>(block);
  if (previous_[b] >= 0)
    next_[static_cast<std::size_t>(previous_[b])] = next_[b];
  else
    head_ = next_[b];
  if (next_[b] >= 0)
    previous_[static_cast<std::size_t>(next_[b])] = previous_[b];
  else
    tail_ = previous_[b];
  previous_[b] = next_[b] = -1;
  --size_;
}

BlockId LruEviction::victim() {
  const BlockId block = head_;
  remove(block);
  return block;
}

BlockPool::BlockPool(std::int64_t blocks, std::int64_t block_size, bool caching,
                     std::unique_ptr<EvictionPolicy> policy)
    : block_size_(block_size),
      caching_(caching),
      policy_(policy ? std::move(policy) : std::make_unique<LruEviction>(blocks)),
      blocks_(static_cast<std::size_t>(blocks)) {
  // Taken from the back: blocks 0, 1, 2, ... come out in order, so fresh sequences get
  // physically adjacent blocks (their views merge into few extents).
  free_plain_.reserve(blocks_.size());
  for (auto b = static_cast<BlockId>(blocks) - 1; b >= 0; --b) free_plain_.push_back(b);
  if (caching_) {
    tokens_.resize(static_cast<std::size_t>(blocks * block_size));
    cache_.reserve(blocks_.size());  // at most one entry a block: never rehashed
  }
}

BlockId BlockPool::take() {
  BlockId b;
  if (!free_plain_.empty()) {
    b = free_plain_.back();
    free_plain_.pop_back();
  } else {  // reuse a cached block: its prefix is forgotten
    b = policy_->victim();
    cache_.erase(blocks_[index(b)].hash);
    blocks_[index(b)].hash = 0;
    ++evictions_;
  }
  blocks_[index(b)].ref_count = 1;
  blocks_[index(b)].fill = 0;  // (a free block's fill is not in live_fill_)
  return b;
}

void BlockPool::hold(BlockId b) {
  Block& block = blocks_[index(b)];
  if (block.ref_count == 0) {  // a free cached block comes back to life
    policy_->remove(b);
    live_fill_ += block.fill;
  }
  ++block.ref_count;
}

void BlockPool::release(BlockId b) {
  Block& block = blocks_[index(b)];
  if (--block.ref_count > 0) return;
  live_fill_ -= block.fill;
  if (block.hash != 0)
    policy_->add(b);
  else
    free_plain_.push_back(b);
}

std::span<const std::int32_t> BlockPool::tokens_of(BlockId b) const {
  const auto size = static_cast<std::size_t>(block_size_);
  return std::span<const std::int32_t>(tokens_).subspan(index(b) * size, size);
}

std::optional<BlockId> BlockPool::cached(std::uint64_t hash,
                                         std::span<const std::int32_t> tokens) const {
  const auto it = cache_.find(hash);
  if (it == cache_.end()) return std::nullopt;
  const std::span<const std::int32_t> held = tokens_of(it->second);
  if (!std::equal(held.begin(), held.end(), tokens.begin(), tokens.end())) return std::nullopt;
  return it->second;
}

void BlockPool::register_prefix(BlockId b, std::uint64_t hash,
                                std::span<const std::int32_t> tokens) {
  Block& block = blocks_[index(b)];
  if (!caching_ || block.hash != 0 || !cache_.try_emplace(hash, b).second) return;
  block.hash = hash;
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
