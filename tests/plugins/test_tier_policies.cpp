// The shipped KV tier policies (plugins/tier_policies/): lru gives up the least recently used
// slot and admits everything; shared_first gives up the least shared slot (the least recently
// used among equals) and admits a block to a tier only once enough sequences have used it.
#include <gtest/gtest.h>

#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab {
namespace {

PluginObject<KvTierPolicy> policy(
    const char* name, const std::map<std::string, ParamValue, std::less<>>& params = {}) {
  static const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  auto p = registry.create<PluginKind::tier_policy>(name, params, PluginContext{});
  const std::int64_t capacities[] = {3, 2};
  p->configure(capacities);
  return p;
}

TEST(TierPolicies, LruGivesUpTheLeastRecentlyUsedAndAdmitsEverything) {
  auto lru = policy("lru");
  EXPECT_TRUE(lru->admit(KvTier::disk, {1, 0}));
  for (std::int32_t slot : {0, 1, 2}) lru->added(KvTier::host, slot, {1, 0});
  lru->used(KvTier::host, 0);  // 1 is now the least recently used
  EXPECT_EQ(lru->victim(KvTier::host), 1);
  lru->removed(KvTier::host, 2);
  EXPECT_EQ(lru->victim(KvTier::host), 0);
  lru->added(KvTier::disk, 1, {1, 0});  // the tiers keep separate orders
  EXPECT_EQ(lru->victim(KvTier::disk), 1);
}

TEST(TierPolicies, SharedFirstGivesUpTheLeastSharedAndAdmitsByUses) {
  auto shared = policy("shared_first",
                       {{"host_min_uses", std::int64_t{1}}, {"disk_min_uses", std::int64_t{3}}});
  EXPECT_TRUE(shared->admit(KvTier::host, {1, 0}));
  EXPECT_FALSE(shared->admit(KvTier::disk, {2, 0}));
  EXPECT_TRUE(shared->admit(KvTier::disk, {3, 0}));
  shared->added(KvTier::host, 0, {5, 0});  // a system prompt's block
  shared->added(KvTier::host, 1, {1, 4});
  shared->added(KvTier::host, 2, {1, 5});
  shared->used(KvTier::host, 1);  // 1 now has 2 uses: 2 is the least shared
  EXPECT_EQ(shared->victim(KvTier::host), 2);
  EXPECT_EQ(shared->victim(KvTier::host), 1);
  EXPECT_EQ(shared->victim(KvTier::host), 0);  // the most shared goes last, though oldest
}

}  // namespace
}  // namespace kvlab
