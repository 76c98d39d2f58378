#pragma once
// Block tables over one paged pool (vLLM v1 splits its KV manager the same way: the BlockPool,
// the per-request block tables with their views, and the manager that plans and commits).
//
// A BlockTable is one sequence's blocks: slot index i of the sequence is slot i % block_size of
// block blocks[i / block_size]. Until positions are dropped (a KV policy's evict), slot index i
// holds position i; after, slot_positions says which position each holds (-1: dropped) and
// `slots` counts the indices in use.
//
// PagedBlocks owns the BlockPool and is the one way a table takes, gives back, copies or drops
// blocks: every block that leaves or joins a table passes take/release here (a KIVI pool forgets
// the open key groups a freed block held), every KV byte moved between blocks (copy-on-write,
// a fork's blocks unshared, a KV policy's compaction) is counted here, and each table's view
// (KvView: slot extents and, after drops, positions) is kept up to date by the change that
// moved it. paged_allocator.cpp keeps what is an allocator's: planning, commits, the prefix
// chain through the tiers.
#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_pool.hpp"

namespace kvlab {

struct BlockTable {
  std::vector<BlockId> blocks;  // per block index; -1 once released (window, KV policy)
  // Chain hashes of its full blocks: the prompt's (from its lookup) and then each computed
  // block's; blocks [0, computed_blocks) are registered in the prefix cache.
  std::vector<std::uint64_t> hashes;
  std::uint64_t salt = 0;  // the chain's start (the request's cache salt)
  std::vector<std::int32_t> tokens;
  std::int64_t length = 0;                   // positions written
  std::int64_t slots = 0;                    // slot indices in use (== length before a drop)
  std::vector<std::int64_t> slot_positions;  // per slot index after a drop; else empty
  std::int64_t computed_blocks = 0;
  std::int64_t first_block = 0;  // blocks before it were released (before any drop)
  KvView view;                   // blocks[first_block..] as merged slot extents

  bool dropped_positions() const { return !slot_positions.empty(); }
};

class PagedBlocks {
 public:
  // `pool`'s slots as blocks of `block_size` (the caller checks that it divides them);
  // `caching`: the pool keeps a prefix cache, reusing its free cached blocks in `reuse_order`.
  PagedBlocks(KvPool& pool, std::int64_t block_size, bool caching,
              EvictionOrder reuse_order = EvictionOrder::lru);

  BlockPool& pool() { return blocks_; }
  const BlockPool& pool() const { return blocks_; }
  KvPool& kv() const { return kv_; }
  std::int64_t block_size() const { return block_size_; }
  std::int64_t blocks_for(std::int64_t tokens) const {
    return (tokens + block_size_ - 1) / block_size_;
  }
  std::int64_t bytes_copied() const { return bytes_copied_; }

  // A free block, its old open key groups forgotten; one holder of `b` fewer.
  BlockId take();
  void release(BlockId b);
  // Every block of the table held once more (a fork), or released, last block first (so a
  // shared prefix's first blocks are the last a cache evicts).
  void hold_all(const BlockTable& table);
  void release_all(const BlockTable& table);

  // Free blocks append(table, n tokens) takes, a copy-on-write copy of a shared last block
  // included. Inline: the planner asks it for every decode of every step.
  std::int64_t blocks_to_append(const BlockTable& table, std::int64_t tokens) const {
    const std::int64_t last_fill = table.slots % block_size_;
    std::int64_t blocks = std::max<std::int64_t>(
        0, blocks_for(table.slots + tokens) - static_cast<std::int64_t>(table.blocks.size()));
    if (tokens > 0 && last_fill != 0 &&
        blocks_.ref_count(table.blocks[static_cast<std::size_t>(table.slots / block_size_)]) > 1)
      ++blocks;  // copy-on-write of the shared last written block
    return blocks;
  }
  // Extends the table by `tokens` (the caller checked blocks_to_append against the free
  // blocks): its last block copied first when shared, new blocks taken, fills and view updated.
  void append(BlockTable& table, std::span<const std::int32_t> tokens);
  // Blocks [from, end) of the table hold the tokens its slots say.
  void fill_from(const BlockTable& table, std::int64_t from);
  // Takes blocks until the table has room for `slots` slots (the caller checked the free
  // blocks): room held ahead for tokens not known yet (a draft's picks). The view and the fills
  // cover the written slots only; append writes into the room before it takes a block.
  void reserve(BlockTable& table, std::int64_t slots);

  // Positions before `position` will never be read again: whole blocks of them are released
  // (after a drop, the positions are dropped like a KV policy's).
  void release_before(BlockTable& table, std::int64_t position);
  // Keeps only `kept` (increasing) of the table's positions (a KV policy's eviction): each block
  // left with none is released (the last excepted), and once the dropped slots in held blocks
  // make a block's worth the kept ones move down and the rest is released. false (nothing
  // changed) when the table shares blocks (a fork's) and too few are free to copy them.
  bool drop_positions(BlockTable& table, std::span<const std::int64_t> kept);
  // Rolls the table back to its first `length` positions (KvRollback::truncate's rules).
  bool truncate(BlockTable& table, std::int64_t length);

