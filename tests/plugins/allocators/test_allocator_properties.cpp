// Allocator properties over long seeded random operation sequences. A shadow "backend" writes,
// for every token, a value that depends only on the token prefix (as real KV does) into the
// slot the allocator gave; every live sequence must then read back its own prefix values.
// Sharing a slot is only legal when the prefixes agree (prefix caching, fork before divergence).
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <unordered_map>

#include "kvlab/plugin/allocator_conformance.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

struct AllocatorCase {
  std::string name;
  std::map<std::string, ParamValue, std::less<>> params;
  bool releases_window;  // exercise release_before (only the paged allocator frees early)
  std::int64_t host_tier_bytes = 0, disk_tier_bytes = 0;
  std::string tier_policy = "lru";
  bool evicts = false;         // exercise evict (a KV policy dropping positions)
  std::int64_t kv_groups = 0;  // > 1: under GroupedKvAllocator (kvlab/kv/kv_groups.hpp)
};

void PrintTo(const AllocatorCase& c, std::ostream* os) {
  *os << c.name;
}

class AllocatorProperties : public ::testing::TestWithParam<AllocatorCase> {};

// The installed conformance suite (kvlab/plugin/allocator_conformance.hpp) on every shipped
// allocator: 3 seeds x 3000 random operations each, speculative rollbacks among them.
TEST_P(AllocatorProperties, RandomOperationSequences) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  ConformanceOptions options;
  options.release_window = GetParam().releases_window;
  options.host_tier_bytes = GetParam().host_tier_bytes;
  options.disk_tier_bytes = GetParam().disk_tier_bytes;
  options.tier_policy = GetParam().tier_policy;
  options.evict = GetParam().evicts;
  options.kv_groups = GetParam().kv_groups;
  options.rollback = true;  // every shipped allocator rolls speculative tokens back
  const ConformanceReport report =
      check_allocator_conformance(registry, GetParam().name, GetParam().params, options);
  for (const std::string& failure : report.failures) ADD_FAILURE() << failure;
  EXPECT_EQ(report.operations, 3 * 3000);
  EXPECT_GT(report.full_pool_refusals, 0);
  EXPECT_GT(report.rolled_back_tokens, 0);
  if (options.host_tier_bytes > 0) {
    EXPECT_GT(report.tier_hit_tokens, 0);
  }
}

// The suite catches a broken allocator: the test plugin that hands every sequence the same
// slots fails it, with the slot named.
TEST(AllocatorConformance, RejectsAnAllocatorThatSharesSlots) {
  PluginRegistry registry({KVLAB_PLUGIN_DIR});
  registry.load_file(std::filesystem::path(KVLAB_TEST_PLUGIN_DIR) /
                     "kvlab_plugin_test_broken_allocator.so");
  ConformanceOptions options;
  options.seeds = {1};
  const ConformanceReport report =
      check_allocator_conformance(registry, "broken_shared_slots", {}, options);
  ASSERT_FALSE(report.passed());
  EXPECT_NE(report.failures[0].find("seed 1: operation"), std::string::npos) << report.failures[0];
}

