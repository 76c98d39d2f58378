// paged: fixed-size blocks, a block table per sequence, reference counts, copy-on-write fork,
// and automatic prefix caching (vLLM's PagedAttention memory manager). The blocks, their free
// queue, the prefix cache and its eviction order are kvlab::BlockPool (kvlab/kv/block_pool.hpp);
// the per-sequence block tables, their views and every block they take, copy or drop are
// kvlab::PagedBlocks (kvlab/kv/block_table.hpp); this plugin plans steps (PagedPlan) and commits
// them, and follows a prompt's prefix chain through the pool and the tiers.
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
#include "kvlab/kv/block_table.hpp"
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/kv/prefix_hash.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

// A sequence: its block table and its row in PagedPlan's marks.
struct Sequence : BlockTable {
  std::size_t plan_slot = 0;
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

class PagedAllocator final : public KvAllocator,
                             KvPositionDropping,
                             KvRollback,
                             KvForking,
                             KvPoolDrawing,
                             KvPrefixLookup {
 public:
  PagedAllocator(const PluginParams& params, const PluginContext& context)
      : block_size_(params.integer("block_size")),
        caching_(params.boolean("prefix_caching")),
        paged_(checked_pool(context.pool, block_size_), block_size_, caching_,
               reuse_order_named(params.string("reuse_order"))),
        blocks_(paged_.pool()),
        tiers_(make_tiers(context.tiers)) {
    if (tiers_) blocks_.set_eviction_sink(tiers_.get());
  }

  KvAllocatorFeatures features() override { return {this, this, this, this, nullptr, this}; }

  // The pool's hits only: a tier's blocks are not looked up (KV groups, who ask, run no tiers).
  std::int64_t cached_prefix_tokens(const AllocateRequest& r) const override {
    std::int64_t blocks = 0;
    visit_hits(r, [&](BlockId) { return ++blocks > 0; });
    return blocks * block_size_;
  }
  void hold_prefix(const AllocateRequest& r, std::int64_t tokens) override {
    std::int64_t blocks = tokens / block_size_;
    visit_hits(r, [&](BlockId b) {
      if (blocks-- <= 0) return false;
      blocks_.hold(b);
      return true;
    });
  }
  // The holds undone, the blocks' use counts too (a pin is not a sequence using the block).
  void release_prefix(const AllocateRequest& r, std::int64_t tokens) override {
    std::int64_t blocks = tokens / block_size_;
    visit_hits(r, [&](BlockId b) {
      if (blocks-- <= 0) return false;
      paged_.release(b);
      blocks_.set_uses(b, blocks_.uses(b) - 1);
      return true;
    });
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
    for (BlockId b : it->second.blocks)
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
    if (!plan_.take(paged_.blocks_for(static_cast<std::int64_t>(r.prompt.size())) - held))
      return false;
    for (BlockId b : plan_.hits) ++plan_.ref(b, blocks_);
    return true;
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || plan_.touched(it->second)) return false;
    if (!plan_.take(paged_.blocks_to_append(it->second, tokens))) return false;
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
    const auto hits = static_cast<std::int64_t>(s.blocks.size());
    s.computed_blocks = hits;
    while (static_cast<std::int64_t>(s.blocks.size()) < paged_.blocks_for(length))
      s.blocks.push_back(paged_.take());
    s.tokens.assign(r.prompt.begin(), r.prompt.end());
    s.length = s.slots = length;
    s.plan_slot = take_plan_slot();
    paged_.fill_from(s, hits);
    paged_.rebuild_view(s);
    prefix_query_tokens_ += caching_ ? length : 0;
    prefix_hit_tokens_ += hits * block_size_;
    sequences_.emplace(r.sequence, std::move(s));
    return AllocateResult{hits * block_size_};
  }

  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    const auto n = static_cast<std::int64_t>(tokens.size());
    if (paged_.blocks_to_append(it->second, n) > blocks_.free_blocks()) return false;
    paged_.append(it->second, tokens);
    return true;
  }

  void mark_computed(SequenceId id, std::int64_t computed_tokens) override {
    if (!caching_) return;
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    if (s.dropped_positions()) return;  // never: evict refuses a prefix-caching pool
    const std::int64_t full = std::min(computed_tokens, s.length) / block_size_;
    for (std::int64_t i = s.computed_blocks; i < full; ++i) {
      if (i + kPrefetchAhead < static_cast<std::int64_t>(s.hashes.size()))
        blocks_.prefetch(s.hashes[index(i + kPrefetchAhead)]);
      const auto block_tokens = block_of(s.tokens, i);
      if (i == static_cast<std::int64_t>(s.hashes.size()))  // never more: i counts up from
        s.hashes.push_back(                                 // computed_blocks <= hashes.size()
            chain_block_hash(i == 0 ? s.salt : s.hashes[index(i - 1)], block_tokens));
      const BlockId b = s.blocks[index(i)];
      if (b >= 0) blocks_.register_prefix(b, s.hashes[index(i)], block_tokens, i);  // -1: released
    }
    s.computed_blocks = std::max(s.computed_blocks, full);
  }

  void release_before(SequenceId id, std::int64_t position) override {
    if (auto it = sequences_.find(id); it != sequences_.end())
      paged_.release_before(it->second, position);
  }
  bool evict(SequenceId id, std::span<const std::int64_t> kept) override {
    auto it = sequences_.find(id);
    return it != sequences_.end() && !caching_ && paged_.drop_positions(it->second, kept);
  }
  bool truncate(SequenceId id, std::int64_t length) override {
    auto it = sequences_.find(id);
    return it != sequences_.end() && paged_.truncate(it->second, length);
  }

  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child)) return false;
    Sequence copy = it->second;
    paged_.hold_all(copy);
    copy.plan_slot = take_plan_slot();
    sequences_.emplace(child, std::move(copy));
    return true;
  }

  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    paged_.release_all(it->second);
    free_plan_slots_.push_back(it->second.plan_slot);
    sequences_.erase(it);
  }

  // Kept up to date by every change of the sequence: O(1) per step instead of O(its blocks).
  KvView view(SequenceId id) const override { return sequences_.at(id).view; }
  KvView positions_view(SequenceId id) const override {
    const KvView& view = sequences_.at(id).view;
    return {{{-1, view.length()}}, view.first_position, view.positions};
  }

  void pool_map(KvPoolMap& map) const override {
    map = {};
    std::vector<HeldTable> tables;
    tables.reserve(sequences_.size());
    for (const auto& [id, s] : sequences_) tables.emplace_back(id, &s);
    draw_block_pool(blocks_, tables, paged_.take_copied(), map);
    if (tiers_) {
      map.host_blocks = tiers_->size(KvTier::host);
      map.host_capacity = tiers_->capacity(KvTier::host);
      map.disk_blocks = tiers_->size(KvTier::disk);
      map.disk_capacity = tiers_->capacity(KvTier::disk);
    }
  }
  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = paged_.kv().shape().slots;
    // Kept as the blocks change (O(1); a shared block counts once): every holder of a block
    // sees the same filled slots, since only a block held once is written.
    const std::int64_t live_blocks = blocks_.blocks() - blocks_.free_blocks();
    st.used = blocks_.live_fill();
    st.last_block_slack = live_blocks * block_size_ - st.used;
    st.free = blocks_.free_blocks() * block_size_;
    st.cached_free = blocks_.free_cached_count() * block_size_;
    st.unusable_free = 0;  // any free block serves any sequence
    st.bytes_copied = paged_.bytes_copied();
    st.prefix_query_tokens = prefix_query_tokens_;
    st.prefix_hit_tokens = prefix_hit_tokens_;
    st.evictions = blocks_.evictions();
    st.live_sequences = static_cast<std::int64_t>(sequences_.size());
    if (tiers_) add_tier_stats(tiers_->counters(), st);
    return st;
  }

 private:
  static EvictionOrder reuse_order_named(const std::string& name) {
    if (const auto order = eviction_order_named(name)) return *order;
    throw std::invalid_argument("paged: reuse_order = \"" + name +
                                "\": choose \"lru\" or \"least_shared\"");
  }
  static KvPool& checked_pool(KvPool* pool, std::int64_t block_size) {
    if (pool == nullptr) throw std::invalid_argument("paged allocator needs a KV pool");
    if (pool->shape().slots % block_size != 0)
      throw std::invalid_argument("pool slots (" + std::to_string(pool->shape().slots) +
                                  ") must be a multiple of block_size (" +
                                  std::to_string(block_size) + ")");
    return *pool;
  }
  std::unique_ptr<KvTiers> make_tiers(const KvTierSpec* spec) {
    if (spec == nullptr || (spec->host_bytes <= 0 && spec->disk_bytes <= 0)) return nullptr;
    if (!caching_)
      throw std::invalid_argument(
          "KV tiers keep prefix-cache blocks: they need prefix_caching = true");
    return std::make_unique<KvTiers>(*spec, paged_.kv(), block_size_);
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
  // order, until one is missing or visit returns false.
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
    std::int64_t blocks = paged_.blocks_for(static_cast<std::int64_t>(r.prompt.size()));
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
        b = paged_.take();
        blocks_.set_uses(b, tiers_->load(c.tier, b));
        blocks_.set_fill(b, block_size_);
        blocks_.register_prefix(b, c.hash, block_of(prompt, static_cast<std::int64_t>(i)),
                                static_cast<std::int64_t>(i));
      }
      s.blocks.push_back(b);
    }
    if (tiers_) tiers_->unpin_all();
  }

  std::int64_t block_size_;
  bool caching_;
  mutable PagedBlocks paged_;       // mutable: pool_map takes the blocks copied since the last map
  BlockPool& blocks_;               // paged_'s
  std::unique_ptr<KvTiers> tiers_;  // below the pool, or none
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::vector<std::size_t> free_plan_slots_;  // plan slots of freed sequences, reused
  mutable PagedPlan plan_;                    // the step being planned (plan_* are const)
  // Prefix-cache probes issued this many blocks ahead of a prompt's lookups and registrations.
  static constexpr std::int64_t kPrefetchAhead = 8;
  mutable std::vector<std::uint64_t> hash_scratch_;  // a lookup's hashes without a request cache
  mutable std::vector<ChainBlock> chain_;            // allocate's hit chain (no allocation a call)
  std::int64_t prefix_query_tokens_ = 0;
  std::int64_t prefix_hit_tokens_ = 0;
};

const ParamSpec kParams[] = {
    {"block_size", ParamType::param_integer, "slots per block", "16", 1, 4096},
    {"prefix_caching", ParamType::param_boolean,
     "share full blocks of identical prefixes between sequences", "true", 0, 1},
    {"reuse_order", ParamType::param_string,
     "which free cached prefix block is reused first once no plain block is free: \"lru\" (the "
     "least recently freed) or \"least_shared\" (the fewest sequences held it, then lru)",
     "\"lru\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, PagedAllocator, "paged",
             "fixed-size blocks with block tables, ref counts, copy-on-write fork and automatic "
             "prefix caching",
             kParams)
