#include "kvlab/engine/static_padding.hpp"

#include "kvlab/kv/kv_groups.hpp"

#include "kvlab/engine/engine.hpp"  // StepRecord

#include <algorithm>
#include <limits>

namespace kvlab {
namespace {

// The view of a padding row whose pad token sits at `end_position - 1`: the request's own view,
// extended when its pad tokens have gone past what it holds by runs of pool slots from slot 0,
// whole multiples of 16 slots, placed before its last extent (after its only one), so that a
// block-table backend keeps the view's block size. The row writes no K/V and its output is
// discarded: which slots the extra keys come from does not matter, only that attention reads as
// many keys as a pad token's would. Runs stay within the pool's `pool_slots`.
KvView padding_view(KvView view, std::int64_t end_position, std::int64_t pool_slots) {
  constexpr std::int64_t kQuantum = 16;
  std::int64_t missing = end_position - view.end_position();
  if (missing <= 0 || view.extents.empty()) return view;
  missing = (missing + kQuantum - 1) / kQuantum * kQuantum;
  const std::int64_t longest_run = std::max<std::int64_t>(pool_slots / kQuantum * kQuantum, 1);
  std::vector<KvExtent> filler;
  for (; missing > 0; missing -= filler.back().length)
    filler.push_back({0, std::min(missing, longest_run)});
  auto& extents = view.extents;
  const auto at = extents.size() == 1 ? extents.end() : extents.end() - 1;
  extents.insert(at, filler.begin(), filler.end());
  return view;
}

}  // namespace

// The held rows cost the step a decode row each (StepRecord::padding).
void StaticPadding::price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) {
  (void)timing;
  rows.insert(rows.end(), shapes_.begin(), shapes_.end());
  step.record.padding = static_cast<std::int64_t>(shapes_.size());
}

void StaticPadding::after_update(StepState& step, std::span<const RequestId> held) {
  hold(held, step.table, step.allocator);
  step.record.padding_slots = slots_;
}

void StaticPadding::hold(std::span<const RequestId> finished, const RequestTable& table,
                         KvAllocator& kv) {
  // This step's pad token, one position further (at most the model's last position: both the
  // cost model and the backend's padding row see that one).
  const std::int64_t last_position =
      context_ > 0 ? context_ - 1 : std::numeric_limits<std::int64_t>::max();
  for (EntryShape& shape : shapes_)
    shape.start_position = std::min(shape.start_position + 1, last_position);
  for (const RequestId id : finished) {
    const KvView view = kv.view(id);  // held unchanged until the batch ends
    ids_.push_back(id);               // its last token's row, then one pad token per step
    shapes_.push_back({1, table.at(id).length() - 1, view.first_position});
    slots_ += view.length();
  }
  (void)release_if_batch_ended(table, kv);
}

bool StaticPadding::release_if_batch_ended(const RequestTable& table, KvAllocator& kv) {
  if (!table.running().empty() || ids_.empty()) return false;
  for (const RequestId id : ids_) kv.free(id);
  clear();
  return true;
}

void StaticPadding::clear() {
  ids_.clear();
  shapes_.clear();
  slots_ = 0;
}

void StaticPadding::append_rows(const RequestTable& table, const KvAllocator& kv,
                                std::vector<BatchEntry>& batch) const {
  if (ids_.empty()) return;
  const std::int64_t pool_slots = kv.stats().capacity;  // bounds the padding views
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    const RequestState& r = table.at(ids_[i]);
    BatchEntry entry;
    entry.start_position = shapes_[i].start_position;
    entry.tokens = std::span<const std::int32_t>(r.tokens).last(1);
    entry.view = padding_view(kv.view(r.id), entry.start_position + 1, pool_slots);
    if (const auto* groups = dynamic_cast<const KvGroupViewing*>(&kv))  // kvlab/kv/kv_groups.hpp
      for (std::int64_t g = 0; g < static_cast<std::int64_t>(groups->layer_groups().groups.size());
           ++g)
        entry.group_views.push_back(
            padding_view(groups->group_view(r.id, g), entry.start_position + 1, pool_slots));
    entry.writes_kv = false;
    batch.push_back(std::move(entry));
  }
}

}  // namespace kvlab