  // The table's view made again from its blocks (and, after a drop, each block's fill).
  void rebuild_view(BlockTable& table);
  // Blocks copied into since the last call, per block (kvlab view's "copied" state); cleared.
  std::vector<bool> take_copied();

 private:
  // The blocks holding written slots (all of them unless reserve held room ahead).
  std::int64_t written_blocks(const BlockTable& table) const {
    const auto blocks = static_cast<std::int64_t>(table.blocks.size());
    return (blocks - 1) * block_size_ < table.slots ? blocks : blocks_for(table.slots);
  }
  void rebuild_dropped_view(BlockTable& table);
  bool truncate_dropped(BlockTable& table, std::int64_t length);
  void number_slots(BlockTable& table) const;
  void release_dropped(BlockTable& table);
  bool own_blocks(BlockTable& table);
  void compact(BlockTable& table);
  BlockId copy_of(BlockId b, std::int64_t slots);
  static std::size_t index(std::int64_t i) { return static_cast<std::size_t>(i); }

  KvPool& kv_;
  std::int64_t block_size_;
  BlockPool blocks_;
  std::int64_t bytes_copied_ = 0;
  std::vector<bool> copied_;  // per block: copied into since the last take_copied
};

namespace detail {

inline std::size_t at(std::int64_t i) {
  return static_cast<std::size_t>(i);
}

// Blocks [from, end) of the table hold the tokens its slots say.
inline void fill_blocks(BlockPool& pool, const BlockTable& t, std::int64_t from, std::int64_t end) {
  const std::int64_t size = pool.block_size();
  for (auto i = from; i < end; ++i)
    pool.set_fill(t.blocks[at(i)], std::min(size, t.slots - i * size));
}

// Blocks [from, end) of the table added to its view's end (physically adjacent blocks merge).
inline void extend_view(BlockTable& t, std::int64_t from, std::int64_t end, std::int64_t size) {
  auto& extents = t.view.extents;
  for (auto i = from; i < end; ++i) {
    const std::int64_t start = std::int64_t{t.blocks[at(i)]} * size;
    const std::int64_t length = std::min(size, t.slots - i * size);
    if (!extents.empty() && extents.back().start_slot + extents.back().length == start)
      extents.back().length += length;
    else
      extents.push_back({start, length});
  }
}

}  // namespace detail

// Inline: it runs for every decode of every step, and inside the allocator its loads of the
// table, the view and the tokens overlap the ones the room check made (a call into the shared
// library between them cost the allocator's per-token path about 10%, measured).
inline void PagedBlocks::append(BlockTable& t, std::span<const std::int32_t> tokens) {
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n == 0) return;
  const std::int64_t first_written = t.slots / block_size_;  // one division a call
  const std::int64_t last_fill = t.slots - first_written * block_size_;
  if (last_fill != 0) {            // the last block gets written: make it ours
    if (!t.dropped_positions()) {  // its slots leave the view's end; extend_view adds them back
      auto& extents = t.view.extents;
      extents.back().length -= last_fill;
      if (extents.back().length == 0) extents.pop_back();
    }
    BlockId& last = t.blocks[detail::at(first_written)];
    if (blocks_.ref_count(last) > 1) last = copy_of(last, last_fill);
  }
  if (t.dropped_positions())
    for (std::int64_t p = t.length; p < t.length + n; ++p) t.slot_positions.push_back(p);
  t.length += n;
  t.slots += n;
  t.tokens.insert(t.tokens.end(), tokens.begin(), tokens.end());
  const std::int64_t needed = blocks_for(t.slots);
  while (static_cast<std::int64_t>(t.blocks.size()) < needed) t.blocks.push_back(take());
  if (t.dropped_positions()) return rebuild_view(t);
  const std::int64_t end = written_blocks(t);
  detail::fill_blocks(blocks_, t, first_written, end);
  detail::extend_view(t, first_written, end, block_size_);
}

// The pool as kvlab view draws it, block by block over the pool and the tables that hold its
// blocks: who holds a block (several: shared; copied into since the last map: copied), its
// filled slots and the rest of it as slack; a free block that keeps a prefix is cached. A table
// with dropped positions has holes: its blocks are drawn slot by slot. `copied`: take_copied().
using HeldTable = std::pair<SequenceId, const BlockTable*>;
void draw_block_pool(const BlockPool& pool, std::span<const HeldTable> tables,
                     const std::vector<bool>& copied, KvPoolMap& map);

}  // namespace kvlab
