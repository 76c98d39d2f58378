// An out-of-tree KV allocator: every token gets any free slot from a free list (paging with
// one-slot pages, no prefix cache). No fragmentation and no reservation waste; the price is a
// KvView of many extents when slots come back scattered. It passes kvlab's conformance suite:
//   kvlab plugins conformance slot_list --path <this build folder> --release-window
#include <kvlab/plugin.hpp>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using namespace kvlab;

class SlotListAllocator final : public KvAllocator, KvPositionDropping, KvForking {
 public:
  SlotListAllocator(const PluginParams&, const PluginContext& context) : pool_(context.pool) {
    if (pool_ == nullptr) throw std::invalid_argument("slot_list allocator needs a KV pool");
    for (auto s = pool_->shape().slots - 1; s >= 0; --s) free_.push_back(s);  // 0 comes out first
  }

  // What it offers beyond the core: a sliding window's early release (not a KV policy's
  // holes: evict refuses) and fork; no rollback, no pool map of its own.
  KvAllocatorFeatures features() override { return {this, nullptr, this, nullptr}; }

  // --- commits ---
  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    const auto n = static_cast<std::int64_t>(r.prompt.size());
    if (sequences_.count(r.sequence) || n > free_count()) return std::nullopt;
    Sequence& s = sequences_[r.sequence];
    for (std::int64_t i = 0; i < n; ++i) s.slots.push_back(take());
    return AllocateResult{0};
  }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || static_cast<std::int64_t>(tokens.size()) > free_count())
      return false;
    for (std::size_t i = 0; i < tokens.size(); ++i) it->second.slots.push_back(take());
    return true;
  }
  void release_before(SequenceId id, std::int64_t position) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    Sequence& s = it->second;
    const auto end = std::min<std::int64_t>(position, static_cast<std::int64_t>(s.slots.size()));
    for (; s.first < end; ++s.first) free_.push_back(s.slots[static_cast<std::size_t>(s.first)]);
  }
  bool evict(SequenceId, std::span<const std::int64_t>) override { return false; }
  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child) || it->second.first > 0) return false;
    const std::vector<std::int64_t> from = it->second.slots;
    if (static_cast<std::int64_t>(from.size()) > free_count()) return false;
    Sequence& copy = sequences_[child];
    for (std::int64_t slot : from) {
      copy.slots.push_back(take());
      bytes_copied_ += pool_->copy_slots(slot, copy.slots.back(), 1);
    }
    return true;
  }
  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    const Sequence& s = it->second;
    for (auto i = static_cast<std::size_t>(s.first); i < s.slots.size(); ++i)
      free_.push_back(s.slots[i]);
    sequences_.erase(it);
  }

  // --- planning: a free-slot count; each planned sequence once ---
  void plan_reset() const override {
    plan_free_ = free_count();
    plan_touched_.clear();
  }
  void plan_free(SequenceId id) const override {
    auto it = sequences_.find(id);
    if (it != sequences_.end() && plan_touched_.insert(id).second) plan_free_ += held(it->second);
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    if (sequences_.count(r.sequence) && !plan_touched_.count(r.sequence)) return false;
    return plan_take(static_cast<std::int64_t>(r.prompt.size()), r.sequence);
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    return sequences_.count(id) && !plan_touched_.count(id) && plan_take(tokens, id);
  }

  // --- queries ---
  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return static_cast<std::int64_t>(r.prompt.size());
  }
  KvView view(SequenceId id) const override {  // consecutive slots merge into one extent
    const Sequence& s = sequences_.at(id);
    KvView view;
    view.first_position = s.first;
    for (auto i = static_cast<std::size_t>(s.first); i < s.slots.size(); ++i) {
      if (!view.extents.empty() &&
          view.extents.back().start_slot + view.extents.back().length == s.slots[i])
        ++view.extents.back().length;
      else
        view.extents.push_back({s.slots[i], 1});
    }
    return view;
  }
  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = pool_->shape().slots;
    for (const auto& [id, s] : sequences_) st.used += held(s);
    st.free = free_count();
    st.bytes_copied = bytes_copied_;
    st.live_sequences = static_cast<std::int64_t>(sequences_.size());
    return st;
  }

 private:
  struct Sequence {
    std::vector<std::int64_t> slots;  // slot of each position; [0, first) released
    std::int64_t first = 0;
  };
  static std::int64_t held(const Sequence& s) {
    return static_cast<std::int64_t>(s.slots.size()) - s.first;
  }
  std::int64_t free_count() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t take() {
    const std::int64_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  bool plan_take(std::int64_t slots, SequenceId id) const {
    if (slots > plan_free_) return false;
    plan_free_ -= slots;
    plan_touched_.insert(id);
    return true;
  }

  KvPool* pool_;
  std::vector<std::int64_t> free_;
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::int64_t bytes_copied_ = 0;
  mutable std::int64_t plan_free_ = 0;
  mutable std::unordered_set<SequenceId> plan_touched_;
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, SlotListAllocator, "slot_list",
             "every token its own slot from a free list (example out-of-tree plugin)",
             kvlab::kNoParams)
