#pragma once
// What the engine asks of its requests and its pool beside the step: whether a request could
// ever run here (one that could not is rejected as it arrives, with the reason), whether external
// fragmentation blocked an admission, and the work that waits (what a router sees).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/router.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

class AdmissionCheck {
 public:
  // `allocator_name`: the allocator as errors name it.
  AdmissionCheck(const SequenceRules& rules, std::string allocator_name)
      : rules_(rules), allocator_name_(std::move(allocator_name)) {}

  // Why `r` can never run on `kv`, or "" when it can: an empty prompt, prompt + max tokens past
  // the context, or more KV than the pool (or the allocator's own limit) holds. A sequence holds
  // at most its prompt or the window (+1 for the new token), whichever is longer, and at most
  // what each extension lets it hold (StepExtension::max_held).
  std::string never_fits(const RequestState& r, std::span<StepExtension* const> extensions,
                         const KvAllocator& kv);

 private:
  SequenceRules rules_;
  std::string allocator_name_;
  // A prompt of tokens no prefix matches (-1), kept: long prompts arrive by the thousand in a
  // trace replay.
  std::vector<std::int32_t> unmatched_tokens_;
};

// True when a request refused for memory (kv_full) would have fitted in the free slots in all:
// external fragmentation blocked an admission this step.
bool admission_blocked_by_fragmentation(const StepPlan& plan, const RequestTable& table,
                                        const KvAllocator& kv);

// What a router sees of an engine: its pool's use, and the tokens still to compute of the
// requests that wait, run, or were routed to it and have not arrived (none without `table`).
ReplicaLoad replica_load(const RequestTable* table, const KvAllocator& kv);

}  // namespace kvlab