INSTANTIATE_TEST_SUITE_P(
    Allocators, AllocatorProperties,
    ::testing::Values(
        AllocatorCase{"static", {}, false}, AllocatorCase{"dynamic", {}, false},
        AllocatorCase{"dynamic", {{"growth", 1.0}}, false},
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, true},
        AllocatorCase{"paged", {{"block_size", std::int64_t{16}}, {"prefix_caching", false}}, true},
        AllocatorCase{"paged", {{"block_size", std::int64_t{1}}}, false},
        // KV tiers (a block is 4 slots x 8 bytes): 8 blocks of host memory, then 16 on disk.
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, true, 256, 0, "lru"},
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, true, 256, 512, "lru"},
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, false, 256, 512, "shared_first"},
        // The pool reuses its free cached blocks least shared first.
        AllocatorCase{
            "paged",
            {{"block_size", std::int64_t{4}}, {"reuse_order", std::string("least_shared")}},
            true},
        // A KV policy's evictions: holes, whole blocks released, compaction (with forks).
        AllocatorCase{"paged",
                      {{"block_size", std::int64_t{4}}, {"prefix_caching", false}},
                      true,
                      0,
                      0,
                      "lru",
                      true},
        AllocatorCase{"paged",
                      {{"block_size", std::int64_t{2}}, {"prefix_caching", false}},
                      false,
                      0,
                      0,
                      "lru",
                      true},
        // A hybrid model's KV groups (a global group and two of an 8-token window, 3 slots a
        // token): every allocator under GroupedKvAllocator, paged freeing the windows' blocks.
        AllocatorCase{"static", {}, false, 0, 0, "lru", false, 3},
        AllocatorCase{"dynamic", {}, false, 0, 0, "lru", false, 3},
        AllocatorCase{"paged",
                      {{"block_size", std::int64_t{4}}, {"prefix_caching", false}},
                      true,
                      0,
                      0,
                      "lru",
                      false,
                      3},
        // ... and with prefix caching: each group's blocks under its own salt, the hit the one
        // every group holds (a window group's early blocks reused or evicted meanwhile).
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, true, 0, 0, "lru", false, 3},
        AllocatorCase{"paged", {{"block_size", std::int64_t{2}}}, false, 0, 0, "lru", false, 3},
        // ... and a KV policy's evictions under groups (each group keeps what its view holds of
        // the kept positions), rolled back after them too.
        AllocatorCase{"paged",
                      {{"block_size", std::int64_t{4}}, {"prefix_caching", false}},
                      true,
                      0,
                      0,
                      "lru",
                      true,
                      3}),
    [](const auto& info) {
      std::string name = info.param.name;
      if (info.param.evicts) name += "_evicts";
      if (info.param.kv_groups > 1) name += "_kv_groups_" + std::to_string(info.param.kv_groups);
      if (info.param.host_tier_bytes > 0)
        name += "_tiers_" + std::to_string(info.param.host_tier_bytes) + "_" +
                std::to_string(info.param.disk_tier_bytes) + "_" + info.param.tier_policy;
      for (const auto& [key, value] : info.param.params)
        name += "_" + key + "_" + param_value_to_string(value);
      for (auto& ch : name)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return name;
    });

// A paged allocator over `pool` (one layer, one head, one value a slot).
PluginObject<KvAllocator> paged_over(KvPool& pool,
                                     std::map<std::string, ParamValue, std::less<>> params) {
  static const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  PluginContext context;
  context.pool = &pool;
  return registry.create<PluginKind::kv_allocator>("paged", std::move(params), context);
}

// paged's reuse_order names one of the eviction orders; another name is a clear error.
TEST(PagedAllocator, ReuseOrderMustNameAnEvictionOrder) {
  KvPool pool({1, 1, 1, 64});
  const std::string error = test::error_of<std::exception>([&] {
    paged_over(pool, {{"reuse_order", std::string("lfu")}});
  });
  EXPECT_NE(error.find("choose \"lru\" or \"least_shared\""), std::string::npos) << error;
}

// What each shipped allocator offers beyond the core (docs/allocators.md's table), and the
// conformance suite refusing a check whose feature an allocator lacks.
TEST(AllocatorFeatures, EachShippedAllocatorOffersWhatItsDocsSay) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  KvPool pool({1, 1, 1, 64});
  PluginContext context;
  context.pool = &pool;
  context.max_seq_len = 16;
  for (const char* name : {"static", "dynamic", "paged"}) {
    SCOPED_TRACE(name);
    auto allocator = registry.create<PluginKind::kv_allocator>(name, {}, context);
    const KvAllocatorFeatures features = allocator->features();
    EXPECT_EQ(features.dropping != nullptr, std::string(name) == "paged");
    EXPECT_NE(features.rollback, nullptr);
    EXPECT_NE(features.forking, nullptr);
    EXPECT_NE(features.drawing, nullptr);
  }
  ConformanceOptions options;
  options.seeds = {1};
  options.evict = true;
  const ConformanceReport report = check_allocator_conformance(registry, "static", {}, options);
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_NE(report.failures[0].find("offers no KvPositionDropping"), std::string::npos)
      << report.failures[0];
}

