// dynamic: one contiguous extent per sequence, sized to what it holds and grown on demand —
// in place when the slots after it are free, otherwise by moving it (first-fit) to a larger
// run and copying its KV. External fragmentation (`unusable_free`) and the copy cost
// (`bytes_copied`) are what this strategy shows.
#include <cmath>
#include <unordered_map>

#include "kvlab/free_slot_runs.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

class DynamicAllocator final : public KvAllocator, KvRollback, KvForking, KvPoolDrawing {
 public:
  DynamicAllocator(const PluginParams& params, const PluginContext& context)
      : pool_(context.pool),
        growth_(params.real("growth")),
        free_(context.pool ? context.pool->shape().slots : 0) {
    if (pool_ == nullptr) throw std::invalid_argument("dynamic allocator needs a KV pool");
  }

  // No positions dropped early: a sliding window's and a KV policy's are held to the end.
  KvAllocatorFeatures features() override { return {nullptr, this, this, this}; }

  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (sequences_.count(r.sequence)) return std::nullopt;
    const auto capacity = std::max<std::int64_t>(1, static_cast<std::int64_t>(r.prompt.size()));
    const auto start = free_.take(capacity);
    if (!start) return std::nullopt;
    sequences_[r.sequence] = {*start, capacity, static_cast<std::int64_t>(r.prompt.size())};
    return AllocateResult{0};
  }
  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(r.prompt.size()));
  }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    Sequence& s = it->second;
    const std::int64_t needed = s.length + static_cast<std::int64_t>(tokens.size());
    if (needed > s.capacity) {
      const auto grown = grow(free_, s, needed, growth_);
      if (!grown) return false;
      if (grown->start != s.start)
        bytes_copied_ += pool_->copy_slots(s.start, grown->start, s.length);
      s = *grown;
    }
    s.length = needed;
    return true;
  }

  // Planning: a scratch copy of the free runs and of the extents the plan moved or freed; the
  // same first-fit and growth code as the commits.
  void plan_reset() const override {
    plan_free_ = free_;
    plan_sequences_.clear();
  }
  void plan_free(SequenceId id) const override {
    if (const Sequence* s = planned(id)) {
      plan_free_.give_back(s->start, s->capacity);
      plan_sequences_[id] = std::nullopt;
    }
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    if (planned(r.sequence)) return false;
    const auto capacity = std::max<std::int64_t>(1, static_cast<std::int64_t>(r.prompt.size()));
    const auto start = plan_free_.take(capacity);
    if (!start) return false;
    plan_sequences_[r.sequence] =
        Sequence{*start, capacity, static_cast<std::int64_t>(r.prompt.size())};
    return true;
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    const Sequence* s = planned(id);
    if (s == nullptr) return false;
    Sequence next = *s;
    const std::int64_t needed = next.length + tokens;
    if (needed > next.capacity) {
      const auto grown = grow(plan_free_, next, needed, growth_);
      if (!grown) return false;
      next = *grown;
    }
    next.length = needed;
    plan_sequences_[id] = next;
    return true;
  }
  // The extent keeps its capacity (the next step's proposals are written there again): the
  // rolled-back slots count as reserved, not free.
  bool truncate(SequenceId id, std::int64_t length) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end() || length < 0 || length > it->second.length) return false;
    it->second.length = length;
    return true;
  }
  bool fork(SequenceId parent, SequenceId child) override {
    auto it = sequences_.find(parent);
    if (it == sequences_.end() || sequences_.count(child)) return false;
    const std::int64_t length = std::max<std::int64_t>(1, it->second.length);
    const auto start = free_.take(length);
    if (!start) return false;
    bytes_copied_ += pool_->copy_slots(it->second.start, *start, it->second.length);
    sequences_[child] = {*start, length, it->second.length};
    return true;
  }
  void free(SequenceId id) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return;
    free_.give_back(it->second.start, it->second.capacity);
    sequences_.erase(it);
  }
  // Each sequence's run: its live tokens, then the room it grew ahead of them.
  void pool_map(KvPoolMap& map) const override {
    map = {};
    for (const auto& [id, s] : sequences_) {
      if (s.length > 0) map.runs.push_back({s.start, s.length, id, KvSlotState::used});
      if (s.capacity > s.length)
        map.runs.push_back({s.start + s.length, s.capacity - s.length, id, KvSlotState::reserved});
    }
    sort_runs(map.runs);
  }
  KvView view(SequenceId id) const override {
    const auto& s = sequences_.at(id);
    return KvView{{KvExtent{s.start, s.length}}, 0, {}};
  }
  KvAllocatorStats stats() const override {
    KvAllocatorStats st;
    st.capacity = pool_->shape().slots;
    for (const auto& [id, s] : sequences_) {
      st.used += s.length;
      st.reserved_unused += s.capacity - s.length;
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
    std::int64_t capacity;
    std::int64_t length;
  };

  // The sequence as the plan sees it: moved or freed by an earlier planned operation, else as
  // it is. nullptr when it does not exist (or the plan freed it).
  const Sequence* planned(SequenceId id) const {
    if (auto it = plan_sequences_.find(id); it != plan_sequences_.end())
      return it->second ? &*it->second : nullptr;
    auto it = sequences_.find(id);
    return it == sequences_.end() ? nullptr : &it->second;
  }

  // s's extent grown to hold `needed` slots, taken from `free`: capacity x growth in place, then
  // `needed` in place, then a first-fit run elsewhere (x growth, else exact; the caller copies
  // the KV over). nullopt (free unchanged) when nothing fits.
  static std::optional<Sequence> grow(FreeSlotRuns& free, Sequence s, std::int64_t needed,
                                      double growth) {
    const std::int64_t target = std::max(
        needed, static_cast<std::int64_t>(std::ceil(static_cast<double>(s.capacity) * growth)));
    for (std::int64_t capacity : {target, needed}) {
      if (free.take_at(s.start + s.capacity, capacity - s.capacity)) {
        s.capacity = capacity;
        return s;
      }
    }
    for (std::int64_t capacity : {target, needed}) {
      if (const auto start = free.take(capacity)) {
        free.give_back(s.start, s.capacity);
        s.start = *start;
        s.capacity = capacity;
        return s;
      }
    }
    return std::nullopt;
  }

  KvPool* pool_;
  double growth_;
  FreeSlotRuns free_;
  std::unordered_map<SequenceId, Sequence> sequences_;
  mutable FreeSlotRuns plan_free_{0};  // planning scratch
  mutable std::unordered_map<SequenceId, std::optional<Sequence>> plan_sequences_;
  std::int64_t bytes_copied_ = 0;
};

const ParamSpec kParams[] = {
    {"growth", ParamType::param_real,
     "capacity multiplier when an extent must grow (1 = exactly what is needed)", "2.0", 1.0, 16.0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, DynamicAllocator, "dynamic",
             "one contiguous extent per sequence, grown on demand (first-fit, grow by copy)",
             kParams)
