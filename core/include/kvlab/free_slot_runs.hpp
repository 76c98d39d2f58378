#pragma once
// Free runs of contiguous slots with first-fit allocation and coalescing on release: the
// bookkeeping of the contiguous allocators (static, dynamic).
#include <cstdint>
#include <map>
#include <optional>

namespace kvlab {

class FreeSlotRuns {
 public:
  explicit FreeSlotRuns(std::int64_t capacity);

  // Start of the lowest free run holding `count` slots.
  std::optional<std::int64_t> first_fit(std::int64_t count) const;
  // Takes `count` slots first-fit; nullopt when no run is long enough.
  std::optional<std::int64_t> take(std::int64_t count);
  // Are [start, start + count) all free?
  bool is_free(std::int64_t start, std::int64_t count) const;
  // Takes exactly [start, start + count); false (nothing changed) unless all free.
  bool take_at(std::int64_t start, std::int64_t count);
  // Returns [start, start + count) to the free runs, merging neighbours.
  void give_back(std::int64_t start, std::int64_t count);

  std::int64_t free_slots() const { return free_slots_; }
  std::int64_t largest_run() const;
  std::size_t run_count() const { return runs_.size(); }

 private:
  std::map<std::int64_t, std::int64_t> runs_;  // start -> length, disjoint, not adjacent
  std::int64_t free_slots_ = 0;
};

}  // namespace kvlab
