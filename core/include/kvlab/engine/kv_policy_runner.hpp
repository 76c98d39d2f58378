#pragma once
// The engine's side of a KV policy (kvlab/kv_policy.hpp): before each forward it asks the
// backend for the attention scores the policy reads; after the step's update it shows the
// policy each running sequence's positions and drops what the policy lets go (KvAllocator::
// evict). A sequence that lost its KV (preempted) starts afresh in the policy; a finished one
// is forgotten.
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_policy.hpp"

namespace kvlab {

class KvPolicyRunner {
 public:
  // `names`: the policy and the allocator as errors name them.
  KvPolicyRunner(KvPolicy& policy, std::string policy_name, std::string allocator_name)
      : policy_(policy),
        policy_name_(std::move(policy_name)),
        allocator_name_(std::move(allocator_name)) {}

  // Most positions a sequence keeps between steps (the policy's budget).
  std::int64_t budget() const { return policy_.budget(); }
  // A sequence that ended outside a step's batch (a cancelled request): its state goes.
  void forget(RequestId id) {
    policy_.forget(id);
    preemptions_.erase(id);
  }
  // The first `requests` entries are the step's requests: they ask for the policy's scores.
  void ask_scores(std::span<BatchEntry> requests) const;
  // Keeps the forward's scores of the first `requests` entries; throws kvlab::Error when the
  // policy reads scores the backend did not report.
  void take_scores(std::span<const BatchEntry> requests, const ForwardResult& result,
                   const std::string& backend_name);
  // After apply_tokens: each batch request still running keeps what the policy selects.
  void select(const AppliedPlan& applied, const RequestTable& table, KvAllocator& kv);

 private:
  void select_one(RequestId id, const ScheduledWork& work, std::span<const float> scores,
                  KvAllocator& kv);

  KvPolicy& policy_;
  std::string policy_name_, allocator_name_;
  std::vector<float> scores_;         // this step's, entry after entry
  std::vector<std::size_t> offsets_;  // each entry's first score
  std::vector<std::int64_t> positions_, kept_;
  std::unordered_map<RequestId, std::int64_t> preemptions_;  // as each was last selected
};

}  // namespace kvlab
