// paged: fixed-size blocks, a block table per sequence, reference counts, copy-on-write fork,
// and automatic prefix caching (vLLM's PagedAttention memory manager). The blocks, their free
// queue, the prefix cache and its eviction policy are kvlab::BlockPool (kvlab/kv/block_pool.hpp);
// this plugin keeps the per-sequence block tables and plans steps (PagedPlan).
//
// Prefix caching: a full block is identified by a chained hash of its tokens and of every token
// before it (kvlab/kv/prefix_hash.hpp); once the backend has written its KV (mark_computed) the
// block is registered, and a later prompt that starts with the same tokens reuses it read-only.
// A request's prompt hashes are computed once and kept with it (AllocateRequest::prefix_hashes).
// KV tiers (PluginContext::tiers, kvlab/kv/kv_tiers.hpp): a cached block the pool evicts goes
// down to host memory or disk, and a prompt's hit chain continues through blocks found there,
// each loaded back into a fresh block. Planning counts only the device's hits (a tier hit takes
// a block like a miss), so a plan stays a promise whatever the tiers hold by commit time.
// NOTE: full blocks are never written again; only a sequence's last, partly filled block is
// written, and it is copied first when shared (fork).
#include <algorithm>
#include <memory>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/kv/prefix_hash.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

// Slot index i of a sequence is slot i % block_size of block table[i / block_size]. Until a KV
// policy drops positions (evict), slot index i holds position i; after, slot_positions says
// which position each holds (-1: dropped), and `slots` counts the indices in use.
struct Sequence {
  std::vector<BlockId> table;  // block per block index; -1 once released (window, KV policy)
  // Chain hashes of its full blocks: the prompt's (from its lookup) and then each computed
  // block's; blocks [0, computed_blocks) are registered in the prefix cache.
  std::vector<std::uint64_t> hashes;
  std::uint64_t salt = 0;  // the chain's start (the request's cache salt)
  std::vector<std::int32_t> tokens;
  std::int64_t length = 0;                   // positions written
  std::int64_t slots = 0;                    // slot indices in use (== length before an eviction)
  std::vector<std::int64_t> slot_positions;  // per slot index after an eviction; else empty
  std::int64_t computed_blocks = 0;
  std::int64_t first_block = 0;  // blocks before it were released
  KvView view;                   // table[first_block..] as merged slot extents
  std::size_t plan_slot = 0;     // its row in PagedPlan's marks
};

// A step being planned (KvAllocator::plan_*): the free blocks and the reference counts that the
// plan's operations so far leave, and which sequences it has touched (freed, or appended to).
// Reset by each plan_reset.
class PagedPlan {
 public:
  void reset(std::int64_t free_blocks, std::int64_t free_plain) {
    free_blocks_ = free_blocks;
    free_plain_ = free_plain;
    taken_ = 0;
    ++epoch_;
  }
  // Marks the sequence as touched by this plan; false when it already was.
  bool touch(const Sequence& s, bool freed) {
    if (s.plan_slot >= marks_.size()) marks_.resize(s.plan_slot + 1);
    Mark& mark = marks_[s.plan_slot];
    if (mark.epoch == epoch_) return false;
    mark = {epoch_, freed};
    return true;
  }
  bool touched(const Sequence& s) const {
    return s.plan_slot < marks_.size() && marks_[s.plan_slot].epoch == epoch_;
  }
  bool freed(const Sequence& s) const { return touched(s) && marks_[s.plan_slot].freed; }
  // Takes `blocks` free blocks; false (nothing taken) when too few are left.
  bool take(std::int64_t blocks) {
    if (blocks > free_blocks_) return false;
    free_blocks_ -= blocks;
    taken_ += blocks;
    return true;
  }
  void give_back_one() { ++free_blocks_; }
  // Once the plan has taken more blocks than there were plain free ones, the commits before an
  // allocation may evict cached blocks.
  bool evictions_possible() const { return taken_ > free_plain_; }
  // The block's reference count as the plan leaves it (the pool's until the plan changes it).
  std::int32_t& ref(BlockId block, const BlockPool& pool) {
    if (refs_.empty()) refs_.resize(static_cast<std::size_t>(pool.blocks()));
    PlannedRefs& planned = refs_[static_cast<std::size_t>(block)];
    if (planned.epoch != epoch_) planned = {epoch_, pool.ref_count(block)};
    return planned.refs;
  }
  std::vector<BlockId> hits;  // plan_allocate's prefix hits (kept: no allocation per call)

