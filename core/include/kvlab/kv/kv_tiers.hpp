#pragma once
// KV tiers below the device pool (LMCache, SGLang's HiCache): a prefix block the device's prefix
// cache evicts may go down to host memory, and from there to disk, instead of vanishing; a later
// prompt that starts with the same tokens finds it there and loads it back into a fresh device
// block instead of computing it again. Each tier holds whole blocks, named by the prefix cache's
// chain hash and checked against their tokens on every hit.
//
// Inclusive: a block loaded back stays in its tier (evicted from the device again, it costs no
// second copy); a block pushed out of host memory goes down to disk. Which blocks a tier takes
// and which it gives up is a KvTierPolicy (a plugin kind: "tier_policy").
//
// The copies are real when the pool has host storage (the cpu backend): host-tier blocks live in
// a host buffer, disk-tier blocks in a file (written and read back with pwrite/pread); on a pool
// without storage (the simulated backend) the tiers keep only the bookkeeping and the engine
// prices the bytes over the hardware profile's links.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/kv/eviction_order.hpp"
#include "kvlab/kv_pool.hpp"

namespace kvlab {

enum class KvTier : std::int32_t { host = 0, disk = 1 };
inline constexpr int kKvTierCount = 2;
const char* kv_tier_name(KvTier tier);  // "host", "disk"

// What a policy knows of a block when it is offered to a tier.
struct KvTierBlockFacts {
  std::int64_t uses = 0;      // sequences that have held this block's KV (its sharers)
  std::int64_t position = 0;  // its block index in the prompts that hold it (0: the first)
};

// Which blocks a tier keeps. Entries are slot numbers [0, capacity) of a tier; the tiers call
// configure once, then admit / added / used / removed / victim as blocks come and go. victim is
// called only on a tier whose every slot is taken, and removes what it returns.
class KvTierPolicy {
 public:
  virtual ~KvTierPolicy() = default;
  virtual void configure(std::span<const std::int64_t> capacities) = 0;  // blocks, per KvTier
  // Whether a block offered to `tier` is stored at all (false: dropped, or not demoted).
  virtual bool admit(KvTier tier, const KvTierBlockFacts& facts) = 0;
  virtual void added(KvTier tier, std::int32_t slot, const KvTierBlockFacts& facts) = 0;
  virtual void used(KvTier tier, std::int32_t slot) = 0;  // a prompt hit it
  virtual void removed(KvTier tier, std::int32_t slot) = 0;
  virtual std::int32_t victim(KvTier tier) = 0;  // the slot to give up (removed from the policy)
};

// A tier policy that gives up each tier's blocks in one EvictionOrder
// (kvlab/kv/eviction_order.hpp), a hit counting as a use: the lru and shared_first plugins are
// this with their order and their admit.
class OrderedTierPolicy : public KvTierPolicy {
 public:
  explicit OrderedTierPolicy(EvictionOrder order) : order_(order) {}
  void configure(std::span<const std::int64_t> capacities) override;
  void added(KvTier tier, std::int32_t slot, const KvTierBlockFacts& facts) override;
  void used(KvTier tier, std::int32_t slot) override;
  void removed(KvTier tier, std::int32_t slot) override;
  std::int32_t victim(KvTier tier) override;

 private:
  EvictionQueue& of(KvTier tier) { return queues_[static_cast<std::size_t>(tier)]; }
  EvictionOrder order_;
  std::vector<EvictionQueue> queues_;  // per tier: its slots in order_
  std::uint64_t clock_ = 0;            // ticks as blocks are added and hit
};

// The tiers a paged allocator is given (PluginContext::tiers). Capacities in bytes of the pool's
// dtype; 0 leaves a tier out. Not owned: the serving stack keeps the policy and the strings.
struct KvTierSpec {
  std::int64_t host_bytes = 0;
  std::int64_t disk_bytes = 0;
  const char* disk_directory = nullptr;  // where the disk tier's file is made (nullptr: $TMPDIR)
  KvTierPolicy* policy = nullptr;
};

// Cumulative counts, per KvTier where indexed.
struct KvTierCounters {
  std::int64_t hit_blocks[kKvTierCount] = {0, 0};    // blocks loaded back for a prompt
  std::int64_t bytes_loaded[kKvTierCount] = {0, 0};  // tier -> device
  std::int64_t bytes_stored[kKvTierCount] = {0, 0};  // device -> host, host -> disk
  // Block copies over each tier's link: host, the device <-> host link (a disk block loaded back
  // crosses it too); disk, the disk's reads and writes.
  std::int64_t copies[kKvTierCount] = {0, 0};
  std::int64_t dropped = 0;  // blocks no tier kept
  double copy_seconds = 0;   // what the real copies took here (0 without storage)
};

// Where a block was found: its tier and slot there.
struct KvTierHit {
  KvTier tier = KvTier::host;
  std::int32_t slot = 0;
};

class KvTiers final : public BlockEvictionSink {
 public:
  // Tiers for `pool`'s blocks of `block_size` slots (kvlab::Error without a policy). Whether the
  // copies are real is decided at the first one: a pool the cpu backend gave host storage to
  // copies (the host buffer and the disk file are made then); one without storage only counts;
  // one on a GPU is refused (kvlab::Error: no host copy of its K/V to take yet).
  KvTiers(const KvTierSpec& spec, KvPool& pool, std::int64_t block_size);
  ~KvTiers() override;
  KvTiers(const KvTiers&) = delete;
  KvTiers& operator=(const KvTiers&) = delete;

