#pragma once
// The engine's side of a KV policy (kvlab/kv_policy.hpp): before each forward it asks the
// backend for the attention scores the policy reads and hands it each sequence's key mask (what
// each layer's K/V head no longer sees); after the step's update it shows the policy each
// running sequence's positions, drops what no head keeps (KvAllocator::evict) and masks what
// some heads keep and others do not (kvlab/kv/kv_keep.hpp); with KV groups each group frees
// what none of its layers keeps (KvGroupDropping). A sequence that lost its KV
// (preempted) starts afresh in the policy; a finished one is forgotten. A step extension
// (kvlab/engine/step_extension.hpp).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/engine_result.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/kv/kv_keep.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_policy.hpp"

namespace kvlab {

class KvPolicyRunner final : public StepExtension {
 public:
  // `names`: the policy, the allocator and the backend as errors name them; `layers` and
  // `kv_heads`: the model's, that the policy selects in; `layer_windows`: (layers) each layer's
  // window (SequenceRules::layer_windows), or empty: what a window no longer shows a layer is
  // hidden from its heads' choice.
  KvPolicyRunner(KvPolicy& policy, std::string policy_name, std::string allocator_name,
                 std::string backend_name, std::int64_t layers, std::int64_t kv_heads,
                 std::vector<std::optional<std::int64_t>> layer_windows = {})
      : policy_(policy),
        policy_name_(std::move(policy_name)),
        allocator_name_(std::move(allocator_name)),
        backend_name_(std::move(backend_name)),
        layers_(layers),
        kv_heads_(kv_heads),
        layer_windows_(std::move(layer_windows)) {}

  // A sequence holds its prompt, or what the policy may hold and a new token, at most.
  std::int64_t max_held(const RequestState& request, std::int64_t held) const override {
    const std::int64_t limit = std::max(policy_.held_limit(), policy_.budget());
    return std::min(held, std::max(request.prompt_tokens, limit > held ? held : limit + 1));
  }
  // A sequence that ended outside a step's batch (a cancelled request): its state goes.
  void on_leave(StepState& step, RequestId id) override {
    (void)step;
    forget(id);
  }
  void shape_batch(StepState& step, std::vector<BatchEntry>& batch) override {
    ask_scores(std::span(batch).first(step.applied->batch.size()), step.applied->batch, step.table);
  }
  void after_forward(StepState& step, std::span<const BatchEntry> requests,
                     const ForwardResult& result) override {
    (void)step;
    take_scores(requests, result);
  }
  void after_update(StepState& step, std::span<const RequestId> held) override;
  void finish(EngineResult& result) override { result.kv_policy = stats_; }

  // Most positions a sequence keeps between steps (the policy's budget).
  std::int64_t budget() const { return policy_.budget(); }
  void forget(RequestId id) {
    policy_.forget(id);
    preemptions_.erase(id);
    kept_.erase(id);
  }
  // The step's requests' entries (`work`'s, in its order) ask for the policy's scores and get
  // their key masks (none for a request preempted since its last selection).
  void ask_scores(std::span<BatchEntry> requests, std::span<const ScheduledWork> work,
                  const RequestTable& table);
  // Keeps the forward's scores of the step's requests' entries; throws kvlab::Error when the
  // policy reads scores the backend did not report.
  void take_scores(std::span<const BatchEntry> requests, const ForwardResult& result);
  // After apply_tokens: each batch request still running keeps what the policy selects.
  void select(const AppliedPlan& applied, const RequestTable& table, KvAllocator& kv);

 private:
  void select_one(RequestId id, const ScheduledWork& work, std::span<const float> scores,
                  KvAllocator& kv);
  // Drops what no head keeps (with KV groups: in each group, what none of its layers keeps);
  // returns the positions the sequence's slots hold now, on average over its groups.
  double drop_unkept(RequestId id, const HeadSelection& kept, KvAllocator& kv) const;

  KvPolicy& policy_;
  std::string policy_name_, allocator_name_, backend_name_;
  std::int64_t layers_, kv_heads_;
  std::vector<std::optional<std::int64_t>> layer_windows_;
  std::vector<float> scores_;         // this step's, entry after entry
  std::vector<float> head_scores_;    // one request's, (layers, kv_heads, positions held)
  std::vector<std::size_t> offsets_;  // each entry's first score
  std::vector<std::int64_t> positions_;
  std::vector<std::uint8_t> keep_, visible_;
  std::vector<std::vector<std::uint8_t>> masks_;  // this step's entries' key masks
  // the requests whose heads see different positions: what each head sees
  std::unordered_map<RequestId, HeadSelection> kept_;
  std::unordered_map<RequestId, std::int64_t> preemptions_;  // as each was last selected
  KvKeepStats stats_;
};

}  // namespace kvlab
