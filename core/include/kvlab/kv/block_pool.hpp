#pragma once
// The block pool of a paged KV cache (vLLM's BlockPool): fixed-size blocks with reference
// counts, a free queue, and the prefix cache's map from chain hash to the block holding that
// prefix. A freed block that holds a registered prefix stays in the cache, reusable, until the
// free blocks without one run out; then the pool's reuse order (kvlab/kv/eviction_order.hpp:
// the least recently freed first, or the least shared) picks which cached block is reused for
// other data, and the eviction sink (the KV tiers) may copy it out first.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kvlab/kv/eviction_order.hpp"

namespace kvlab {

using BlockId = std::int32_t;

// Told of each cached block the pool evicts, before its slots are reused: its prefix hash and
// tokens, how many sequences held it (its uses) and its block index in their prompts.
class BlockEvictionSink {
 public:
  virtual ~BlockEvictionSink() = default;
  virtual void evicted(BlockId block, std::uint64_t hash, std::span<const std::int32_t> tokens,
                       std::int64_t uses, std::int64_t position) = 0;
};

// The prefix cache's map from chain hash to block: open addressing with linear probing in a
// power-of-two table at most half full, deletion by backward shift (no tombstones). One probe
// sequence in one array of (hash, block) entries, where a node-based map pays an allocation and
// a cache miss per entry: the prefix cache registers and evicts a block on almost every prompt
// block of a long trace, and a hit reads its block from the cache line its hash is on.
// Hash 0 is "no prefix" (BlockPool's marker), never a key.
class BlockHashIndex {
 public:
  explicit BlockHashIndex(std::int64_t max_entries = 0);
  std::optional<BlockId> find(std::uint64_t hash) const;
  bool insert(std::uint64_t hash, BlockId block);  // false: the hash is there already
  // The same, doubling the table instead of refusing when it would be more than half full (an
  // index whose entries have no fixed bound: a router's blocks).
  bool insert_growing(std::uint64_t hash, BlockId block);
  // The block of `hash`, inserting make_block() for it first when it is missing (growing):
  // one probe where find and then insert take two.
  template <typename MakeBlock>
  BlockId find_or_insert_growing(std::uint64_t hash, MakeBlock&& make_block);
  void erase(std::uint64_t hash);
  std::int64_t size() const { return size_; }
  // Starts loading the cache line a lookup of `hash` reads first: a caller that knows the next
  // hashes (a prompt's blocks) issues it a few ahead, so their cache misses overlap.
  void prefetch(std::uint64_t hash) const { __builtin_prefetch(&entries_[home(hash)]); }

 private:
  struct Entry {
    std::uint64_t hash = 0;  // 0: empty
    BlockId block = -1;
  };
  std::size_t home(std::uint64_t hash) const { return (hash * 0x9e3779b97f4a7c15ULL) >> shift_; }
  // Where `hash` is, or the empty entry ending its probe run.
  std::size_t probe(std::uint64_t hash) const {
    std::size_t i = home(hash);
    while (entries_[i].hash != hash && entries_[i].hash != 0) i = (i + 1) & mask_;
    return i;
  }
  void grow_if_full();
  std::vector<Entry> entries_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::int64_t size_ = 0;
};

template <typename MakeBlock>
BlockId BlockHashIndex::find_or_insert_growing(std::uint64_t hash, MakeBlock&& make_block) {
  grow_if_full();
  Entry& e = entries_[probe(hash)];
  if (e.hash == hash) return e.block;
  e = {hash, make_block()};
  ++size_;
  return e.block;
}

class BlockPool {
 public:
  // `blocks` blocks of `block_size` slots; `caching`: blocks may be registered in the prefix
  // cache (their tokens kept to check every hit); `reuse_order`: which free cached block is
  // reused first.
  BlockPool(std::int64_t blocks, std::int64_t block_size, bool caching,
            EvictionOrder reuse_order = EvictionOrder::lru);

  std::int64_t block_size() const { return block_size_; }
  std::int64_t blocks() const { return static_cast<std::int64_t>(blocks_.size()); }
  // Free blocks: plain ones and cached ones the reuse order may evict.
  std::int64_t free_blocks() const { return free_plain_count() + free_cached_count(); }
  std::int64_t free_plain_count() const { return static_cast<std::int64_t>(free_plain_.size()); }
  std::int64_t free_cached_count() const { return reusable_.size(); }
  EvictionOrder reuse_order() const { return reusable_.order(); }
  std::int32_t ref_count(BlockId b) const { return blocks_[index(b)].ref_count; }

  // Told of every eviction from now on (nullptr: nobody). Not owned.
  void set_eviction_sink(BlockEvictionSink* sink) { sink_ = sink; }

  // A free block, held once: a plain one, else the reuse order's first (its prefix forgotten, after
  // the eviction sink has seen it).
  BlockId take();
  // One more holder of a block (one more use); a free cached block leaves the free queue.
  void hold(BlockId b);
  // Sequences that have held the block since it was taken (and before, when loaded from a tier).
  std::int64_t uses(BlockId b) const { return blocks_[index(b)].uses; }
  void set_uses(BlockId b, std::int64_t uses) { blocks_[index(b)].uses = uses; }
  // One holder fewer; at none the block is free (cached ones stay findable).
  void release(BlockId b);
  // The block holding the prefix named `hash` whose tokens are `tokens`, if any.
  std::optional<BlockId> cached(std::uint64_t hash, std::span<const std::int32_t> tokens) const;
  // Registers a held, full block as the one holding prefix `hash`, block `position` of its
  // sequence (no-op without caching, or when the block or the hash is registered already).
  void register_prefix(BlockId b, std::uint64_t hash, std::span<const std::int32_t> tokens,
                       std::int64_t position = 0);
  std::uint64_t hash_of(BlockId b) const { return blocks_[index(b)].hash; }
  // BlockHashIndex::prefetch for the prefix cache (cached, register_prefix).
  void prefetch(std::uint64_t hash) const { cache_.prefetch(hash); }

  // Slots of a held block that hold tokens; the sum over held blocks is live_fill().
  void set_fill(BlockId b, std::int64_t fill);
  std::int64_t fill(BlockId b) const { return blocks_[static_cast<std::size_t>(b)].fill; }
  std::int64_t live_fill() const { return live_fill_; }
  std::int64_t evictions() const { return evictions_; }

 private:
  struct Block {
    std::int32_t ref_count = 0;
    std::int64_t fill = 0;      // slots holding tokens (a cached block keeps its fill when freed)
    std::uint64_t hash = 0;     // 0: holds no registered prefix
    std::int64_t uses = 0;      // holders since taken
    std::int64_t position = 0;  // block index of the registered prefix
  };
  static std::size_t index(BlockId b) { return static_cast<std::size_t>(b); }
  std::span<const std::int32_t> tokens_of(BlockId b) const;

  std::int64_t block_size_;
  bool caching_;
  EvictionQueue reusable_;   // the free cached blocks, in reuse order
  std::uint64_t clock_ = 0;  // ticks as blocks are freed into the cache (their last use)
  BlockEvictionSink* sink_ = nullptr;
  std::vector<Block> blocks_;
  std::vector<BlockId> free_plain_;   // free blocks with no registered prefix
  BlockHashIndex cache_;              // chain hash -> block
  std::vector<std::int32_t> tokens_;  // (blocks, block_size): a cached block's tokens
  std::int64_t live_fill_ = 0, evictions_ = 0;
};

}  // namespace kvlab
