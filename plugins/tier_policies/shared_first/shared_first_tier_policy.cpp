// shared_first: a tier keeps the blocks most sequences have shared (a system prompt's blocks, a
// long conversation's early turns) and gives up the least shared first, the least recently used
// among equals; a block enters a tier only once enough sequences have used it (HiCache's
// "write_through_selective": the disk write is spent only on blocks that were reused).
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class SharedFirstTierPolicy final : public OrderedTierPolicy {
 public:
  SharedFirstTierPolicy(const PluginParams& params, const PluginContext&)
      : OrderedTierPolicy(EvictionOrder::least_shared),
        min_uses_{params.integer("host_min_uses"), params.integer("disk_min_uses")} {}
  bool admit(KvTier tier, const KvTierBlockFacts& facts) override {
    return facts.uses >= min_uses_[static_cast<std::size_t>(tier)];
  }

 private:
  std::int64_t min_uses_[kKvTierCount];
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
