// lru: every block the device evicts goes to host memory, every block host memory gives up goes
// to disk, and each tier gives up its least recently used block first (LMCache's and HiCache's
// default).
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class LruTierPolicy final : public OrderedTierPolicy {
 public:
  LruTierPolicy(const PluginParams&, const PluginContext&)
      : OrderedTierPolicy(EvictionOrder::lru) {}
  bool admit(KvTier, const KvTierBlockFacts&) override { return true; }
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::tier_policy, LruTierPolicy, "lru",
             "every evicted prefix block goes down a tier; each tier gives up its least recently "
             "used block first",
             kvlab::kNoParams)
