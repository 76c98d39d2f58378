#include "kvlab/engine/step_pricing.hpp"

#include <algorithm>

namespace kvlab {

StepTiming StepPricer::price(const AppliedPlan& applied, std::span<const BatchEntry> requests,
                             std::span<const EntryShape> rows, StepTiming timing,
                             const KvAllocator& kv, StepRecord& record) {
  timing.measured_forward_s = record.measured_forward_s;
  timing.measured_swap_s = applied.swap_copy_s;
  record.swap_bytes = applied.swap_bytes;
  record.swap_transfers = applied.swap_transfers;
  if (cost_model_ != nullptr) {
    record.work = cost_model_->work(requests, rows);
    record.predicted_s = cost_model_->cost(record.work).total();
    timing.predicted_s = record.predicted_s;
    timing.modelled_swap_s = cost_model_->swap_seconds(applied.swap_bytes, applied.swap_transfers);
  }
  price_tier_copies(kv, timing, record);
  return timing;
}

// The KV tier copies the allocator made since the last priced step (they happen as the plan is
// applied): the host link carries the device <-> host copies and the disk blocks loaded back,
// the disk its reads and writes.
void StepPricer::price_tier_copies(const KvAllocator& kv, StepTiming& timing, StepRecord& record) {
  if (!kv_tiers_) return;
  const KvAllocatorStats now = kv.stats(), &was = tiers_seen_;
  if (now.host_copies == was.host_copies && now.disk_copies == was.disk_copies) return;
  timing.measured_tier_s = now.tier_copy_seconds - was.tier_copy_seconds;
  if (cost_model_ != nullptr) {
    const CostModel& model = *cost_model_;
    const std::int64_t link_bytes = (now.host_bytes_stored - was.host_bytes_stored) +
                                    (now.host_bytes_loaded - was.host_bytes_loaded) +
                                    (now.disk_bytes_loaded - was.disk_bytes_loaded);
    const std::int64_t disk_bytes = (now.disk_bytes_stored - was.disk_bytes_stored) +
                                    (now.disk_bytes_loaded - was.disk_bytes_loaded);
    timing.modelled_tier_s = model.swap_seconds(link_bytes, now.host_copies - was.host_copies) +
                             model.disk_seconds(disk_bytes, now.disk_copies - was.disk_copies);
    timing.tier_copies_overlap = model.profile().tier_copies_overlap;
  }
  record.tier_s = timing.tier_copies_overlap
                      ? std::max(0.0, timing.modelled_tier_s - timing.predicted_s)
                      : timing.modelled_tier_s;
  if (clock_ == EngineClock::measured) record.tier_s = timing.measured_tier_s;
  tiers_seen_ = now;
}

}  // namespace kvlab
