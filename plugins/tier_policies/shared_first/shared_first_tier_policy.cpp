// shared_first: a tier keeps the blocks most sequences have shared (a system prompt's blocks, a
// long conversation's early turns) and gives up the least shared first, the least recently used
// among equals; a block enters a tier only once enough sequences have used it (HiCache's
// "write_through_selective": the disk write is spent only on blocks that were reused).
#include <set>
#include <tuple>
#include <vector>

#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class SharedFirstTierPolicy final : public KvTierPolicy {
 public:
  SharedFirstTierPolicy(const PluginParams& params, const PluginContext&)
      : min_uses_{params.integer("host_min_uses"), params.integer("disk_min_uses")} {}

  void configure(std::span<const std::int64_t> capacities) override {
    tiers_.assign(capacities.size(), {});
    for (std::size_t t = 0; t < capacities.size(); ++t)
      tiers_[t].keys.assign(static_cast<std::size_t>(capacities[t]), {});
  }
  bool admit(KvTier tier, const KvTierBlockFacts& facts) override {
    return facts.uses >= min_uses_[static_cast<std::size_t>(tier)];
  }
  void added(KvTier tier, std::int32_t slot, const KvTierBlockFacts& facts) override {
    insert(tier, slot, facts.uses);
  }
  void used(KvTier tier, std::int32_t slot) override {
    const std::int64_t uses = std::get<0>(key(tier, slot)) + 1;
    removed(tier, slot);
    insert(tier, slot, uses);
  }
  void removed(KvTier tier, std::int32_t slot) override { of(tier).order.erase(key(tier, slot)); }
  std::int32_t victim(KvTier tier) override {
    Tier& t = of(tier);
    const std::int32_t slot = std::get<2>(*t.order.begin());
    t.order.erase(t.order.begin());
    return slot;
  }

 private:
  using Key = std::tuple<std::int64_t, std::uint64_t, std::int32_t>;  // uses, last use, slot
  struct Tier {
    std::set<Key> order;    // the first is given up first
    std::vector<Key> keys;  // per slot: its key in order
  };
  Tier& of(KvTier tier) { return tiers_[static_cast<std::size_t>(tier)]; }
  Key& key(KvTier tier, std::int32_t slot) { return of(tier).keys[static_cast<std::size_t>(slot)]; }
  void insert(KvTier tier, std::int32_t slot, std::int64_t uses) {
    key(tier, slot) = Key{uses, ++clock_, slot};
    of(tier).order.insert(key(tier, slot));
  }

  std::int64_t min_uses_[kKvTierCount];
  std::vector<Tier> tiers_;
  std::uint64_t clock_ = 0;
};

const ParamSpec kParams[] = {
    {"host_min_uses", ParamType::param_integer,
     "sequences that must have held a block before the device's eviction stores it in host memory",
     "1", 1, 1000000},
    {"disk_min_uses", ParamType::param_integer,
     "sequences that must have held a block before host memory's eviction writes it to disk", "2",
     1, 1000000},
};

}  // namespace

KVLAB_PLUGIN(
    kvlab::PluginKind::tier_policy, SharedFirstTierPolicy, "shared_first",
    "each tier keeps the blocks most sequences shared and gives up the least shared "
    "(then least recently used) first; a block enters a tier once enough sequences used it",
    kParams)