 private:
  struct Mark {
    std::uint64_t epoch = 0;
    bool freed = false;
  };
  struct PlannedRefs {
    std::uint64_t epoch = 0;  // the plan that set refs; an older one: the pool's count holds
    std::int32_t refs = 0;
  };
  std::int64_t free_blocks_ = 0, free_plain_ = 0, taken_ = 0;
  std::vector<PlannedRefs> refs_;  // per block
  std::vector<Mark> marks_;        // per plan slot
  std::uint64_t epoch_ = 0;
};

class PagedAllocator final : public KvAllocator {
 public:
  PagedAllocator(const PluginParams& params, const PluginContext& context)
      : pool_(checked_pool(context.pool, params.integer("block_size"))),
        block_size_(params.integer("block_size")),
        caching_(params.boolean("prefix_caching")),
        blocks_(pool_->shape().slots / block_size_, block_size_, caching_),
        tiers_(make_tiers(context.tiers)) {
    if (tiers_) blocks_.set_eviction_sink(tiers_.get());
  }

  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return blocks_from_free(r, hit_chain(r)) * block_size_;
  }

  // Planning: a freed sequence drops a reference on each of its blocks (a block nobody else
  // holds becomes free). An allocation takes a free block for each block of its prompt beyond
  // its prefix hits on blocks someone holds; a hit on a free cached block takes that block from
  // the free queue. Once evictions are possible the hit chain stops at its first free cached
  // block. An append takes its new blocks and a copy-on-write copy (against the real reference
  // count: conservative).
  void plan_reset() const override {
    plan_.reset(blocks_.free_blocks(), blocks_.free_plain_count());
  }
  void plan_free(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || !plan_.touch(it->second, true)) return;
    for (BlockId b : it->second.table)
      if (b >= 0 && --plan_.ref(b, blocks_) == 0) plan_.give_back_one();
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    if (auto it = sequences_.find(r.sequence); it != sequences_.end() && !plan_.freed(it->second))
      return false;  // an existing sequence is allocated again only after the plan freed it
    const bool evictions_possible = plan_.evictions_possible();
    plan_.hits.clear();
    std::int64_t held = 0;  // hits on blocks someone holds: no free block taken for them
    visit_hits(r, [&](BlockId b) {
      const std::int32_t refs = plan_.ref(b, blocks_);
      if (refs == 0 && evictions_possible) return false;
      plan_.hits.push_back(b);
      held += refs > 0 ? 1 : 0;
      return true;
    });
    if (!plan_.take(blocks_for(static_cast<std::int64_t>(r.prompt.size())) - held)) return false;
    for (BlockId b : plan_.hits) ++plan_.ref(b, blocks_);
    return true;
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || plan_.touched(it->second)) return false;
    if (!plan_.take(new_blocks_for_append(it->second, tokens))) return false;
    plan_.touch(it->second, false);
    return true;
  }

  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (sequences_.count(r.sequence)) return std::nullopt;
    const auto length = static_cast<std::int64_t>(r.prompt.size());
    const std::vector<ChainBlock>& chain = hit_chain(r);
    if (blocks_from_free(r, chain) > blocks_.free_blocks()) return std::nullopt;
    Sequence s;
    take_hits(chain, r.prompt, s);
    if (caching_) {  // the lookup's hashes (kept by the request): computed blocks reuse them
      s.salt = r.prefix_hashes != nullptr ? r.prefix_hashes->salt : 0;
      const auto prompt_hashes = prompt_block_hashes(r);
      s.hashes.assign(prompt_hashes.begin(), prompt_hashes.end());
    }
    const auto hits = static_cast<std::int64_t>(s.table.size());
    s.computed_blocks = hits;
    while (static_cast<std::int64_t>(s.table.size()) < blocks_for(length))
      s.table.push_back(take_block());
    s.tokens.assign(r.prompt.begin(), r.prompt.end());
    s.length = s.slots = length;
    s.plan_slot = take_plan_slot();
    fill_blocks_from(s, hits);
    rebuild_view(s);
    prefix_query_tokens_ += caching_ ? length : 0;
    prefix_hit_tokens_ += hits * block_size_;
    sequences_.emplace(r.sequence, std::move(s));
    return AllocateResult{hits * block_size_};
  }

  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    Sequence& s = it->second;
    const auto n = static_cast<std::int64_t>(tokens.size());
    if (new_blocks_for_append(s, n) > blocks_.free_blocks()) return false;
    if (n == 0) return true;
    const std::int64_t last_fill = s.slots % block_size_;
    if (last_fill != 0) {  // the last block gets written: make it ours
      if (s.slot_positions.empty()) trim_view(s, last_fill);
      const BlockId last = s.table.back();
      if (blocks_.ref_count(last) > 1) {
        const BlockId copy = take_block();
        bytes_copied_ += pool_->copy_slots(std::int64_t{last} * block_size_,
                                           std::int64_t{copy} * block_size_, last_fill);
        release_block(last);
        s.table.back() = copy;
        mark_copied(copy);
      }
    }
    const std::int64_t first_written = s.slots / block_size_;
    if (!s.slot_positions.empty())
      for (std::int64_t p = s.length; p < s.length + n; ++p) s.slot_positions.push_back(p);
    s.length += n;
    s.slots += n;
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    while (static_cast<std::int64_t>(s.table.size()) < blocks_for(s.slots))
      s.table.push_back(take_block());
    if (s.slot_positions.empty()) {
      fill_blocks_from(s, first_written);
      extend_view(s, first_written);
    } else {
      rebuild_view(s);
    }
    return true;
  }

  void mark_computed(SequenceId id, std::int64_t computed_tokens) override {
    if (!caching_) return;
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    if (!s.slot_positions.empty()) return;  // never: evict refuses a prefix-caching pool
    const std::int64_t full = std::min(computed_tokens, s.length) / block_size_;
    for (std::int64_t i = s.computed_blocks; i < full; ++i) {
      if (i + kPrefetchAhead < static_cast<std::int64_t>(s.hashes.size()))
        blocks_.prefetch(s.hashes[index(i + kPrefetchAhead)]);
      const auto block_tokens = block_of(s.tokens, i);
      if (i == static_cast<std::int64_t>(s.hashes.size()))  // never more: i counts up from
        s.hashes.push_back(                                 // computed_blocks <= hashes.size()
            chain_block_hash(i == 0 ? s.salt : s.hashes[index(i - 1)], block_tokens));
      const BlockId b = s.table[index(i)];
      if (b >= 0) blocks_.register_prefix(b, s.hashes[index(i)], block_tokens, i);  // -1: released
    }
    s.computed_blocks = std::max(s.computed_blocks, full);
  }

  void release_before(SequenceId id, std::int64_t position) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    if (!s.slot_positions.empty()) {  // positions before `position` dropped like an eviction's
      if (!own_blocks(s)) return;     // no room to unshare: nothing freed (allowed)
      for (std::int64_t& p : s.slot_positions)
        if (p < position) p = -1;
      release_dropped(s);
      return;
    }
    const std::int64_t whole_blocks = std::min(position, s.length) / block_size_;
    if (s.first_block >= whole_blocks) return;
    for (; s.first_block < whole_blocks; ++s.first_block) {
      release_block(s.table[index(s.first_block)]);
      s.table[index(s.first_block)] = -1;
    }
    rebuild_view(s);
  }

  // Drops the positions not kept; releases each block (the last excepted) left with none, and
  // once the dropped slots in held blocks make a block's worth, moves the kept ones down into
  // the first blocks (the policy's compaction) and releases the rest.
  bool evict(SequenceId id, std::span<const std::int64_t> kept) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || caching_) return false;
    Sequence& s = it->second;
    if (!own_blocks(s)) return false;
    number_slots(s);
    std::size_t k = 0;
    for (std::int64_t& p : s.slot_positions) {
      if (p < 0) continue;
      while (k < kept.size() && kept[k] < p) ++k;
      if (k == kept.size() || kept[k] != p) p = -1;
    }
    release_dropped(s);
    return true;
  }

  // Whole blocks past the new end are released (last first); a cut inside a block leaves it the
  // sequence's last, partly filled. Blocks mark_computed registered are never cut, so no hash of
  // a rolled-back token is in the prefix cache, and a cut inside a shared block is refused: its
  // other holders see its fill.
  bool truncate(SequenceId id, std::int64_t length) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    Sequence& s = it->second;
    if (length < 0 || length > s.length || !s.slot_positions.empty()) return false;
    if (length < s.computed_blocks * block_size_ || length < s.first_block * block_size_)
      return false;
    const std::int64_t keep = blocks_for(length);
    if (length < s.length && length % block_size_ != 0 &&
        blocks_.ref_count(s.table[index(keep - 1)]) > 1)
      return false;
    while (static_cast<std::int64_t>(s.table.size()) > keep) {
      release_block(s.table.back());
      s.table.pop_back();
    }
    s.length = s.slots = length;
    s.tokens.resize(index(length));
    s.hashes.resize(std::min(s.hashes.size(), index(length / block_size_)));
    if (keep > 0 && s.table.back() >= 0)
      blocks_.set_fill(s.table.back(), length - (keep - 1) * block_size_);
    rebuild_view(s);
    return true;
  }

  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child)) return false;
    Sequence copy = it->second;
    for (BlockId b : copy.table)
      if (b >= 0) blocks_.hold(b);
    copy.plan_slot = take_plan_slot();
    sequences_.emplace(child, std::move(copy));
    return true;
  }

  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    // Last block first into the eviction queue, so a shared prefix's first blocks go last.
    for (auto b = it->second.table.rbegin(); b != it->second.table.rend(); ++b)
      if (*b >= 0) release_block(*b);
    free_plan_slots_.push_back(it->second.plan_slot);
    sequences_.erase(it);
  }

  // Kept up to date by every change of the sequence: O(1) per step instead of O(its blocks).
  KvView view(SequenceId id) const override { return sequences_.at(id).view; }
  KvView positions_view(SequenceId id) const override {
    const KvView& view = sequences_.at(id).view;
    return {{{-1, view.length()}}, view.first_position, view.positions};
  }

  // Block by block: who holds it (several: shared; copied on write since the last map: copied),
  // its filled slots and the rest of it as slack; free blocks that keep a prefix: cached. A
  // sequence with dropped positions (a KV policy's) has holes: its blocks are drawn slot by slot.
  bool pool_map(KvPoolMap& map) const override {
    map = {};
    const auto blocks = static_cast<std::size_t>(blocks_.blocks());
    struct Holder {
      SequenceId id = -1;
      const Sequence* sequence = nullptr;
      std::int64_t index = 0;  // the block's index in the sequence's table
    };
    std::vector<Holder> holder(blocks);
    for (const auto& [id, s] : sequences_)
      for (std::size_t k = 0; k < s.table.size(); ++k)
        if (s.table[k] >= 0)
          holder[static_cast<std::size_t>(s.table[k])] = {id, &s, static_cast<std::int64_t>(k)};
    std::vector<bool> copied(blocks, false);
    copied.swap(copied_since_map_);
    copied.resize(blocks, false);
    for (BlockId b = 0; b < blocks_.blocks(); ++b) {
      const Holder& h = holder[static_cast<std::size_t>(b)];
      if (h.sequence != nullptr && !h.sequence->slot_positions.empty())
        add_holey_block_runs(map.runs, b, h.id, *h.sequence, h.index);
      else
        add_block_runs(map.runs, b, h.id, copied[static_cast<std::size_t>(b)]);
    }
    if (tiers_) {
      map.host_blocks = tiers_->size(KvTier::host);
      map.host_capacity = tiers_->capacity(KvTier::host);
      map.disk_blocks = tiers_->size(KvTier::disk);
      map.disk_capacity = tiers_->capacity(KvTier::disk);
    }
    return true;
  }
  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = pool_->shape().slots;
    // Kept as the blocks change (O(1); a shared block counts once): every holder of a block
    // sees the same filled slots, since only a block held once is written.
    const std::int64_t live_blocks = blocks_.blocks() - blocks_.free_blocks();
    st.used = blocks_.live_fill();
    st.last_block_slack = live_blocks * block_size_ - st.used;
    st.free = blocks_.free_blocks() * block_size_;
    st.cached_free = blocks_.free_cached_count() * block_size_;
    st.unusable_free = 0;  // any free block serves any sequence
    st.bytes_copied = bytes_copied_;
    st.prefix_query_tokens = prefix_query_tokens_;
    st.prefix_hit_tokens = prefix_hit_tokens_;
    st.evictions = blocks_.evictions();
    st.live_sequences = static_cast<std::int64_t>(sequences_.size());
    if (tiers_) add_tier_stats(tiers_->counters(), st);
    return st;
  }

 private:
  static KvPool* checked_pool(KvPool* pool, std::int64_t block_size) {
    if (pool == nullptr) throw std::invalid_argument("paged allocator needs a KV pool");
    if (pool->shape().slots % block_size != 0)
      throw std::invalid_argument("pool slots (" + std::to_string(pool->shape().slots) +
                                  ") must be a multiple of block_size (" +
                                  std::to_string(block_size) + ")");
    return pool;
  }
  std::unique_ptr<KvTiers> make_tiers(const KvTierSpec* spec) const {
    if (spec == nullptr || (spec->host_bytes <= 0 && spec->disk_bytes <= 0)) return nullptr;
    if (!caching_)
      throw std::invalid_argument(
          "KV tiers keep prefix-cache blocks: they need prefix_caching = true");
    return std::make_unique<KvTiers>(*spec, *pool_, block_size_);
  }
  void add_tier_stats(const KvTierCounters& c, KvAllocatorStats& st) const {
    const auto host = static_cast<std::size_t>(KvTier::host),
               disk = static_cast<std::size_t>(KvTier::disk);
    st.host_hit_tokens = c.hit_blocks[host] * block_size_;
    st.disk_hit_tokens = c.hit_blocks[disk] * block_size_;
    st.host_bytes_stored = c.bytes_stored[host];
    st.host_bytes_loaded = c.bytes_loaded[host];
    st.disk_bytes_stored = c.bytes_stored[disk];
    st.disk_bytes_loaded = c.bytes_loaded[disk];
    st.host_copies = c.copies[host];
    st.disk_copies = c.copies[disk];
    st.tier_dropped_blocks = c.dropped;
    st.tier_copy_seconds = c.copy_seconds;
  }
  static std::size_t index(std::int64_t i) { return static_cast<std::size_t>(i); }
  std::span<const std::int32_t> block_of(std::span<const std::int32_t> tokens,
                                         std::int64_t block) const {
    return tokens.subspan(index(block * block_size_), index(block_size_));
  }
  std::int64_t blocks_for(std::int64_t tokens) const {
    return (tokens + block_size_ - 1) / block_size_;
  }
  std::int64_t new_blocks_for_append(const Sequence& s, std::int64_t n) const {
    std::int64_t blocks = blocks_for(s.slots + n) - static_cast<std::int64_t>(s.table.size());
    if (n > 0 && s.slots % block_size_ != 0 && blocks_.ref_count(s.table.back()) > 1)
      ++blocks;  // copy-on-write of the shared last block
    return blocks;
  }
  std::size_t take_plan_slot() {
    if (free_plan_slots_.empty()) return sequences_.size();  // every slot given is live
    const std::size_t slot = free_plan_slots_.back();
    free_plan_slots_.pop_back();
    return slot;
  }

  // The chain hashes of the prompt's full blocks a lookup may hit: at most (len - 1) /
  // block_size (the last prompt token is always computed, so the forward yields its logits).
  // Kept by the request when it has a cache (computed once), else in hash_scratch_.
  std::span<const std::uint64_t> prompt_block_hashes(const AllocateRequest& r) const {
    const std::int64_t candidates = (static_cast<std::int64_t>(r.prompt.size()) - 1) / block_size_;
    return prefix_block_hashes(r.prompt, block_size_, candidates, r.prefix_hashes, hash_scratch_);
  }

  // Calls visit(block) for each leading full block of the prompt already in the cache, in
  // order, until one is missing or visit returns false: at most (len - 1) / block_size blocks
  // (the last prompt token is always computed, so the forward yields its logits).
  template <typename Visit>
  void visit_hits(const AllocateRequest& r, Visit&& visit) const {
    if (!caching_) return;
    const auto hashes = prompt_block_hashes(r);
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(hashes.size()); ++i) {
      const auto b = blocks_.cached(hashes[index(i)], block_of(r.prompt, i));
      if (!b || !visit(*b)) return;
    }
  }

  // One block of a prompt's hit chain: in the pool (device) or in a tier below it.
  struct ChainBlock {
    std::optional<BlockId> device;
    KvTierHit tier;
    std::uint64_t hash = 0;
  };
  // The prompt's leading full blocks whose KV is in the pool or, with tiers, below it.
  const std::vector<ChainBlock>& hit_chain(const AllocateRequest& r) const {
    chain_.clear();
    if (!caching_) return chain_;
    const auto hashes = prompt_block_hashes(r);
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(hashes.size()); ++i) {
      if (i + kPrefetchAhead < static_cast<std::int64_t>(hashes.size()))
        blocks_.prefetch(hashes[index(i + kPrefetchAhead)]);
      const std::uint64_t hash = hashes[index(i)];
      if (const auto b = blocks_.cached(hash, block_of(r.prompt, i))) {
        chain_.push_back({b, {}, hash});
      } else if (const auto t = tiers_ ? tiers_->find(hash, block_of(r.prompt, i)) : std::nullopt) {
        chain_.push_back({std::nullopt, *t, hash});
      } else {
        break;
      }
    }
    return chain_;
  }
  // Free blocks an allocation takes: one a prompt block, but none for a hit on a held block (a
  // hit on a free cached block takes it from the free queue).
  std::int64_t blocks_from_free(const AllocateRequest& r,
                                const std::vector<ChainBlock>& chain) const {
    std::int64_t blocks = blocks_for(static_cast<std::int64_t>(r.prompt.size()));
    for (const ChainBlock& c : chain) blocks -= c.device && blocks_.ref_count(*c.device) > 0;
    return blocks;
  }
  // The chain's blocks become s's first blocks: the pool's are held first (no later take evicts
  // them), then each tier block is loaded into a fresh one, pinned in its tier until all are in.
  void take_hits(const std::vector<ChainBlock>& chain, std::span<const std::int32_t> prompt,
                 Sequence& s) {
    for (const ChainBlock& c : chain) {
      if (c.device)
        blocks_.hold(*c.device);
      else
        tiers_->pin(c.tier);
    }
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const ChainBlock& c = chain[i];
      BlockId b;
      if (c.device) {
        b = *c.device;
      } else {
        b = take_block();
        blocks_.set_uses(b, tiers_->load(c.tier, b));
        blocks_.set_fill(b, block_size_);
        blocks_.register_prefix(b, c.hash, block_of(prompt, static_cast<std::int64_t>(i)),
                                static_cast<std::int64_t>(i));
      }
      s.table.push_back(b);
    }
    if (tiers_) tiers_->unpin_all();
  }

  // Blocks [from, end) of s hold the tokens its length says.
  void fill_blocks_from(const Sequence& s, std::int64_t from) {
    for (auto i = from; i < static_cast<std::int64_t>(s.table.size()); ++i)
      blocks_.set_fill(s.table[index(i)], std::min(block_size_, s.slots - i * block_size_));
  }
  // Blocks [from, end) of s's table added to its view's end (physically adjacent blocks merge).
  void extend_view(Sequence& s, std::int64_t from) const {
    auto& extents = s.view.extents;
    for (auto i = from; i < static_cast<std::int64_t>(s.table.size()); ++i) {
      const std::int64_t start = std::int64_t{s.table[index(i)]} * block_size_;
      const std::int64_t length = std::min(block_size_, s.slots - i * block_size_);
      if (!extents.empty() && extents.back().start_slot + extents.back().length == start)
        extents.back().length += length;
      else
        extents.push_back({start, length});
    }
  }
  // The view's last `slots` slots (its last block's) taken off its end.
  static void trim_view(Sequence& s, std::int64_t slots) {
    auto& extents = s.view.extents;
    extents.back().length -= slots;
    if (extents.back().length == 0) extents.pop_back();
  }
  void rebuild_view(Sequence& s) {
    s.view.extents.clear();
    s.view.positions.clear();
    if (!s.slot_positions.empty()) return rebuild_dropped_view(s);
    s.view.first_position = s.first_block * block_size_;
    extend_view(s, s.first_block);
  }
  // A sequence that has dropped positions: its held slots in order with their positions, and
  // each block's fill the slots it still holds.
  void rebuild_dropped_view(Sequence& s) {
    auto& extents = s.view.extents;
    for (std::int64_t b = 0; b < static_cast<std::int64_t>(s.table.size()); ++b) {
      if (s.table[index(b)] < 0) continue;
      std::int64_t fill = 0;
      for (std::int64_t i = b * block_size_; i < std::min(s.slots, (b + 1) * block_size_); ++i) {
        const std::int64_t position = s.slot_positions[index(i)];
        if (position < 0) continue;
        const std::int64_t slot = std::int64_t{s.table[index(b)]} * block_size_ + i % block_size_;
        if (!extents.empty() && extents.back().start_slot + extents.back().length == slot)
          ++extents.back().length;
        else
          extents.push_back({slot, 1});
        s.view.positions.push_back(position);
        ++fill;
      }
      blocks_.set_fill(s.table[index(b)], fill);
    }
    s.view.first_position = s.view.positions.empty() ? s.length : s.view.positions.front();
  }
  // Before its first eviction, a sequence's slot index i holds position i (or nothing, in a
  // block a sliding window released): slot_positions says so from now on.
  void number_slots(Sequence& s) const {
    if (!s.slot_positions.empty() || s.slots == 0) return;
    s.slot_positions.resize(index(s.slots));
    for (std::int64_t i = 0; i < s.slots; ++i)
      s.slot_positions[index(i)] = s.table[index(i / block_size_)] < 0 ? -1 : i;
    s.first_block = 0;  // released blocks are the table's -1 entries from now on
  }
  // After positions were dropped: blocks holding none are released (the last one excepted: the
  // next token goes there); once the dropped slots in held blocks make a whole block, the held
  // slots move down into the first held blocks, in order, and the blocks left empty go.
  void release_dropped(Sequence& s) {
    std::int64_t dropped = 0;
    const auto blocks = static_cast<std::int64_t>(s.table.size());
    for (std::int64_t b = 0; b < blocks; ++b) {
      if (s.table[index(b)] < 0) continue;
      const std::int64_t end = std::min(s.slots, (b + 1) * block_size_);
      std::int64_t held = 0;
      for (std::int64_t i = b * block_size_; i < end; ++i) held += s.slot_positions[index(i)] >= 0;
      if (held == 0 && b + 1 < blocks) {
        release_block(s.table[index(b)]);
        s.table[index(b)] = -1;
      } else {
        dropped += end - b * block_size_ - held;
      }
    }
    if (dropped >= block_size_) compact(s);
    rebuild_view(s);
  }
  void mark_copied(BlockId b) {
    if (copied_since_map_.empty())
      copied_since_map_.resize(static_cast<std::size_t>(blocks_.blocks()));
    copied_since_map_[static_cast<std::size_t>(b)] = true;
  }
  // Block b's runs, merged into the last run when they continue it.
  void add_block_runs(std::vector<KvSlotRun>& runs, BlockId b, SequenceId holder,
                      bool copied) const {
    const std::int64_t start = std::int64_t{b} * block_size_;
    const std::int32_t holders = blocks_.ref_count(b);
    if (holders == 0) {
      if (blocks_.hash_of(b) != 0) add_run(runs, {start, block_size_, -1, KvSlotState::cached});
      return;
    }
    const KvSlotState state = holders > 1 ? KvSlotState::shared
                              : copied    ? KvSlotState::copied
                                          : KvSlotState::used;
    const std::int64_t fill = std::clamp<std::int64_t>(blocks_.fill(b), 0, block_size_);
    if (fill > 0) add_run(runs, {start, fill, holder, state});
    if (fill < block_size_)
      add_run(runs, {start + fill, block_size_ - fill, holder, KvSlotState::slack});
  }
  // Block b, index k of sequence s's table, slot by slot: the slots whose positions it keeps are
  // live (shared with a fork that holds the block too), the dropped and unwritten ones slack.
  void add_holey_block_runs(std::vector<KvSlotRun>& runs, BlockId b, SequenceId id,
                            const Sequence& s, std::int64_t k) const {
    const KvSlotState live = blocks_.ref_count(b) > 1 ? KvSlotState::shared : KvSlotState::used;
    for (std::int64_t j = 0; j < block_size_; ++j) {
      const std::int64_t index = k * block_size_ + j;
      const bool held = index < s.slots && s.slot_positions[static_cast<std::size_t>(index)] >= 0;
      add_run(runs, {std::int64_t{b} * block_size_ + j, 1, id, held ? live : KvSlotState::slack});
    }
  }
  static void add_run(std::vector<KvSlotRun>& runs, const KvSlotRun& run) {
    if (!runs.empty()) {
      KvSlotRun& last = runs.back();
      if (last.start + last.length == run.start && last.owner == run.owner &&
          last.state == run.state) {
        last.length += run.length;
        return;
      }
    }
    runs.push_back(run);
  }
  // Copies each block s shares (a fork's) into one of its own, so that dropping positions leaves
  // the other holders' KV and fills alone; false (nothing changed) when too few blocks are free.
  bool own_blocks(Sequence& s) {
    const auto shared = std::count_if(s.table.begin(), s.table.end(), [&](BlockId b) {
      return b >= 0 && blocks_.ref_count(b) > 1;
    });
    if (shared > blocks_.free_blocks()) return false;
    for (BlockId& b : s.table) {
      if (b < 0 || blocks_.ref_count(b) == 1) continue;
      const BlockId copy = take_block();
      bytes_copied_ += pool_->copy_slots(std::int64_t{b} * block_size_,
                                         std::int64_t{copy} * block_size_, block_size_);
      blocks_.set_fill(copy, blocks_.fill(b));
      release_block(b);
      b = copy;
      mark_copied(copy);
    }
    return true;
  }
  // Moves each held slot to the next free place in the sequence's (own) held blocks, in order
  // (never up: no slot is overwritten before it is read).
  void compact(Sequence& s) {
    std::vector<BlockId> held_blocks;
    for (BlockId b : s.table)
      if (b >= 0) held_blocks.push_back(b);
    std::vector<std::int64_t> positions;
    for (std::int64_t i = 0; i < s.slots; ++i) {
      const std::int64_t position = s.slot_positions[index(i)];
      if (position < 0) continue;
      const auto d = static_cast<std::int64_t>(positions.size());
      const std::int64_t from =
          std::int64_t{s.table[index(i / block_size_)]} * block_size_ + i % block_size_;
      const std::int64_t to =
          std::int64_t{held_blocks[index(d / block_size_)]} * block_size_ + d % block_size_;
      if (from != to) bytes_copied_ += pool_->copy_slots(from, to, 1);
      positions.push_back(position);
    }
    const auto kept_blocks = blocks_for(static_cast<std::int64_t>(positions.size()));
    for (std::size_t b = index(kept_blocks); b < held_blocks.size(); ++b)
      release_block(held_blocks[b]);
    held_blocks.resize(index(kept_blocks));
    s.table = std::move(held_blocks);
    s.slots = static_cast<std::int64_t>(positions.size());
    s.slot_positions = std::move(positions);
  }

  // Every block leaves and joins a sequence here: a KIVI pool forgets the open key groups a
  // freed block held (KvPool::discard_open_groups), so its fp16 residual is bounded by the live
  // sequences' last groups, and a taken block starts with none.
  void release_block(BlockId b) {
    blocks_.release(b);
    if (blocks_.ref_count(b) == 0)
      pool_->discard_open_groups(std::int64_t{b} * block_size_, block_size_);
  }
  BlockId take_block() {
    const BlockId b = blocks_.take();
    pool_->discard_open_groups(std::int64_t{b} * block_size_, block_size_);
    return b;
  }

  KvPool* pool_;
  std::int64_t block_size_;
  bool caching_;
  BlockPool blocks_;
  std::unique_ptr<KvTiers> tiers_;  // below the pool, or none
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::vector<std::size_t> free_plan_slots_;  // plan slots of freed sequences, reused
  mutable PagedPlan plan_;                    // the step being planned (plan_* are const)
  // Prefix-cache probes issued this many blocks ahead of a prompt's lookups and registrations.
  static constexpr std::int64_t kPrefetchAhead = 8;
  mutable std::vector<std::uint64_t> hash_scratch_;  // a lookup's hashes without a request cache
  mutable std::vector<ChainBlock> chain_;            // allocate's hit chain (no allocation a call)
  std::int64_t bytes_copied_ = 0;
  mutable std::vector<bool> copied_since_map_;  // per block: copied on write (pool_map)
  std::int64_t prefix_query_tokens_ = 0;
  std::int64_t prefix_hit_tokens_ = 0;
};

const ParamSpec kParams[] = {
    {"block_size", ParamType::param_integer, "slots per block", "16", 1, 4096},
    {"prefix_caching", ParamType::param_boolean,
     "share full blocks of identical prefixes between sequences", "true", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, PagedAllocator, "paged",
             "fixed-size blocks with block tables, ref counts, copy-on-write fork and automatic "
             "prefix caching",
             kParams)
