#include "kvlab/kv/kv_tiers.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// Adds the seconds from construction to destruction to `total`.
class CopyTimer {
 public:
  explicit CopyTimer(double& total) : total_(total) {}
  ~CopyTimer() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  CopyTimer(const CopyTimer&) = delete;
  CopyTimer& operator=(const CopyTimer&) = delete;

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

std::string disk_tier_template(const char* directory) {
  std::filesystem::path folder = directory != nullptr && *directory != '\0'
                                     ? std::filesystem::path(directory)
                                     : std::filesystem::temp_directory_path();
  return (folder / "kvlab-kv-disk-tier-XXXXXX").string();
}

}  // namespace

void OrderedTierPolicy::configure(std::span<const std::int64_t> capacities) {
  queues_.clear();
  for (std::int64_t capacity : capacities) queues_.emplace_back(capacity, order_);
}

void OrderedTierPolicy::added(KvTier tier, std::int32_t slot, const KvTierBlockFacts& facts) {
  of(tier).add(slot, {++clock_, facts.uses});
}

void OrderedTierPolicy::used(KvTier tier, std::int32_t slot) {
  of(tier).update(slot, {++clock_, of(tier).facts(slot).uses + 1});
}

void OrderedTierPolicy::removed(KvTier tier, std::int32_t slot) {
  of(tier).remove(slot);
}

std::int32_t OrderedTierPolicy::victim(KvTier tier) {
  return of(tier).victim();
}

const char* kv_tier_name(KvTier tier) {
  return tier == KvTier::host ? "host" : "disk";
}

KvTiers::KvTiers(const KvTierSpec& spec, KvPool& pool, std::int64_t block_size)
    : pool_(pool),
      block_size_(block_size),
      block_bytes_(pool.bytes_per_slot() * block_size),
      policy_(spec.policy != nullptr ? *spec.policy
                                     : throw Error("internal: KV tiers need a tier policy")),
      disk_directory_(spec.disk_directory != nullptr ? spec.disk_directory : "") {
  const std::int64_t bytes[kKvTierCount] = {spec.host_bytes, spec.disk_bytes};
  if (spec.disk_bytes > 0 && spec.host_bytes <= 0)
    throw Error(
        "KV tiers: the disk tier sits below host memory (blocks reach it when host memory "
        "gives them up); give host memory a capacity too");
  std::int64_t capacities[kKvTierCount];
  for (int t = 0; t < kKvTierCount; ++t) {
    Tier& tier = tiers_[t];
    tier.capacity = capacities[t] = std::max<std::int64_t>(bytes[t], 0) / block_bytes_;
    if (bytes[t] > 0 && tier.capacity == 0)
      throw Error(fmt::format(
          "KV tiers: the {} tier's {} bytes hold no block ({} bytes: {} tokens of K and V in "
          "every layer)",
          kv_tier_name(static_cast<KvTier>(t)), bytes[t], block_bytes_, block_size));
    tier.index = BlockHashIndex(tier.capacity);
    tier.hashes.assign(static_cast<std::size_t>(tier.capacity), 0);
    tier.tokens.assign(static_cast<std::size_t>(tier.capacity * block_size), 0);
    tier.facts.assign(static_cast<std::size_t>(tier.capacity), {});
    tier.pinned.assign(static_cast<std::size_t>(tier.capacity), 0);
    for (auto s = static_cast<std::int32_t>(tier.capacity) - 1; s >= 0; --s)
      tier.free_slots.push_back(s);
  }
  policy_.configure(capacities);
}

bool KvTiers::real_copies() {
  if (storage_ready_) return true;
  if (!pool_.has_storage()) {
    if (pool_.device() != nullptr)
      throw Error(
          "KV tiers: the pool's K/V live on a GPU, and the tiers copy only a host pool's blocks "
          "(cpu backend) or price them (simulated backend)");
    return false;
  }
  host_.resize(static_cast<std::size_t>(capacity(KvTier::host) * block_bytes_));
  scratch_.resize(static_cast<std::size_t>(block_bytes_));
  storage_ready_ = true;
  if (capacity(KvTier::disk) == 0) return true;
  std::string path = disk_tier_template(disk_directory_.c_str());
  disk_fd_ = ::mkstemp(path.data());
  if (disk_fd_ < 0)
    throw Error(
        fmt::format("KV disk tier: cannot create a file like {}: {}", path, std::strerror(errno)));
  // Unlinked at once: the file lives as long as the tiers, and nothing is left behind on a crash.
  ::unlink(path.c_str());
  disk_path_ = path;
  return true;
}

KvTiers::~KvTiers() {
  if (disk_fd_ >= 0) ::close(disk_fd_);
}

