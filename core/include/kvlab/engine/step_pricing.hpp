#pragma once
// What a step cost, for the clock (kvlab/engine/clock.hpp) to turn into its duration: the cost
// model's roofline over the batch and the rows step extensions add (a static batch's padding),
// the swap copies over the profile's link, the KV tier copies the allocator made since the last
// priced step; beside them the measured forward and copies. The step's record gets what was
// priced (work, prediction, swap and tier fields).
#include <span>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/engine_result.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

class StepPricer {
 public:
  // `cost_model`: null on the measured and wall clocks without a profile; `kv_tiers`: the
  // allocator keeps KV tiers (their copies are read from its stats, else never read).
  StepPricer(const CostModel* cost_model, bool kv_tiers, EngineClock clock)
      : cost_model_(cost_model), kv_tiers_(kv_tiers), clock_(clock) {}

  // `requests`: the step's requests' entries; `rows`: what the extensions priced beside them;
  // `timing`: the times they added (the proposer's). The record holds the measured forward.
  StepTiming price(const AppliedPlan& applied, std::span<const BatchEntry> requests,
                   std::span<const EntryShape> rows, StepTiming timing, const KvAllocator& kv,
                   StepRecord& record);

 private:
  void price_tier_copies(const KvAllocator& kv, StepTiming& timing, StepRecord& record);

  const CostModel* cost_model_;
  bool kv_tiers_;
  EngineClock clock_;
  KvAllocatorStats tiers_seen_;  // the allocator's tier counters as the last priced step left them
};

}  // namespace kvlab
