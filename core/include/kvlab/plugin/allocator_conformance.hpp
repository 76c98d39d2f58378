#pragma once
// The KV allocator conformance suite: what every allocator plugin, shipped or third-party, must
// do (kv_allocator.hpp's contracts), checked over long seeded random sequences of allocate /
// append / release_before / free / fork (and evict, truncate where asked) on a real pool. A shadow
// "backend" writes, for every token, a value that depends only on the token prefix (as real KV
// does) into the slot the allocator gave; every live sequence must then read its own prefix values
// back. Sharing a slot is legal only when the prefixes agree (prefix caching, fork before
// divergence). Run it from the test suite (tests/plugins/allocators/) or on any plugin with `kvlab
// plugins conformance NAME`.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab {

struct ConformanceOptions {
  std::vector<unsigned> seeds{1, 2, 3};
  int operations = 3000;     // per seed
  std::int64_t slots = 256;  // pool capacity
  std::int64_t max_seq_len = 48;
  // KV tiers below the pool (PluginContext::tiers) in bytes of the pool (8 a slot), and the
  // tier_policy plugin: blocks loaded back from a tier must read their prefix values too.
  std::int64_t host_tier_bytes = 0, disk_tier_bytes = 0;
  std::string tier_policy = "lru";
  bool release_window = false;  // also call release_before (allocators that free early)
  bool evict = false;  // also drop random positions (evict: allocators that serve KV policies)
  // Also speculative appends rolled back (truncate): proposed tokens appended and written, the
  // accepted ones marked computed, the rest rolled back; truncate must accept and free them.
  bool rollback = false;
  // > 1: the allocator runs under GroupedKvAllocator (kvlab/kv/kv_groups.hpp) with this many KV
  // groups, group 0 global and the others a window of 8 (released as sequences grow): every
  // group's view must read its own values (they differ by group), no slot held by two groups.
  std::int64_t kv_groups = 0;
};

struct ConformanceReport {
  std::vector<std::string>
      failures;  // empty when the allocator conforms; the first failure ends a seed
  std::int64_t operations = 0;
  std::int64_t full_pool_refusals = 0;  // allocate/append refused for lack of room (must be > 0)
  std::int64_t tier_hit_tokens = 0;     // prompt tokens loaded back from KV tiers (with tiers)
  std::int64_t rolled_back_tokens = 0;  // proposed tokens truncate took back (with rollback)
  bool passed() const { return failures.empty(); }
};

ConformanceReport check_allocator_conformance(
    const PluginRegistry& registry, std::string_view allocator,
    const std::map<std::string, ParamValue, std::less<>>& params,
    const ConformanceOptions& options = {});

}  // namespace kvlab