std::span<const std::int32_t> KvTiers::tokens_of(const Tier& tier, std::int32_t slot) const {
  return std::span<const std::int32_t>(tier.tokens)
      .subspan(static_cast<std::size_t>(slot * block_size_), static_cast<std::size_t>(block_size_));
}

std::optional<KvTierHit> KvTiers::find(std::uint64_t hash,
                                       std::span<const std::int32_t> tokens) const {
  for (int t = 0; t < kKvTierCount; ++t) {
    const Tier& tier = tiers_[t];
    const std::optional<BlockId> slot = tier.index.find(hash);
    if (!slot) continue;
    const auto held = tokens_of(tier, *slot);
    if (std::equal(held.begin(), held.end(), tokens.begin(), tokens.end()))
      return KvTierHit{static_cast<KvTier>(t), *slot};
  }
  return std::nullopt;
}

void KvTiers::pin(const KvTierHit& hit) {
  tiers_[index(hit.tier)].pinned[static_cast<std::size_t>(hit.slot)] = 1;
  pins_.emplace_back(hit.tier, hit.slot);
}

void KvTiers::unpin_all() {
  for (const auto& [tier, slot] : pins_)
    tiers_[index(tier)].pinned[static_cast<std::size_t>(slot)] = 0;
  pins_.clear();
}

std::int64_t KvTiers::load(const KvTierHit& hit, BlockId block) {
  const auto t = index(hit.tier);
  if (hit.tier == KvTier::host)
    copy_host_to_device(hit.slot, block);
  else
    copy_disk_to_device(hit.slot, block);
  ++counters_.hit_blocks[t];
  counters_.bytes_loaded[t] += block_bytes_;
  ++counters_.copies[t];
  if (hit.tier == KvTier::disk) ++counters_.copies[index(KvTier::host)];  // disk -> host -> device
  policy_.used(hit.tier, hit.slot);
  KvTierBlockFacts& facts = tiers_[t].facts[static_cast<std::size_t>(hit.slot)];
  return ++facts.uses;
}

void KvTiers::evicted(BlockId block, std::uint64_t hash, std::span<const std::int32_t> tokens,
                      std::int64_t uses, std::int64_t position) {
  Tier& host = tiers_[index(KvTier::host)];
  if (const std::optional<BlockId> slot = host.index.find(hash)) {  // inclusive: already kept
    KvTierBlockFacts& facts = host.facts[static_cast<std::size_t>(*slot)];
    facts.uses = std::max(facts.uses, uses);
    policy_.used(KvTier::host, *slot);
    return;
  }
  store(KvTier::host, hash, tokens, {uses, position}, block);
}

std::optional<std::int32_t> KvTiers::make_room(KvTier which) {
  Tier& tier = tiers_[index(which)];
  if (tier.capacity == 0 || (which == KvTier::disk && !disk_failure_.empty())) return std::nullopt;
  if (!tier.free_slots.empty()) {
    const std::int32_t slot = tier.free_slots.back();
    tier.free_slots.pop_back();
    return slot;
  }
  const std::int32_t victim = policy_.victim(which);
  if (victim < 0 || victim >= tier.capacity || tier.hashes[static_cast<std::size_t>(victim)] == 0)
    throw Error(fmt::format("KV tier policy: victim {} of the {} tier is not a block it holds",
                            victim, kv_tier_name(which)));
  const auto v = static_cast<std::size_t>(victim);
  if (tier.pinned[v] != 0) {  // being loaded this allocation: kept, the newcomer is not stored
    policy_.added(which, victim, tier.facts[v]);
    return std::nullopt;
  }
  if (which == KvTier::host) {  // demoted: the host copy is the disk write's source
    const std::uint64_t hash = tier.hashes[v];
    if (!tiers_[index(KvTier::disk)].index.find(hash))
      store(KvTier::disk, hash, tokens_of(tier, victim), tier.facts[v], victim);
  } else {
    ++counters_.dropped;
  }
  forget(which, victim);
  tier.free_slots.pop_back();  // forget freed it; it is the new block's
  return victim;
}

void KvTiers::store(KvTier which, std::uint64_t hash, std::span<const std::int32_t> tokens,
                    const KvTierBlockFacts& facts, std::int64_t source) {
  Tier& tier = tiers_[index(which)];
  if (!policy_.admit(which, facts)) {
    ++counters_.dropped;
    return;
  }
  const std::optional<std::int32_t> slot = make_room(which);
  if (!slot) {
    ++counters_.dropped;
    return;
  }
  const auto s = static_cast<std::size_t>(*slot);
  if (which == KvTier::host) {
    copy_device_to_host(static_cast<BlockId>(source), *slot);
  } else if (!copy_host_to_disk(static_cast<std::int32_t>(source), *slot)) {
    tier.free_slots.push_back(*slot);  // nothing was kept: a cache that cannot grow, not an error
    ++counters_.dropped;
    return;
  }
  counters_.bytes_stored[index(which)] += block_bytes_;
  ++counters_.copies[index(which)];
  tier.hashes[s] = hash;
  std::copy(
      tokens.begin(), tokens.end(),
      tier.tokens.begin() + static_cast<std::ptrdiff_t>(s * static_cast<std::size_t>(block_size_)));
  tier.facts[s] = facts;
  tier.index.insert(hash, *slot);
  ++tier.size;
  policy_.added(which, *slot, facts);
}

