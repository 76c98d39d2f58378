// lru: every block the device evicts goes to host memory, every block host memory gives up goes
// to disk, and each tier gives up its least recently used block first (LMCache's and HiCache's
// default).
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class LruTierPolicy final : public KvTierPolicy {
 public:
  LruTierPolicy(const PluginParams&, const PluginContext&) {}

  void configure(std::span<const std::int64_t> capacities) override {
    order_.clear();
    for (std::int64_t capacity : capacities) order_.emplace_back(capacity);
  }
  bool admit(KvTier, const KvTierBlockFacts&) override { return true; }
  void added(KvTier tier, std::int32_t slot, const KvTierBlockFacts&) override {
    of(tier).add(slot);
  }
  void used(KvTier tier, std::int32_t slot) override {  // to the most recent end
    of(tier).remove(slot);
    of(tier).add(slot);
  }
  void removed(KvTier tier, std::int32_t slot) override { of(tier).remove(slot); }
  std::int32_t victim(KvTier tier) override { return of(tier).victim(); }

 private:
  LruEviction& of(KvTier tier) { return order_[static_cast<std::size_t>(tier)]; }
  std::vector<LruEviction> order_;  // per tier: an intrusive list over its slots
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::tier_policy, LruTierPolicy, "lru",
             "every evicted prefix block goes down a tier; each tier gives up its least recently "
             "used block first",
             kvlab::kNoParams)
