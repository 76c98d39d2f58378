#pragma once
// KvAllocator: which slots of the KV pool belong to which sequence. A plugin kind.
//
// Plan, then commit: a scheduler tries a step's operations with plan_* on a const allocator
// (exact: a planned step always commits); the engine's apply_plan (kvlab/engine/apply.hpp)
// commits them with allocate / append / free. Failures are return values (false, nullopt),
// never exceptions: this interface crosses the plugin boundary.
// Allocators copy KV bytes themselves (grow-by-copy, copy-on-write) through the KvPool they
// were created with, and count those bytes.
#include <algorithm>
#include <boost/config.hpp>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kvlab/kv/prefix_hash.hpp"
#include "kvlab/kv_pool.hpp"

namespace kvlab {

using SequenceId = std::int64_t;

// The same numbers from every allocator, in slots unless named bytes/tokens (docs/allocators.md):
//   used + reserved_unused + last_block_slack + free = capacity
struct KvAllocatorStats {
  std::int64_t capacity = 0;  // slots in the pool
  std::int64_t used = 0;      // slots holding live tokens' KV (a shared slot counts once)
  std::int64_t reserved_unused =
      0;  // reserved ahead for a sequence's future tokens (static, dynamic)
  std::int64_t last_block_slack =
      0;                  // allocated but unfilled slots of partly-filled blocks (paged)
  std::int64_t free = 0;  // slots no live sequence holds (including evictable cached blocks)
  std::int64_t unusable_free =
      0;                         // free slots outside the largest free run (external fragmentation)
  std::int64_t cached_free = 0;  // free slots still holding reusable prefix-cache KV (paged)
  std::int64_t bytes_copied = 0;         // KV bytes moved by grow-by-copy and copy-on-write
  std::int64_t prefix_query_tokens = 0;  // prompt tokens looked up in the prefix cache
  std::int64_t prefix_hit_tokens = 0;    // of those, found with KV already in the pool
  std::int64_t evictions = 0;            // cached blocks reused for other data
  std::int64_t live_sequences = 0;
  // KV tiers below the pool (paged with [kv_tiers], kvlab/kv/kv_tiers.hpp), cumulative: of
  // prefix_hit_tokens, those loaded back from host memory and from disk; the bytes stored into
  // and loaded from each tier in the pool's dtype; the block copies over the device-host link
  // (a disk block loaded back crosses it too) and the disk's reads and writes; the blocks no
  // tier kept; and what the real copies took here (0 on a pool without storage).
  std::int64_t host_hit_tokens = 0, disk_hit_tokens = 0;
  std::int64_t host_bytes_stored = 0, host_bytes_loaded = 0;
  std::int64_t disk_bytes_stored = 0, disk_bytes_loaded = 0;
  std::int64_t host_copies = 0, disk_copies = 0;
  std::int64_t tier_dropped_blocks = 0;
  double tier_copy_seconds = 0;
};

struct AllocateRequest {
  SequenceId sequence = 0;
  std::span<const std::int32_t> prompt;  // the tokens whose KV the first forward writes
  std::int64_t max_total_tokens = 0;     // prompt + most tokens it may generate
  // The request's own prompt block hashes (RequestState::prefix_hashes), which a prefix-caching
  // allocator extends and reads instead of hashing the prompt on every lookup; nullptr: none
  // kept (the allocator hashes afresh).
  PrefixHashCache* prefix_hashes = nullptr;
};

struct AllocateResult {
  std::int64_t cached_tokens = 0;  // leading prompt tokens whose KV is already in the pool
};

// The pool as kvlab view draws it: runs of slots in one state, in slot order; the slots no run
// covers are free.
enum class KvSlotState : std::uint8_t {
  used,      // a sequence's live tokens' KV
  shared,    // live KV several sequences hold (a shared prefix block, a fork's blocks)
  copied,    // a block copied on write since the last map (its new holder's copy)
  reserved,  // reserved ahead for a sequence's future tokens (static, dynamic)
  slack,     // the unfilled slots of a sequence's partly-filled last block (paged)
  cached,    // free, but still holding a prefix's KV that a later request may reuse
};
inline const char* slot_state_name(KvSlotState state) {
  constexpr const char* kNames[] = {"used", "shared", "copied", "reserved", "slack", "cached"};
  return kNames[static_cast<std::size_t>(state)];
}

struct KvSlotRun {
  std::int64_t start = 0, length = 0;
  SequenceId owner = -1;  // the holder (shared: one of them); -1 for cached blocks
  KvSlotState state = KvSlotState::used;
  std::int32_t group = 0;  // the holder's KV group (kvlab/kv/kv_groups.hpp); 0 without groups
};

// Sorts runs by start (allocators that keep sequences in a hash map draw them in any order).
inline void sort_runs(std::vector<KvSlotRun>& runs) {
  std::sort(runs.begin(), runs.end(),
            [](const KvSlotRun& a, const KvSlotRun& b) { return a.start < b.start; });
}

struct KvPoolMap {
  std::vector<KvSlotRun> runs;  // ascending start, not overlapping
  // KV tiers below the pool: blocks each holds, of how many it can.
  std::int64_t host_blocks = 0, host_capacity = 0, disk_blocks = 0, disk_capacity = 0;
};

// What an allocator may offer beyond its core, each an interface of its own and a field of
// KvAllocatorFeatures (null: not offered). A new feature is a new interface and a new field: the
// allocators that do not offer it are not touched. The host asks KvAllocator::features() where
// it needs one, and says what is missing when a run needs it.

// Dropping positions a sequence will never read again: a sliding window's, a KV policy's.
class BOOST_SYMBOL_VISIBLE KvPositionDropping {
 public:
  // Tokens before `position` will never be read again (sliding window): free what can be.
  virtual void release_before(SequenceId sequence, std::int64_t position) = 0;
  // A KV policy (kvlab/kv_policy.hpp) keeps only `kept` (increasing, each a position the view
  // holds) of the sequence's positions: the others are never read again. The view then lists
  // the kept positions (KvView::positions) and the allocator frees what it can. false (nothing
  // changed) when it cannot drop them now (paged with prefix caching, whose blocks must keep
  // what their hashes say; no room to unshare a fork's blocks).
  virtual bool evict(SequenceId sequence, std::span<const std::int64_t> kept) = 0;