  std::int64_t capacity(KvTier tier) const { return tiers_[index(tier)].capacity; }
  std::int64_t size(KvTier tier) const { return tiers_[index(tier)].size; }
  const KvTierCounters& counters() const { return counters_; }
  // Why the disk tier turned off (a write failed: a full disk, a quota, ulimit -f): from then
  // on the blocks it would keep are dropped (recomputed when needed), the blocks on it still
  // load. Empty while it works.
  const std::string& disk_failure() const { return disk_failure_; }

  // The tier holding the prefix block `hash` with these tokens, the host first; nothing moves.
  std::optional<KvTierHit> find(std::uint64_t hash, std::span<const std::int32_t> tokens) const;
  // Copies a found block into device block `block` and counts the hit; returns the block's uses.
  // While loads are pending (pin), the blocks being loaded are never given up.
  std::int64_t load(const KvTierHit& hit, BlockId block);
  void pin(const KvTierHit& hit);
  void unpin_all();

  // The device evicts `block` (BlockEvictionSink): stored in the host tier if the policy admits it.
  void evicted(BlockId block, std::uint64_t hash, std::span<const std::int32_t> tokens,
               std::int64_t uses, std::int64_t position) override;

 private:
  struct Tier {
    std::int64_t capacity = 0, size = 0;
    BlockHashIndex index;                 // hash -> slot
    std::vector<std::uint64_t> hashes;    // per slot, 0: empty
    std::vector<std::int32_t> tokens;     // (capacity, block_size)
    std::vector<KvTierBlockFacts> facts;  // per slot
    std::vector<std::uint8_t> pinned;     // per slot
    std::vector<std::int32_t> free_slots;
  };
  static std::size_t index(KvTier tier) { return static_cast<std::size_t>(tier); }
  std::span<const std::int32_t> tokens_of(const Tier& tier, std::int32_t slot) const;
  // Stores a block into `tier`, making room by demoting (host) or dropping (disk) the policy's
  // victim. The bytes come from `source`: device block (host tier) or host slot (disk tier).
  void store(KvTier tier, std::uint64_t hash, std::span<const std::int32_t> tokens,
             const KvTierBlockFacts& facts, std::int64_t source);
  // A slot for a new block of `tier`, or nothing when the victim is pinned or the tier is empty.
  std::optional<std::int32_t> make_room(KvTier tier);
  void forget(KvTier tier, std::int32_t slot);
  // Byte copies (no-ops without storage): device block <-> host slot, host slot <-> disk slot.
  void copy_device_to_host(BlockId block, std::int32_t slot);
  void copy_host_to_device(std::int32_t slot, BlockId block);
  bool copy_host_to_disk(std::int32_t host_slot, std::int32_t disk_slot);  // false: turned off
  void copy_disk_to_device(std::int32_t slot, BlockId block);
  void scatter_to_device(const std::byte* in, BlockId block);
  bool real_copies();  // the pool has host storage: makes the buffer and the file the first time

  KvPool& pool_;
  std::int64_t block_size_;
  std::int64_t block_bytes_;  // K and V of one block, every layer, in the pool's dtype
  KvTierPolicy& policy_;
  Tier tiers_[kKvTierCount];
  bool storage_ready_ = false;
  std::string disk_directory_;
  std::vector<std::byte> host_;     // (host capacity, block_bytes): a block as the pool holds it
  std::vector<std::byte> scratch_;  // one block, for disk reads and writes
  int disk_fd_ = -1;
  std::string disk_path_;
  std::string disk_failure_;
  std::vector<std::pair<KvTier, std::int32_t>> pins_;
  KvTierCounters counters_;
};

}  // namespace kvlab
