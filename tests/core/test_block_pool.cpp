// The block pool under the paged allocator (kvlab/kv/block_pool.hpp): blocks come out in order,
// a freed block that holds a registered prefix stays findable until plain blocks run out, the
// eviction policy picks which cached block is reused (LRU: least recently freed first), and a
// prefix hit is checked against the block's tokens. And a request's prefix hashes are computed
// once and extended as its tokens grow.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <random>
#include <set>
#include <unordered_map>
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/kv/prefix_hash.hpp"

namespace kvlab {
namespace {

std::vector<std::int32_t> block_tokens(std::int32_t first, std::int64_t size = 4) {
  std::vector<std::int32_t> tokens;
  for (std::int64_t i = 0; i < size; ++i) tokens.push_back(first + static_cast<std::int32_t>(i));
  return tokens;
}

TEST(BlockPool, CachedBlocksStayFindableUntilTheLeastRecentlyFreedIsEvicted) {
  BlockPool pool(3, 4, true);
  EXPECT_EQ(pool.free_blocks(), 3);
  const BlockId a = pool.take(), b = pool.take(), c = pool.take();
  EXPECT_EQ(a, 0);  // in order: fresh sequences get adjacent blocks
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  EXPECT_EQ(pool.free_blocks(), 0);
  const auto ta = block_tokens(10), tb = block_tokens(20);
  pool.register_prefix(a, 111, ta);
  pool.register_prefix(b, 222, tb);
  pool.set_fill(a, 4);
  pool.set_fill(b, 4);
  EXPECT_EQ(pool.live_fill(), 8);
  pool.release(b);  // freed first: evicted first
  pool.release(a);
  pool.release(c);  // no prefix: a plain free block
  EXPECT_EQ(pool.free_blocks(), 3);
  EXPECT_EQ(pool.free_cached_count(), 2);
  EXPECT_EQ(pool.live_fill(), 0);
  EXPECT_EQ(pool.cached(111, ta), a);
  EXPECT_EQ(pool.cached(111, tb), std::nullopt) << "a hash hit is checked against the tokens";
  EXPECT_EQ(pool.take(), c) << "plain free blocks go before cached ones";
  EXPECT_EQ(pool.take(), b) << "then the least recently freed cached block";
  EXPECT_EQ(pool.evictions(), 1);
  EXPECT_EQ(pool.cached(222, tb), std::nullopt) << "its prefix is forgotten";
  EXPECT_EQ(pool.cached(111, ta), a);
  pool.hold(a);  // a prefix hit brings a free cached block back
  EXPECT_EQ(pool.ref_count(a), 1);
  EXPECT_EQ(pool.free_blocks(), 0);
  EXPECT_EQ(pool.live_fill(), 4) << "its fill counts again";
}

TEST(BlockPool, ABlockOrAHashIsRegisteredOnceAndNotWithoutCaching) {
  BlockPool pool(2, 4, true);
  const BlockId a = pool.take(), b = pool.take();
  pool.register_prefix(a, 5, block_tokens(1));
  pool.register_prefix(b, 5, block_tokens(1));  // the hash already names block a
  pool.register_prefix(a, 6, block_tokens(2));  // block a already holds a prefix
  EXPECT_EQ(pool.hash_of(a), 5u);
  EXPECT_EQ(pool.hash_of(b), 0u);
  EXPECT_EQ(pool.cached(6, block_tokens(2)), std::nullopt);
  BlockPool uncached(1, 4, false);
  const BlockId c = uncached.take();
  uncached.register_prefix(c, 5, block_tokens(1));
  EXPECT_EQ(uncached.cached(5, block_tokens(1)), std::nullopt);
  uncached.release(c);
  EXPECT_EQ(uncached.free_cached_count(), 0);
}

// The pool's reuse order is a seam: under lru the least recently freed cached block is reused
// first, under least_shared the one fewest sequences held (a's two holders keep it).
TEST(BlockPool, TheReuseOrderPicksTheVictim) {
  for (const EvictionOrder order : {EvictionOrder::lru, EvictionOrder::least_shared}) {
    SCOPED_TRACE(eviction_order_name(order));
    BlockPool pool(2, 4, true, order);
    EXPECT_EQ(pool.reuse_order(), order);
    const BlockId a = pool.take(), b = pool.take();
    pool.hold(a);  // a second sequence shares a
    pool.register_prefix(a, 1, block_tokens(1));
    pool.register_prefix(b, 2, block_tokens(5));
    pool.release(a);
    pool.release(a);  // freed first
    pool.release(b);
    EXPECT_EQ(pool.take(), order == EvictionOrder::lru ? a : b);
    EXPECT_EQ(pool.evictions(), 1);
    EXPECT_EQ(pool.free_cached_count(), 1);
  }
}

// The eviction queue against a sorted reference set of (priority, id) under random adds,
// updates, removes and victims, in both orders (lru's list and least_shared's heap), with last
// uses that only grow (as every caller's clock) and with random ones (the list's walk from its
// newest end): the victim is always the reference's first.
TEST(EvictionQueue, AgreesWithASortedSetUnderRandomChanges) {
  for (const auto& [order, growing] :
       {std::pair{EvictionOrder::lru, true}, std::pair{EvictionOrder::lru, false},
        std::pair{EvictionOrder::least_shared, true},
        std::pair{EvictionOrder::least_shared, false}}) {
    SCOPED_TRACE(std::string(eviction_order_name(order)) + (growing ? " growing" : " random"));
    constexpr std::int32_t kIds = 40;
    EvictionQueue queue(kIds, order);
    std::set<std::pair<EvictionPriority, std::int32_t>> reference;
    std::vector<EvictionFacts> facts(kIds);
    std::mt19937 rng(11);
    std::uint64_t clock = 0;
    for (int step = 0; step < 20000; ++step) {
      const auto id = static_cast<std::int32_t>(rng() % kIds);
      const std::uint64_t last_use = growing ? ++clock : rng() % 50;
      const EvictionFacts next{last_use, static_cast<std::int64_t>(rng() % 4)};
      const bool in = queue.contains(id);
      const int action = static_cast<int>(rng() % 4);
      if (!in && action < 3) {
        queue.add(id, next);
        reference.insert({eviction_priority(order, next), id});
        facts[id] = next;
      } else if (in && action == 0) {
        queue.update(id, next);
        reference.erase({eviction_priority(order, facts[id]), id});
        reference.insert({eviction_priority(order, next), id});
        facts[id] = next;
      } else if (in && action == 1) {
        queue.remove(id);
        reference.erase({eviction_priority(order, facts[id]), id});
      } else if (!reference.empty()) {
        const std::int32_t victim = queue.victim();
        ASSERT_EQ(victim, reference.begin()->second) << "step " << step;
        reference.erase(reference.begin());
      }
      ASSERT_EQ(queue.size(), static_cast<std::int64_t>(reference.size()));
    }
  }
}

// The one priority function: lru by last use alone; least_shared by uses, then last use.
TEST(EvictionOrder, PriorityOrdersByTheFactsItNames) {
  const EvictionFacts old_shared{1, 5}, new_alone{2, 1}, old_alone{1, 1};
  EXPECT_LT(eviction_priority(EvictionOrder::lru, old_shared),
            eviction_priority(EvictionOrder::lru, new_alone));
  EXPECT_LT(eviction_priority(EvictionOrder::least_shared, new_alone),
            eviction_priority(EvictionOrder::least_shared, old_shared));
  EXPECT_LT(eviction_priority(EvictionOrder::least_shared, old_alone),
            eviction_priority(EvictionOrder::least_shared, new_alone));
  EXPECT_EQ(eviction_order_named("least_shared"), EvictionOrder::least_shared);
  EXPECT_EQ(eviction_order_named("lfu"), std::nullopt);
}

// The open-addressing hash index against std::unordered_map: 20,000 random inserts, repeats and
// erases on a 64-entry index (a 128-slot table kept near half full, so probe runs are long and
// erases shift entries back across the table's wrap), with hashes whose top bits collide.
TEST(BlockHashIndex, AgreesWithAStandardMapUnderRandomInsertsAndErases) {
  BlockHashIndex index(64);
  std::unordered_map<std::uint64_t, BlockId> reference;
  std::mt19937_64 rng(5);
  std::vector<std::uint64_t> keys;
  for (int i = 0; i < 200; ++i)
    keys.push_back((rng() % 8) << 61 | (rng() % 512) | 1);  // few homes: collisions
  for (int step = 0; step < 20000; ++step) {
    const std::uint64_t key = keys[rng() % keys.size()];
    if (rng() % 2 == 0 && reference.size() < 64) {
      const auto block = static_cast<BlockId>(step);
      EXPECT_EQ(index.insert(key, block), reference.try_emplace(key, block).second);
    } else {
      index.erase(key);
      reference.erase(key);
    }
    ASSERT_EQ(index.size(), static_cast<std::int64_t>(reference.size())) << "step " << step;
    for (const std::uint64_t k : keys) {
      const auto it = reference.find(k);
      ASSERT_EQ(index.find(k), it == reference.end() ? std::nullopt : std::optional(it->second))
          << "step " << step;
    }
  }
  EXPECT_FALSE(index.insert(0, 1));  // 0 is "no prefix", never a key
  EXPECT_EQ(index.find(0), std::nullopt);
}

// find_or_insert_growing: the block of a hash already there (make_block not called), else the
// new one; past half full the table doubles and keeps every entry.
TEST(BlockHashIndex, FindOrInsertGrowingMakesABlockOnlyForANewHash) {
  BlockHashIndex index(4);  // 16 slots: grows at the 9th entry
  int made = 0;
  auto make = [&] { return static_cast<BlockId>(100 + made++); };
  for (std::uint64_t h = 1; h <= 40; ++h)
    EXPECT_EQ(index.find_or_insert_growing(h * 977, make), 99 + static_cast<BlockId>(h));
  EXPECT_EQ(made, 40);
  EXPECT_EQ(index.size(), 40);
  for (std::uint64_t h = 1; h <= 40; ++h) {
    EXPECT_EQ(index.find_or_insert_growing(h * 977, make), 99 + static_cast<BlockId>(h)) << h;
    EXPECT_EQ(index.find(h * 977), std::optional<BlockId>(99 + static_cast<BlockId>(h)));
  }
  EXPECT_EQ(made, 40) << "no block made for a hash the index holds";
  index.erase(977);
  EXPECT_EQ(index.find(977), std::nullopt);
  EXPECT_EQ(index.find_or_insert_growing(977, make), 140);
}

TEST(PrefixHash, HashesAreChainedComputedOnceAndExtendedAsTheTokensGrow) {
  const std::vector<std::int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<std::uint64_t> scratch;
  PrefixHashCache cache;
  const auto kept = prefix_block_hashes(tokens, 4, 2, &cache, scratch);
  const std::vector<std::uint64_t> two(kept.begin(), kept.end());  // the span is the cache's
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0], chain_block_hash(0, std::span(tokens).first(4)));
  EXPECT_EQ(two[1], chain_block_hash(two[0], std::span(tokens).subspan(4, 4)));
  EXPECT_EQ(cache.hashes.size(), 2u);
  EXPECT_TRUE(scratch.empty()) << "with a cache, nothing goes to scratch";
  cache.hashes[0] = 42;  // computed once: a later lookup reads what is kept
  EXPECT_EQ(prefix_block_hashes(tokens, 4, 1, &cache, scratch)[0], 42u);
  const std::vector<std::int32_t> other = {9, 2, 3, 4};
  EXPECT_NE(chain_block_hash(0, other), chain_block_hash(0, std::span(tokens).first(4)));
  const auto fresh = prefix_block_hashes(tokens, 2, 3, &cache, scratch);  // another block size
  EXPECT_EQ(cache.block_size, 2);
  EXPECT_EQ(fresh.size(), 3u);
  EXPECT_EQ(fresh[0], chain_block_hash(0, std::span(tokens).first(2)));
  const auto uncached = prefix_block_hashes(tokens, 4, 2, nullptr, scratch);
  EXPECT_EQ(uncached[1], two[1]);
}

}  // namespace
}  // namespace kvlab
