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

class DynamicAllocator final : public KvAllocator {
 public:
  DynamicAllocator(const PluginParams& params, const PluginContext& context)
      : pool_(context.pool),
        growth_(params.real("growth")),
        free_(context.pool ? context.pool->shape().slots : 0) {
    if (pool_ == nullptr) throw std::invalid_argument("dynamic allocator needs a KV pool");
  }

  bool can_allocate(const AllocateRequest& r) const override {
    return free_.first_fit(std::max<std::int64_t>(1, static_cast<std::int64_t>(r.prompt.size())))
        .has_value();
  }
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
  std::int64_t slots_to_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return 0;
    return std::max<std::int64_t>(0, it->second.length + tokens - it->second.capacity);
  }
  std::int64_t slots_held(SequenceId id) const override {
    auto it = sequences_.find(id);
    return it == sequences_.end() ? 0 : it->second.capacity;
  }
  bool can_append(SequenceId id, std::int64_t tokens) const override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    const Sequence& s = it->second;
    const std::int64_t needed = s.length + tokens;
    if (needed <= s.capacity) return true;
    return free_.is_free(s.start + s.capacity, needed - s.capacity) ||
           free_.first_fit(needed).has_value();
  }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    auto it = sequences_.find(id);
    if (it == sequences_.end()) return false;
    Sequence& s = it->second;
    const std::int64_t needed = s.length + static_cast<std::int64_t>(tokens.size());
    if (needed > s.capacity && !grow(s, needed)) return false;
    s.length = needed;
    return true;
  }
  void mark_computed(SequenceId, std::int64_t) override {}
  void release_before(SequenceId, std::int64_t) override {
  }  // one extent: nothing to give back early
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
  bool contains(SequenceId id) const override { return sequences_.count(id) > 0; }
  KvView view(SequenceId id) const override {
    const auto& s = sequences_.at(id);
    return KvView{{KvExtent{s.start, s.length}}, 0};
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

  // Grows s to hold `needed` slots: try capacity x growth in place, then `needed` in place,
  // then move to a first-fit run (x growth, else exact) and copy the KV over.
  bool grow(Sequence& s, std::int64_t needed) {
    const std::int64_t target = std::max(
        needed, static_cast<std::int64_t>(std::ceil(static_cast<double>(s.capacity) * growth_)));
    for (std::int64_t capacity : {target, needed}) {
      if (free_.take_at(s.start + s.capacity, capacity - s.capacity)) {
        s.capacity = capacity;
        return true;
      }
    }
    for (std::int64_t capacity : {target, needed}) {
      if (const auto start = free_.take(capacity)) {
        bytes_copied_ += pool_->copy_slots(s.start, *start, s.length);
        free_.give_back(s.start, s.capacity);
        s.start = *start;
        s.capacity = capacity;
        return true;
      }
    }
    return false;
  }

  KvPool* pool_;
  double growth_;
  FreeSlotRuns free_;
  std::unordered_map<SequenceId, Sequence> sequences_;
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