TEST(PagedAllocator, CopyOnWriteNeverChangesTheOtherSequence) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  KvPool pool({1, 1, 1, 64});
  PluginContext context;
  context.pool = &pool;
  auto paged = registry.create<PluginKind::kv_allocator>("paged", {{"block_size", std::int64_t{4}}},
                                                         context);
  const std::vector<std::int32_t> prompt{1, 2, 3, 4, 5, 6};  // one full block + 2 tokens
  ASSERT_TRUE(paged->allocate({0, prompt, 20}));
  for (std::int64_t p = 0; p < 6; ++p)
    *pool.key(0, paged->view(0).slot_of(p)) = static_cast<float>(100 + p);
  ASSERT_TRUE(paged->features().forking->fork(0, 1));
  EXPECT_EQ(paged->view(0).slot_of(5), paged->view(1).slot_of(5));  // shared until written
  const std::vector<std::int32_t> token{9};
  ASSERT_TRUE(
      paged->append(1, token));  // child writes position 6 in the shared last block: copy first
  const KvView parent = paged->view(0), child = paged->view(1);
  EXPECT_EQ(parent.slot_of(0), child.slot_of(0));  // the full block stays shared
  EXPECT_NE(parent.slot_of(5), child.slot_of(5));
  *pool.key(0, child.slot_of(6)) = -1.0f;
  for (std::int64_t p = 0; p < 6; ++p) {
    EXPECT_EQ(*pool.key(0, parent.slot_of(p)), static_cast<float>(100 + p));
    EXPECT_EQ(*pool.key(0, child.slot_of(p)), static_cast<float>(100 + p));  // copied
  }
  EXPECT_EQ(paged->stats().bytes_copied, 2 * pool.bytes_per_slot());
}

TEST(PagedAllocator, PrefixHitsAndLruEviction) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  KvPool pool({1, 1, 1, 16});  // 4 blocks of 4
  PluginContext context;
  context.pool = &pool;
  auto paged = registry.create<PluginKind::kv_allocator>("paged", {{"block_size", std::int64_t{4}}},
                                                         context);
  const std::vector<std::int32_t> a{1, 2, 3, 4, 5, 6, 7, 8, 9};
  ASSERT_EQ(paged->allocate({0, a, 9})->cached_tokens, 0);
  paged->mark_computed(0, 9);
  paged->free(0);  // blocks stay cached
  EXPECT_EQ(paged->stats().cached_free, 8);
  const auto again = paged->allocate({1, a, 9});
  ASSERT_TRUE(again);
  EXPECT_EQ(again->cached_tokens, 8);  // two full blocks; the last token is always computed
  EXPECT_EQ(paged->stats().prefix_hit_tokens, 8);
  EXPECT_EQ(paged->stats().prefix_query_tokens, 18);
  paged->free(1);
  const std::vector<std::int32_t> other{7, 7, 7, 7, 7, 7, 7,
                                        7, 7, 7, 7, 7, 7, 7};  // needs all 4 blocks
  ASSERT_TRUE(paged->allocate({2, other, 14}));
  EXPECT_EQ(paged->stats().evictions, 2);
  EXPECT_EQ(paged->stats().cached_free, 0);
}