// The slot's block leaves the tier (the policy has already let it go).
void KvTiers::forget(KvTier which, std::int32_t slot) {
  Tier& tier = tiers_[index(which)];
  const auto s = static_cast<std::size_t>(slot);
  tier.index.erase(tier.hashes[s]);
  tier.hashes[s] = 0;
  tier.facts[s] = {};
  --tier.size;
  tier.free_slots.push_back(slot);
}

// Device block b is slots [b x block_size, (b + 1) x block_size) of every layer, K and V: one run
// of bytes per layer and half. A host slot holds them as (layers, 2, block_size, slot_width).
void KvTiers::copy_device_to_host(BlockId block, std::int32_t slot) {
  if (!real_copies()) return;
  CopyTimer timer(counters_.copy_seconds);
  const std::int64_t run = block_bytes_ / (2 * pool_.shape().layers);
  std::byte* out = host_.data() + static_cast<std::ptrdiff_t>(slot) * block_bytes_;
  for (std::int64_t layer = 0; layer < pool_.shape().layers; ++layer) {
    const std::int64_t first = std::int64_t{block} * block_size_;
    out = std::copy_n(pool_.key_bytes(layer, first), run, out);
    out = std::copy_n(pool_.value_bytes(layer, first), run, out);
  }
}

void KvTiers::copy_host_to_device(std::int32_t slot, BlockId block) {
  if (!real_copies()) return;
  CopyTimer timer(counters_.copy_seconds);
  scatter_to_device(host_.data() + static_cast<std::ptrdiff_t>(slot) * block_bytes_, block);
}

// A block as a host slot holds it, (layers, K then V, block_size, slot_width), into device block
// `block`'s slots of every layer.
void KvTiers::scatter_to_device(const std::byte* in, BlockId block) {
  const std::int64_t run = block_bytes_ / (2 * pool_.shape().layers);
  const std::int64_t first = std::int64_t{block} * block_size_;
  for (std::int64_t layer = 0; layer < pool_.shape().layers; ++layer, in += 2 * run) {
    std::copy_n(in, run, pool_.key_bytes(layer, first));
    std::copy_n(in + run, run, pool_.value_bytes(layer, first));
  }
}

bool KvTiers::copy_host_to_disk(std::int32_t host_slot, std::int32_t disk_slot) {
  if (!real_copies()) return true;
  CopyTimer timer(counters_.copy_seconds);
  const std::byte* in = host_.data() + static_cast<std::ptrdiff_t>(host_slot) * block_bytes_;
  const off_t offset = static_cast<off_t>(disk_slot) * block_bytes_;
  for (std::int64_t done = 0; done < block_bytes_;) {
    const ssize_t n =
        ::pwrite(disk_fd_, in + done, static_cast<std::size_t>(block_bytes_ - done), offset + done);
    if (n <= 0) {
      disk_failure_ = fmt::format("writing {} bytes to {} failed: {}", block_bytes_, disk_path_,
                                  n < 0 ? std::strerror(errno) : "no space");
      fmt::print(stderr,
                 "kvlab: warning: the KV disk tier turned off ({}); the blocks it would keep are "
                 "dropped from now on (recomputed when needed), those on it still load\n",
                 disk_failure_);
      return false;
    }
    done += n;
  }
  return true;
}

void KvTiers::copy_disk_to_device(std::int32_t slot, BlockId block) {
  if (!real_copies()) return;
  CopyTimer timer(counters_.copy_seconds);
  const off_t offset = static_cast<off_t>(slot) * block_bytes_;
  for (std::int64_t done = 0; done < block_bytes_;) {
    const ssize_t n = ::pread(disk_fd_, scratch_.data() + done,
                              static_cast<std::size_t>(block_bytes_ - done), offset + done);
    if (n <= 0)
      throw Error(fmt::format("KV disk tier: reading {} bytes back from {} failed: {}",
                              block_bytes_, disk_path_,
                              n < 0 ? std::strerror(errno) : "short file"));
    done += n;
  }
  scatter_to_device(scratch_.data(), block);
}

}  // namespace kvlab
