// KV tiers below the pool (kvlab/kv/kv_tiers.hpp): an evicted block goes to host memory, from
// there to disk, and comes back byte for byte (a real host buffer and a real file); a full disk
// gives up its least recently used block; a block being loaded is never given up; a hit needs
// the block's tokens; and on a pool without storage the tiers only count.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <csignal>
#include <random>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/kv/kv_tiers.hpp"

namespace kvlab {
namespace {

// The shipped lru plugin's order, in-process (the plugins are tested in tests/plugins/).
class TestLru final : public OrderedTierPolicy {
 public:
  TestLru() : OrderedTierPolicy(EvictionOrder::lru) {}
  bool admit(KvTier, const KvTierBlockFacts&) override { return true; }
};

constexpr std::int64_t kBlockSize = 4;

// A 2-layer f16 pool of 4 blocks; host and disk capacities in blocks.
struct Fixture {
  explicit Fixture(std::int64_t host_blocks, std::int64_t disk_blocks,
                   KvStorage storage = KvStorage::host, const char* disk_directory = nullptr)
      : pool({2, 2, 3, 4 * kBlockSize, DType::dtype_f16}, storage),
        tiers({host_blocks * block_bytes(), disk_blocks * block_bytes(), disk_directory, &policy},
              pool, kBlockSize) {}
  std::int64_t block_bytes() const { return pool.bytes_per_slot() * kBlockSize; }
  // Every row of the block: values from `seed`, rounded to f16 by the pool.
  void fill(BlockId block, unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> value(-4, 4);
    std::vector<float> row(static_cast<std::size_t>(pool.shape().slot_width()));
    for (std::int64_t layer = 0; layer < 2; ++layer)
      for (std::int64_t slot = block * kBlockSize; slot < (block + 1) * kBlockSize; ++slot)
        for (bool v : {false, true}) {
          for (float& x : row) x = value(rng);
          pool.write_row(layer, slot, v, row.data());
        }
  }
  std::vector<float> rows(BlockId block) const {
    std::vector<float> all, row(static_cast<std::size_t>(pool.shape().slot_width()));
    for (std::int64_t layer = 0; layer < 2; ++layer)
      for (std::int64_t slot = block * kBlockSize; slot < (block + 1) * kBlockSize; ++slot)
        for (bool v : {false, true}) {
          pool.read_row(layer, slot, v, row.data());
          all.insert(all.end(), row.begin(), row.end());
        }
    return all;
  }
  TestLru policy;
  KvPool pool;
  KvTiers tiers;
};

std::vector<std::int32_t> tokens(std::int32_t first) {
  return {first, first + 1, first + 2, first + 3};
}

TEST(KvTiers, ABlockComesBackFromHostAndFromDiskByteForByte) {
  Fixture f(1, 2);
  f.fill(0, 1);
  const std::vector<float> a = f.rows(0);
  f.tiers.evicted(0, 111, tokens(10), 3, 0);  // to host
  f.fill(0, 2);                               // the device reuses the block
  const std::vector<float> b = f.rows(0);
  f.tiers.evicted(0, 222, tokens(20), 1, 1);  // to host: a goes down to disk
  EXPECT_EQ(f.tiers.size(KvTier::host), 1);
  EXPECT_EQ(f.tiers.size(KvTier::disk), 1);

  const auto hit_a = f.tiers.find(111, tokens(10));
  ASSERT_TRUE(hit_a.has_value());
  EXPECT_EQ(hit_a->tier, KvTier::disk);
  EXPECT_EQ(f.tiers.load(*hit_a, 2), 4);  // its uses: 3, and this hit
  EXPECT_EQ(f.rows(2), a);                // written to the file and read back
  const auto hit_b = f.tiers.find(222, tokens(20));
  ASSERT_TRUE(hit_b.has_value());
  EXPECT_EQ(hit_b->tier, KvTier::host);
  f.tiers.load(*hit_b, 3);
  EXPECT_EQ(f.rows(3), b);

  const KvTierCounters& c = f.tiers.counters();
  const std::int64_t block = f.block_bytes();
  EXPECT_EQ(c.bytes_stored[0], 2 * block);  // a and b into host
  EXPECT_EQ(c.bytes_stored[1], block);      // a onto disk
  EXPECT_EQ(c.bytes_loaded[0], block);
  EXPECT_EQ(c.bytes_loaded[1], block);
  EXPECT_EQ(c.hit_blocks[0], 1);
  EXPECT_EQ(c.hit_blocks[1], 1);
  EXPECT_EQ(c.copies[0], 4);  // two stores, the host load, the disk load crossing the host link
  EXPECT_EQ(c.copies[1], 2);  // the disk write and read
  EXPECT_GT(c.copy_seconds, 0);
}

TEST(KvTiers, AFullDiskGivesUpItsLeastRecentlyUsedBlock) {
  Fixture f(1, 2);
  for (std::int32_t i = 0; i < 4; ++i) {
    f.fill(0, static_cast<unsigned>(i));
    f.tiers.evicted(0, 100 + static_cast<std::uint64_t>(i), tokens(10 * i), 1, i);
  }
  // host: 103; disk: 101, 102; 100 was the disk's least recently used.
  EXPECT_FALSE(f.tiers.find(100, tokens(0)).has_value());
  EXPECT_EQ(f.tiers.find(101, tokens(10))->tier, KvTier::disk);
  EXPECT_EQ(f.tiers.find(103, tokens(30))->tier, KvTier::host);
  EXPECT_EQ(f.tiers.counters().dropped, 1);
}

TEST(KvTiers, ABlockBeingLoadedIsNeverGivenUp) {
  Fixture f(1, 0);  // no disk: a block host memory gives up is gone
  f.tiers.evicted(0, 111, tokens(10), 1, 0);
  const auto hit = f.tiers.find(111, tokens(10));
  ASSERT_TRUE(hit.has_value());
  f.tiers.pin(*hit);
  f.tiers.evicted(1, 222, tokens(20), 1, 0);  // would push 111 out: the newcomer is dropped
  EXPECT_TRUE(f.tiers.find(111, tokens(10)).has_value());
  EXPECT_FALSE(f.tiers.find(222, tokens(20)).has_value());
  f.tiers.unpin_all();
  f.tiers.evicted(1, 222, tokens(20), 1, 0);
  EXPECT_FALSE(f.tiers.find(111, tokens(10)).has_value());
  EXPECT_TRUE(f.tiers.find(222, tokens(20)).has_value());
  EXPECT_EQ(f.tiers.counters().dropped, 2);
}

TEST(KvTiers, AHitNeedsTheBlocksTokensAndABlockIsKeptOnce) {
  Fixture f(2, 0);
  f.tiers.evicted(0, 111, tokens(10), 1, 0);
  EXPECT_FALSE(f.tiers.find(111, tokens(11)).has_value());  // a hash collision is no hit
  f.tiers.evicted(0, 111, tokens(10), 5, 0);  // evicted again after a load: kept, not copied
  EXPECT_EQ(f.tiers.size(KvTier::host), 1);
  EXPECT_EQ(f.tiers.counters().copies[0], 1);
}

TEST(KvTiers, WithoutStorageTheTiersOnlyCount) {
  Fixture f(1, 1, KvStorage::none);
  f.tiers.evicted(0, 111, tokens(10), 1, 0);
  f.tiers.evicted(1, 222, tokens(20), 1, 0);
  const auto hit = f.tiers.find(111, tokens(10));
  ASSERT_TRUE(hit.has_value());
  f.tiers.load(*hit, 2);
  EXPECT_EQ(f.tiers.counters().bytes_loaded[1], f.block_bytes());
  EXPECT_EQ(f.tiers.counters().copy_seconds, 0);
}

// A disk that cannot take a block (here: ulimit -f at one block) turns the disk tier off with a
// warning instead of failing the run: the block is dropped (a cache that cannot grow), the
// block already on disk still loads byte for byte, and nothing more is written.
TEST(KvTiers, ADiskThatCannotBeWrittenTurnsOffAndDropsInsteadOfFailing) {
  Fixture f(1, 3);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = static_cast<rlim_t>(f.block_bytes());  // the file holds one block
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  f.fill(0, 1);
  const std::vector<float> a = f.rows(0);
  f.tiers.evicted(0, 111, tokens(10), 1, 0);  // host
  f.fill(0, 2);
  f.tiers.evicted(0, 222, tokens(20), 1, 1);  // 111 to disk: the file's first block
  f.fill(0, 3);
  f.tiers.evicted(0, 333, tokens(30), 1, 2);  // 222 to disk: past the limit
  setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  f.fill(0, 4);
  f.tiers.evicted(0, 444, tokens(40), 1, 3);  // 333 given up: the disk stays off for good
  EXPECT_NE(f.tiers.disk_failure().find("File too large"), std::string::npos)
      << f.tiers.disk_failure();
  EXPECT_EQ(f.tiers.size(KvTier::disk), 1);
  EXPECT_EQ(f.tiers.counters().dropped, 2);    // 222, then 333
  EXPECT_EQ(f.tiers.counters().copies[1], 1);  // one write went through, none after
  EXPECT_FALSE(f.tiers.find(222, tokens(20)).has_value());
  const auto hit = f.tiers.find(111, tokens(10));
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(hit->tier, KvTier::disk);
  f.tiers.load(*hit, 2);
  EXPECT_EQ(f.rows(2), a);
}

TEST(KvTiers, ADiskFolderThatCannotHoldTheFileIsAClearError) {
  Fixture f(1, 1, KvStorage::host, "/nonexistent/kvlab-folder");
  try {
    f.tiers.evicted(0, 111, tokens(10), 1, 0);  // the first real copy makes the file
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kvlab-folder"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace kvlab