 protected:
  ~KvPositionDropping() = default;
};

// Rolling a sequence back (speculative decoding: proposed tokens the target rejected).
class BOOST_SYMBOL_VISIBLE KvRollback {
 public:
  // The sequence keeps its first `length` positions. Their slots return to the pool (a paged
  // sequence's whole blocks past the new end), nothing of them enters the prefix cache, no
  // block another sequence holds is written, and the next append writes from `length`. false
  // (nothing changed) when `length` is past its end, cuts into what mark_computed made
  // shareable, or cuts inside a block another sequence shares. A sequence that dropped
  // positions (evict) keeps those it holds below `length` (paged gives back its newest slots;
  // an allocator that cannot may refuse).
  virtual bool truncate(SequenceId sequence, std::int64_t length) = 0;

 protected:
  ~KvRollback() = default;
};

// Copying a sequence (parallel sampling).
class BOOST_SYMBOL_VISIBLE KvForking {
 public:
  // The child starts as a copy of the parent; false when the pool is full.
  virtual bool fork(SequenceId parent, SequenceId child) = 0;

 protected:
  ~KvForking() = default;
};

// Drawing the pool slot by slot (kvlab view; otherwise the engine draws the sequences' views as
// used). Called once every recorded step of a run's frames, so O(blocks) is fine.
class BOOST_SYMBOL_VISIBLE KvPoolDrawing {
 public:
  virtual void pool_map(KvPoolMap& map) const = 0;  // into `map`, cleared first

 protected:
  ~KvPoolDrawing() = default;
};

// Looking a prompt up in the prefix cache without allocating (KV groups: the hit every group
// holds, kvlab/kv/kv_groups.hpp; vLLM's find_longest_cache_hit).
class BOOST_SYMBOL_VISIBLE KvPrefixLookup {
 public:
  // The leading prompt tokens allocate(request) would find cached in the pool now (whole
  // blocks; 0 without prefix caching).
  virtual std::int64_t cached_prefix_tokens(const AllocateRequest& request) const = 0;
  // Holds the pool blocks of the prompt's first `tokens` cached tokens (whole blocks, at most
  // cached_prefix_tokens) until release_prefix with the same arguments, so that no allocation
  // in between reuses them for other data: KV groups hold every group's hit before any group
  // takes a fresh block. Nothing else changes (a held free block leaves the free queue).
  virtual void hold_prefix(const AllocateRequest& request, std::int64_t tokens) = 0;
  virtual void release_prefix(const AllocateRequest& request, std::int64_t tokens) = 0;

