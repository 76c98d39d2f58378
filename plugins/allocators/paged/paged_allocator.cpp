// paged: fixed-size blocks, a block table per sequence, a free list, reference counts,
// copy-on-write fork, and automatic prefix caching (vLLM's PagedAttention memory manager).
//
// Prefix caching: a full block is identified by a chained hash of its tokens and of every
// token before it (h_i = H(h_{i-1}, tokens of block i)); once the backend has written its KV
// (mark_computed) the block is registered, and a later prompt that starts with the same
// tokens reuses it read-only. Freed blocks that hold registered KV stay reusable until the
// free list runs out of plain blocks; then the least recently freed one is evicted.
// NOTE: full blocks are never written again; only a sequence's last, partly filled block is
// written, and it is copied first when shared (fork).
#include <algorithm>
#include <list>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class PagedAllocator final : public KvAllocator {
 public:
  PagedAllocator(const PluginParams& params, const PluginContext& context)
      : pool_(context.pool),
        block_size_(params.integer("block_size")),
        caching_(params.boolean("prefix_caching")) {
    if (pool_ == nullptr) throw std::invalid_argument("paged allocator needs a KV pool");
    if (pool_->shape().slots % block_size_ != 0)
      throw std::invalid_argument("pool slots (" + std::to_string(pool_->shape().slots) +
                                  ") must be a multiple of block_size (" +
                                  std::to_string(block_size_) + ")");
    blocks_.resize(static_cast<std::size_t>(pool_->shape().slots / block_size_));
    // Taken from the back: blocks 0, 1, 2, ... come out in order, so fresh sequences get
    // physically adjacent blocks (their views merge into few extents).
    for (auto b = static_cast<std::int32_t>(blocks_.size()) - 1; b >= 0; --b)
      free_plain_.push_back(b);
  }

  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return blocks_to_allocate(r) * block_size_;
  }

  // Planning: the free-block count and the reference counts the plan's operations so far leave.
  // A freed sequence drops a reference on each of its blocks (a block nobody else holds becomes
  // free). An allocation takes a free block for each block of its prompt beyond its prefix hits
  // on blocks someone holds; a hit on a free cached block takes that block from the free list.
  // Once the plan has taken more blocks than there were plain free ones, the commits before
  // this one may evict cached blocks (least recently freed first), so the hit chain stops at
  // its first free cached block. An append takes its new blocks and a copy-on-write copy
  // (against the real reference count: conservative).
  void plan_reset() const override {
    plan_free_blocks_ = free_blocks();
    plan_taken_ = 0;
    plan_refs_.clear();
    ++plan_epoch_;
  }
  void plan_free(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || !plan_touch(it->second, true)) return;
    for (std::int32_t b : it->second.table)
      if (b >= 0 && --plan_ref(b) == 0) ++plan_free_blocks_;
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    if (auto it = sequences_.find(r.sequence);
        it != sequences_.end() && !(it->second.plan_epoch == plan_epoch_ && it->second.plan_freed))
      return false;  // an existing sequence is allocated again only after the plan freed it
    const bool evictions_possible = plan_taken_ > static_cast<std::int64_t>(free_plain_.size());
    std::vector<std::int32_t> hits;
    std::int64_t held = 0;  // hits on blocks someone holds: no free block taken for them
    for (std::int32_t b : lookup(r.prompt)) {
      if (plan_ref(b) == 0 && evictions_possible) break;
      hits.push_back(b);
      held += plan_ref(b) > 0 ? 1 : 0;
    }
    const std::int64_t blocks = blocks_for(static_cast<std::int64_t>(r.prompt.size())) - held;
    if (!plan_take(blocks)) return false;
    for (std::int32_t b : hits) ++plan_ref(b);
    return true;
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || it->second.plan_epoch == plan_epoch_) return false;
    if (!plan_take(new_blocks_for_append(it->second, tokens))) return false;
    plan_touch(it->second, false);
    return true;
  }

  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (sequences_.count(r.sequence) || blocks_to_allocate(r) > free_blocks()) return std::nullopt;
    const auto length = static_cast<std::int64_t>(r.prompt.size());
    Sequence s;
    s.tokens.assign(r.prompt.begin(), r.prompt.end());
    const auto hits = lookup(r.prompt);
    for (std::int32_t b : hits) {
      Block& block = blocks_[static_cast<std::size_t>(b)];
      if (block.ref_count == 0) {  // a free cached block comes back to life
        free_cached_.erase(block.lru_position);
        live_fill_ += block.fill;
      }
      ++block.ref_count;
      s.table.push_back(b);
      s.hashes.push_back(block.hash);
    }
    s.computed_blocks = static_cast<std::int64_t>(hits.size());
    while (static_cast<std::int64_t>(s.table.size()) < blocks_for(length))
      s.table.push_back(take_free_block());
    s.length = length;
    fill_blocks_from(s, static_cast<std::int64_t>(hits.size()));
    rebuild_view(s);
    prefix_query_tokens_ += caching_ ? length : 0;
    prefix_hit_tokens_ += static_cast<std::int64_t>(hits.size()) * block_size_;
    sequences_.emplace(r.sequence, std::move(s));
    return AllocateResult{static_cast<std::int64_t>(hits.size()) * block_size_};
  }

  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    Sequence& s = it->second;
    const auto n = static_cast<std::int64_t>(tokens.size());
    if (new_blocks_for_append(s, n) > free_blocks()) return false;
    if (n == 0) return true;
    const std::int64_t last_fill = s.length % block_size_;
    if (last_fill != 0) {  // the last block gets written: make it ours
      trim_view(s, last_fill);
      const std::int32_t last = s.table.back();
      if (blocks_[static_cast<std::size_t>(last)].ref_count > 1) {
        const std::int32_t copy = take_free_block();
        bytes_copied_ +=
            pool_->copy_slots(static_cast<std::int64_t>(last) * block_size_,
                              static_cast<std::int64_t>(copy) * block_size_, last_fill);
        --blocks_[static_cast<std::size_t>(last)].ref_count;
        s.table.back() = copy;
      }
    }
    const std::int64_t first_written = s.length / block_size_;
    s.length += n;
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    while (static_cast<std::int64_t>(s.table.size()) < blocks_for(s.length))
      s.table.push_back(take_free_block());
    fill_blocks_from(s, first_written);
    extend_view(s, first_written);
    return true;
  }

  void mark_computed(SequenceId id, std::int64_t computed_tokens) override {
    if (!caching_) return;
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    const std::int64_t full = std::min(computed_tokens, s.length) / block_size_;
    for (std::int64_t i = s.computed_blocks; i < full; ++i) {
      const std::uint64_t hash =
          chain_hash(i == 0 ? 0 : s.hashes[static_cast<std::size_t>(i - 1)], s.tokens, i);
      s.hashes.push_back(hash);
      const std::int32_t b = s.table[static_cast<std::size_t>(i)];
      if (b < 0) continue;  // released (sliding window)
      Block& block = blocks_[static_cast<std::size_t>(b)];
      if (block.hash == 0 && !cache_.count(hash)) {
        block.hash = hash;
        block.tokens.assign(s.tokens.begin() + i * block_size_,
                            s.tokens.begin() + (i + 1) * block_size_);
        cache_[hash] = b;
      }
    }
    s.computed_blocks = std::max(s.computed_blocks, full);
  }

  void release_before(SequenceId id, std::int64_t position) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    const std::int64_t whole_blocks = std::min(position, s.length) / block_size_;
    if (s.first_block >= whole_blocks) return;
    for (; s.first_block < whole_blocks; ++s.first_block) {
      release_block(s.table[static_cast<std::size_t>(s.first_block)]);
      s.table[static_cast<std::size_t>(s.first_block)] = -1;
    }
    rebuild_view(s);
  }

  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child)) return false;
    Sequence copy = it->second;
    for (std::int32_t b : copy.table)
      if (b >= 0) ++blocks_[static_cast<std::size_t>(b)].ref_count;
    sequences_.emplace(child, std::move(copy));
    return true;
  }

  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    // Last block first into the LRU, so a shared prefix's first blocks are evicted last.
    for (auto b = it->second.table.rbegin(); b != it->second.table.rend(); ++b)
      if (*b >= 0) release_block(*b);
    sequences_.erase(it);
  }

  // Kept up to date by every change of the sequence: O(1) per step instead of O(its blocks).
  KvView view(SequenceId id) const override { return sequences_.at(id).view; }

  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = pool_->shape().slots;
    // Kept as the blocks change (O(1); a shared block counts once): every holder of a block
    // sees the same filled slots, since only a block held once is written.
    const auto live_blocks = static_cast<std::int64_t>(blocks_.size()) - free_blocks();
    st.used = live_fill_;
    st.last_block_slack = live_blocks * block_size_ - live_fill_;
    st.free = free_blocks() * block_size_;
    st.cached_free = static_cast<std::int64_t>(free_cached_.size()) * block_size_;
    st.unusable_free = 0;  // any free block serves any sequence
    st.bytes_copied = bytes_copied_;
    st.prefix_query_tokens = prefix_query_tokens_;
    st.prefix_hit_tokens = prefix_hit_tokens_;
    st.evictions = evictions_;
    st.live_sequences = static_cast<std::int64_t>(sequences_.size());
    return st;
  }

 private:
  struct Block {
    std::int32_t ref_count = 0;
    std::int64_t fill = 0;   // slots holding tokens (a cached block keeps block_size when freed)
    std::uint64_t hash = 0;  // 0: holds no registered prefix
    std::vector<std::int32_t>
        tokens;  // the block's tokens, checked on every hit (no false sharing)
    std::list<std::int32_t>::iterator lru_position;
  };
  struct Sequence {
    std::vector<std::int32_t> table;    // block per block index; -1 once released (sliding window)
    std::vector<std::uint64_t> hashes;  // chain hashes of its full, computed blocks
    std::vector<std::int32_t> tokens;
    std::int64_t length = 0;
    std::int64_t computed_blocks = 0;
    std::int64_t first_block = 0;  // blocks before it were released
    KvView view;                   // table[first_block..] as merged slot extents
    // Planning: the plan (epoch) that last touched it, and whether that plan freed it.
    mutable std::uint64_t plan_epoch = 0;
    mutable bool plan_freed = false;
  };

  // Blocks allocate(r) takes from the free lists: all it needs minus prefix hits, plus hits
  // that are themselves free cached blocks (they leave the free lists too).
  // Marks s as planned in this plan; false when it already was.
  bool plan_touch(const Sequence& s, bool freed) const {
    if (s.plan_epoch == plan_epoch_) return false;
    s.plan_epoch = plan_epoch_;
    s.plan_freed = freed;
    return true;
  }
  bool plan_take(std::int64_t blocks) const {
    if (blocks > plan_free_blocks_) return false;
    plan_free_blocks_ -= blocks;
    plan_taken_ += blocks;
    return true;
  }
  std::int32_t& plan_ref(std::int32_t block) const {
    auto [it, inserted] = plan_refs_.try_emplace(block, 0);
    if (inserted) it->second = blocks_[static_cast<std::size_t>(block)].ref_count;
    return it->second;
  }
  std::int64_t blocks_to_allocate(const AllocateRequest& r) const {
    const auto hits = lookup(r.prompt);
    std::int64_t from_free = blocks_for(static_cast<std::int64_t>(r.prompt.size())) -
                             static_cast<std::int64_t>(hits.size());
    for (std::int32_t b : hits)
      if (blocks_[static_cast<std::size_t>(b)].ref_count == 0) ++from_free;
    return from_free;
  }
  std::int64_t blocks_for(std::int64_t tokens) const {
    return (tokens + block_size_ - 1) / block_size_;
  }
  std::int64_t free_blocks() const {
    return static_cast<std::int64_t>(free_plain_.size() + free_cached_.size());
  }
  std::int64_t new_blocks_for_append(const Sequence& s, std::int64_t n) const {
    std::int64_t blocks = blocks_for(s.length + n) - static_cast<std::int64_t>(s.table.size());
    if (n > 0 && s.length % block_size_ != 0 &&
        blocks_[static_cast<std::size_t>(s.table.back())].ref_count > 1)
      ++blocks;  // copy-on-write of the shared last block
    return blocks;
  }

  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
  }
  std::uint64_t chain_hash(std::uint64_t previous, const std::vector<std::int32_t>& tokens,
                           std::int64_t block) const {
    std::uint64_t h = mix(previous + 0x9e3779b97f4a7c15ULL);
    for (std::int64_t i = block * block_size_; i < (block + 1) * block_size_; ++i)
      h = mix(h ^ static_cast<std::uint32_t>(tokens[static_cast<std::size_t>(i)]));
    return h == 0 ? 1 : h;  // 0 means "none"
  }

  // Blocks already holding this prompt's leading full blocks (at most (len - 1) / block_size:
  // the last prompt token is always computed, so the forward yields its logits).
  std::vector<std::int32_t> lookup(std::span<const std::int32_t> prompt) const {
    std::vector<std::int32_t> hits;
    if (!caching_) return hits;
    const std::int64_t candidates = (static_cast<std::int64_t>(prompt.size()) - 1) / block_size_;
    std::uint64_t hash = 0;
    const std::vector<std::int32_t> tokens(prompt.begin(), prompt.end());
    for (std::int64_t i = 0; i < candidates; ++i) {
      hash = chain_hash(hash, tokens, i);
      auto it = cache_.find(hash);
      if (it == cache_.end()) break;
      const Block& block = blocks_[static_cast<std::size_t>(it->second)];
      if (!std::equal(block.tokens.begin(), block.tokens.end(), tokens.begin() + i * block_size_))
        break;
      hits.push_back(it->second);
    }
    return hits;
  }

  // Blocks [from, end) of s hold the tokens its length says: their fills (and live_fill_).
  void fill_blocks_from(const Sequence& s, std::int64_t from) {
    for (auto i = from; i < static_cast<std::int64_t>(s.table.size()); ++i) {
      Block& block = blocks_[static_cast<std::size_t>(s.table[static_cast<std::size_t>(i)])];
      const std::int64_t fill = std::min(block_size_, s.length - i * block_size_);
      live_fill_ += fill - block.fill;
      block.fill = fill;
    }
  }
  // Blocks [from, end) of s's table added to its view's end (physically adjacent blocks merge).
  void extend_view(Sequence& s, std::int64_t from) const {
    auto& extents = s.view.extents;
    for (auto i = from; i < static_cast<std::int64_t>(s.table.size()); ++i) {
      const std::int64_t start =
          static_cast<std::int64_t>(s.table[static_cast<std::size_t>(i)]) * block_size_;
      const std::int64_t length = std::min(block_size_, s.length - i * block_size_);
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
  void rebuild_view(Sequence& s) const {
    s.view.extents.clear();
    s.view.first_position = s.first_block * block_size_;
    extend_view(s, s.first_block);
  }

  std::int32_t take_free_block() {
    std::int32_t b;
    if (!free_plain_.empty()) {
      b = free_plain_.back();
      free_plain_.pop_back();
    } else {  // evict the least recently freed cached block
      b = free_cached_.front();
      free_cached_.pop_front();
      Block& block = blocks_[static_cast<std::size_t>(b)];
      cache_.erase(block.hash);
      block.hash = 0;
      block.tokens.clear();
      ++evictions_;
    }
    blocks_[static_cast<std::size_t>(b)].ref_count = 1;
    blocks_[static_cast<std::size_t>(b)].fill = 0;  // (a free block's fill is not in live_fill_)
    return b;
  }

  void release_block(std::int32_t b) {
    Block& block = blocks_[static_cast<std::size_t>(b)];
    if (--block.ref_count > 0) return;
    live_fill_ -= block.fill;
    if (block.hash != 0) {
      block.lru_position = free_cached_.insert(free_cached_.end(), b);
    } else {
      free_plain_.push_back(b);
    }
  }

  KvPool* pool_;
  std::int64_t block_size_;
  bool caching_;
  std::vector<Block> blocks_;
  std::vector<std::int32_t> free_plain_;  // free blocks with no registered prefix
  std::list<std::int32_t> free_cached_;   // free blocks still holding a prefix, LRU first
  std::unordered_map<std::uint64_t, std::int32_t> cache_;  // chain hash -> block
  std::unordered_map<SequenceId, Sequence> sequences_;
  // Planning scratch.
  mutable std::int64_t plan_free_blocks_ = 0;
  mutable std::int64_t plan_taken_ = 0;  // blocks the plan's operations take from the free list
  mutable std::unordered_map<std::int32_t, std::int32_t> plan_refs_;  // block -> planned refs
  mutable std::uint64_t plan_epoch_ = 0;  // each plan_reset starts a new plan
  std::int64_t bytes_copied_ = 0;
  std::int64_t prefix_query_tokens_ = 0;
  std::int64_t prefix_hit_tokens_ = 0;
  std::int64_t evictions_ = 0;
  std::int64_t live_fill_ = 0;  // filled slots of all held blocks (stats().used)
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
