#include "kvlab/free_slot_runs.hpp"

#include <algorithm>
#include <cassert>

namespace kvlab {

FreeSlotRuns::FreeSlotRuns(std::int64_t capacity) {
  if (capacity > 0) runs_[0] = capacity;
  free_slots_ = capacity;
}

std::optional<std::int64_t> FreeSlotRuns::first_fit(std::int64_t count) const {
  for (const auto& [start, length] : runs_)
    if (length >= count) return start;
  return std::nullopt;
}

std::optional<std::int64_t> FreeSlotRuns::take(std::int64_t count) {
  const auto start = first_fit(count);
  if (!start) return std::nullopt;
  take_at(*start, count);
  return start;
}

bool FreeSlotRuns::is_free(std::int64_t start, std::int64_t count) const {
  if (count <= 0) return true;
  auto it = runs_.upper_bound(start);
  if (it == runs_.begin()) return false;
  --it;
  return it->first <= start && start + count <= it->first + it->second;
}

bool FreeSlotRuns::take_at(std::int64_t start, std::int64_t count) {
  if (count <= 0) return true;
  if (!is_free(start, count)) return false;
  auto it = std::prev(runs_.upper_bound(start));
  const std::int64_t run_start = it->first, run_end = it->first + it->second;
  runs_.erase(it);
  if (run_start < start) runs_[run_start] = start - run_start;
  if (start + count < run_end) runs_[start + count] = run_end - (start + count);
  free_slots_ -= count;
  return true;
}

void FreeSlotRuns::give_back(std::int64_t start, std::int64_t count) {
  if (count <= 0) return;
  std::int64_t new_start = start, new_end = start + count;
  auto next = runs_.lower_bound(start);
  assert(next == runs_.end() || next->first >= new_end);  // no double free
  if (next != runs_.end() && next->first == new_end) {
    new_end = next->first + next->second;
    next = runs_.erase(next);
  }
  if (next != runs_.begin()) {
    auto previous = std::prev(next);
    assert(previous->first + previous->second <= start);
    if (previous->first + previous->second == start) {
      new_start = previous->first;
      runs_.erase(previous);
    }
  }
  runs_[new_start] = new_end - new_start;
  free_slots_ += count;
}

std::int64_t FreeSlotRuns::largest_run() const {
  std::int64_t largest = 0;
  for (const auto& [start, length] : runs_) largest = std::max(largest, length);
  return largest;
}

}  // namespace kvlab
