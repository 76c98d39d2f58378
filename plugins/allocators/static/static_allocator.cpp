// static: reserves max_seq_len contiguous slots for a sequence when it is admitted — the
// FasterTransformer / Orca baseline. Everything a sequence might ever need is held from its
// first step to its last, so `reserved_unused` is the waste this baseline is known for.
#include <fmt/format.h>

#include <unordered_map>
#include <unordered_set>

#include "kvlab/free_slot_runs.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class StaticAllocator final : public KvAllocator, KvRollback, KvForking, KvPoolDrawing {
 public:
  StaticAllocator(const PluginParams& params, const PluginContext& context)
      : pool_(context.pool),
        reserve_(params.integer("max_seq_len")),
        free_(context.pool ? context.pool->shape().slots : 0) {
    if (pool_ == nullptr) throw std::invalid_argument("static allocator needs a KV pool");
    if (reserve_ == 0) reserve_ = context.max_seq_len;
    if (reserve_ <= 0) throw std::invalid_argument("static allocator needs max_seq_len > 0");
  }

  // No positions dropped early: a sliding window's and a KV policy's are held to the end.
  KvAllocatorFeatures features() override { return {nullptr, this, this, this}; }

  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (!fits(r) || sequences_.count(r.sequence)) return std::nullopt;
    const auto start = free_.take(reserve_);
    if (!start) return std::nullopt;
    sequences_[r.sequence] = {*start, static_cast<std::int64_t>(r.prompt.size())};
    return AllocateResult{0};
  }
  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return fits(r) ? reserve_ : pool_->shape().slots + 1;
  }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    const auto n = static_cast<std::int64_t>(tokens.size());
    if (it == sequences_.end() || it->second.length + n > reserve_) return false;
    it->second.length += n;
    return true;
  }

  // Planning: a scratch copy of the free runs; sequences never move.
  void plan_reset() const override {
    plan_free_ = free_;
    plan_freed_.clear();
  }
  void plan_free(SequenceId id) const override {
    if (auto it = sequences_.find(id); it != sequences_.end() && plan_freed_.insert(id).second)
      plan_free_.give_back(it->second.start, reserve_);
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    return fits(r) && (!sequences_.count(r.sequence) || plan_freed_.count(r.sequence)) &&
           plan_free_.take(reserve_).has_value();
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    return it != sequences_.end() && !plan_freed_.count(id) &&
           it->second.length + tokens <= reserve_;
  }

  // The reservation stays whole: the rolled-back slots are its unused part again.
  bool truncate(SequenceId id, std::int64_t length) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || length < 0 || length > it->second.length) return false;
    it->second.length = length;
    return true;
  }
  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child)) return false;
    const auto start = free_.take(reserve_);
    if (!start) return false;
    bytes_copied_ += pool_->copy_slots(it->second.start, *start, it->second.length);
    sequences_[child] = {*start, it->second.length};
    return true;
  }
  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    free_.give_back(it->second.start, reserve_);
    sequences_.erase(it);
  }
  KvView view(SequenceId id) const override {
    const auto& s = sequences_.at(id);
    return KvView{{KvExtent{s.start, s.length}}, 0, {}};
  }
  // Each reservation: its live tokens, then the rest held for tokens it may never write.
  void pool_map(KvPoolMap& map) const override {
    map = {};
    for (const auto& [id, s] : sequences_) {
      if (s.length > 0) map.runs.push_back({s.start, s.length, id, KvSlotState::used});
      if (reserve_ > s.length)
        map.runs.push_back({s.start + s.length, reserve_ - s.length, id, KvSlotState::reserved});
    }
    sort_runs(map.runs);
  }
  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = pool_->shape().slots;
    for (const auto& [id, s] : sequences_) {
      st.used += s.length;
      st.reserved_unused += reserve_ - s.length;
    }
    st.free = free_.free_slots();
    st.unusable_free = st.free - free_.largest_run();
    st.bytes_copied = bytes_copied_;
    st.live_sequences = static_cast<std::int64_t>(sequences_.size());
    return st;
  }

 private:
  struct Sequence {
    std::int64_t start;
    std::int64_t length;
  };
  bool fits(const AllocateRequest& r) const {
    return static_cast<std::int64_t>(r.prompt.size()) <= reserve_ && r.max_total_tokens <= reserve_;
  }
  KvPool* pool_;
  std::int64_t reserve_;
  FreeSlotRuns free_;
  mutable FreeSlotRuns plan_free_{0};  // planning scratch
  mutable std::unordered_set<SequenceId> plan_freed_;
  std::unordered_map<SequenceId, Sequence> sequences_;
  std::int64_t bytes_copied_ = 0;
};

const ParamSpec kParams[] = {
    {"max_seq_len", ParamType::param_integer,
     "slots reserved per sequence at admission (0 = the model's context / the experiment's limit)",
     "0", 0, 1 << 30},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, StaticAllocator, "static",
             "reserves max_seq_len contiguous slots per sequence at admission "
             "(FasterTransformer/Orca baseline)",
             kParams)