// Speculative decoding's rollback on the paged pool (4 blocks of 4): the rejected tokens' blocks
// return, none of their hashes enters the prefix cache, a cut into what was marked computed is
// refused, and the next append writes on from the cut.
TEST(PagedAllocator, RollbackReturnsBlocksAndCachesNoRejectedToken) {
  KvPool pool({1, 1, 1, 16});
  auto paged = paged_over(pool, {{"block_size", std::int64_t{4}}});
  const std::vector<std::int32_t> prompt{1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(paged->allocate({0, prompt, 16}));
  paged->mark_computed(0, 6);
  const std::vector<std::int32_t> proposed{7, 8, 9, 10, 11, 12};  // fills block 1, then block 2
  ASSERT_TRUE(paged->append(0, proposed));
  EXPECT_EQ(paged->stats().free, 4);
  paged->mark_computed(0, 7);  // the target accepted one: 7
  EXPECT_FALSE(paged->features().rollback->truncate(0, 13)) << "past the end";
  EXPECT_FALSE(paged->features().rollback->truncate(0, 3))
      << "into block 0, which the prefix cache holds";
  ASSERT_TRUE(paged->features().rollback->truncate(0, 7));
  EXPECT_EQ(paged->view(0).end_position(), 7);
  EXPECT_EQ(paged->stats().free, 8) << "block 2 is back";
  EXPECT_EQ(paged->stats().used, 7);
  // {5, 6, 7, 8} was block 1 while 8 was proposed: it must not be found.
  const std::vector<std::int32_t> probe{1, 2, 3, 4, 5, 6, 7, 8, 9};
  // Block 0 is a hit on a held block (no free block taken); blocks 1 and 2 come from the free
  // list. Had {5, 6, 7, 8} been cached, block 1 would be a hit too: 4.
  EXPECT_EQ(paged->slots_to_allocate({1, probe, 9}), 8) << "only block 0 is a hit";
  const std::vector<std::int32_t> next{20};
  ASSERT_TRUE(paged->append(0, next));
  EXPECT_EQ(paged->view(0).slot_of(7), paged->view(0).slot_of(6) + 1) << "written on from the cut";
}

// A fork shares the parent's last, partly filled block; the child's speculative append copies it
// first, and rolling every proposal back leaves the parent's block as it was.
TEST(PagedAllocator, RollbackNeverWritesASharedBlock) {
  KvPool pool({1, 1, 1, 32});
  auto paged = paged_over(pool, {{"block_size", std::int64_t{4}}, {"prefix_caching", false}});
  const std::vector<std::int32_t> prompt{1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(paged->allocate({0, prompt, 16}));
  for (std::int64_t p = 0; p < 6; ++p)
    *pool.key(0, paged->view(0).slot_of(p)) = static_cast<float>(100 + p);
  ASSERT_TRUE(paged->features().forking->fork(0, 1));
  const std::vector<std::int32_t> proposed{7, 8, 9};
  ASSERT_TRUE(paged->append(1, proposed));
  for (std::int64_t p = 6; p < 9; ++p) *pool.key(0, paged->view(1).slot_of(p)) = -1.0f;
  ASSERT_TRUE(paged->features().rollback->truncate(1, 6));  // all rejected
  for (std::int64_t p = 0; p < 6; ++p) {
    EXPECT_EQ(*pool.key(0, paged->view(0).slot_of(p)), static_cast<float>(100 + p));
    EXPECT_EQ(*pool.key(0, paged->view(1).slot_of(p)), static_cast<float>(100 + p));
  }
  EXPECT_NE(paged->view(0).slot_of(5), paged->view(1).slot_of(5)) << "the child's own copy";
  EXPECT_EQ(paged->stats().used, 4 + 2 + 2) << "the shared full block once, each last block";
  ASSERT_TRUE(paged->features().forking->fork(
      0, 2));  // shares the parent's blocks, the last partly filled one too
  EXPECT_FALSE(paged->features().rollback->truncate(2, 5))
      << "a cut inside a block the parent shares";
  ASSERT_TRUE(paged->features().rollback->truncate(2, 4))
      << "a cut at a block's end releases whole blocks only";
  EXPECT_EQ(paged->view(0).end_position(), 6);
  EXPECT_EQ(*pool.key(0, paged->view(0).slot_of(5)), 105.0f);
}

}  // namespace
}  // namespace kvlab