 protected:
  ~KvPrefixLookup() = default;
};

struct KvLayerGroups;  // kvlab/kv/kv_groups.hpp

// A sequence's view in each KV group (kvlab/kv/kv_groups.hpp: a pool slot holds one token's K/V
// in one group's layers; GroupedKvAllocator offers it).
class BOOST_SYMBOL_VISIBLE KvGroupViewing {
 public:
  virtual const KvLayerGroups& layer_groups() const = 0;
  virtual KvView group_view(SequenceId sequence, std::int64_t group) const = 0;

 protected:
  ~KvGroupViewing() = default;
};

// Dropping positions group by group (GroupedKvAllocator, kvlab/kv/kv_groups.hpp): a KV policy
// whose layers keep different positions frees, in each KV group, what none of the group's
// layers keeps.
class BOOST_SYMBOL_VISIBLE KvGroupDropping {
 public:
  // kept[g] (one list a group, increasing): the positions group g keeps of those its view
  // holds; group 0's (the global layers') hold every other group's. false (nothing changed)
  // when group 0 cannot drop them now (KvPositionDropping::evict).
  virtual bool evict_groups(SequenceId sequence,
                            std::span<const std::vector<std::int64_t>> kept) = 0;

 protected:
  ~KvGroupDropping() = default;
};

struct KvAllocatorFeatures {
  KvPositionDropping* dropping = nullptr;
  KvRollback* rollback = nullptr;
  KvForking* forking = nullptr;
  const KvPoolDrawing* drawing = nullptr;
  const KvGroupViewing* groups = nullptr;
  KvPrefixLookup* prefix_lookup = nullptr;
  KvGroupDropping* group_dropping = nullptr;
};

// The core every allocator has: commits, planning, queries.
class BOOST_SYMBOL_VISIBLE KvAllocator {
 public:
  virtual ~KvAllocator() = default;

  // --- Commits: called by apply_plan only, in the order described under Planning. ---
  // Gives a new sequence room for its prompt (and, by policy, more). The sequence's length
  // becomes prompt.size(). nullopt (nothing changed) when it does not fit.
  virtual std::optional<AllocateResult> allocate(const AllocateRequest& request) = 0;
  // Extends the sequence by tokens.size() tokens (ids given for prefix hashing); the new slots
  // are the sequence's own (copy-on-write done). false (nothing changed) when there is no room.
  virtual bool append(SequenceId sequence, std::span<const std::int32_t> tokens) = 0;
  // The backend has written KV for the sequence's first `computed_tokens` tokens: full blocks
  // up to there may now be shared through the prefix cache. Default: nothing to share.
  virtual void mark_computed(SequenceId sequence, std::int64_t computed_tokens) {
    (void)sequence;
    (void)computed_tokens;
  }
  // Ends the sequence; its slots return to the pool (cached blocks stay reusable). Freeing a
  // sequence it does not hold does nothing.
  virtual void free(SequenceId sequence) = 0;

  // --- Planning (llama.cpp's prepare, vLLM's allocate-or-refuse): exact answers for a whole
  // step. A scheduler tries the step's operations on the allocator's scratch state in the order
  // apply_plan commits them: first every sequence the step frees (preempted ones), then
  // allocations and appends in plan order. Each plan_* call that returns true is a promise:
  // committing the same operations in the same order succeeds. false changes nothing.
  // Const: the scratch is the allocator's own planning state, never the pool or a sequence.
  virtual void plan_reset() const = 0;  // scratch := the allocator as it is now
  virtual void plan_free(SequenceId sequence) const = 0;
  virtual bool plan_allocate(const AllocateRequest& request) const = 0;
  virtual bool plan_append(SequenceId sequence, std::int64_t tokens) const = 0;

  // --- Queries ---
  // Slots allocate(request) takes from the free pool now (prefix-cache hits counted). The engine
  // rejects a request whose whole sequence needs more than the pool's capacity.
  virtual std::int64_t slots_to_allocate(const AllocateRequest& request) const = 0;
  virtual KvView view(SequenceId sequence) const = 0;
  // view(sequence) for a caller that reads no slot (the engine when its pool has neither host
  // storage nor a device: the simulated backend prices views by their positions): the same
  // first_position and positions, its extents may be one {start_slot -1, length()}. A paged
  // view holds an extent a block once blocks come back from the free queue in any order, and
  // copying them each step cost a whole-trace replay 8% of its time. Default: view(sequence).
  virtual KvView positions_view(SequenceId sequence) const { return view(sequence); }
  virtual KvAllocatorStats stats() const = 0;

  // --- What else it offers (see KvAllocatorFeatures) ---
  virtual KvAllocatorFeatures features() { return {}; }
};

}  // namespace kvlab
