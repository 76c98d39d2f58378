#pragma once
// The step's one socket. Engine::step() is a fixed pipeline (kvlab/engine/engine.hpp); a feature
// that needs a say in it is a StepExtension, called at these points of every step, in this
// order, each extension in the order the engine holds them (its own, then
// EngineOptions::extensions):
//
//   arrivals      max_held          the most KV a request can hold at once: one that could never
//                                   fit is rejected as it arrives
//                 on_leave          a request left outside a batch (cancelled): its state goes
//   1. plan       before_plan       before the scheduler sees the requests
//                 retry_empty_batch the plan applied to nothing: true when the extension freed
//                                   KV, and the step plans again
//   2. apply      shape_batch       the applied plan's entries are built, before the forward:
//                                   change them, append rows
//   3. run        price             the step is priced: rows it costs beyond its entries, and
//                                   times the clock adds
//   4. sample     after_forward     the forward ran, its tokens are picked
//   5. update     after_update      tokens appended, finished requests freed, before the step's
//                                   record is kept (StepState::record still open)
//   end of run    finish            what the extension recorded goes into the run's result
//
// The engine's own extensions (engine_extensions.cpp): speculative decoding (Speculator), a KV
// policy (KvPolicyRunner), a static batch's padding rows (StaticPadding) and the step frames of
// kvlab view (FrameRecorder). An extension is host-internal: no plugin ABI, made per run.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

struct StepRecord;
struct EngineResult;

// The step an extension is called in.
struct StepState {
  std::int64_t step = 0;  // this step's number
  double now = 0;         // the clock: the step's start, from after_forward on its end
  RequestTable& table;
  KvAllocator& allocator;
  StepRecord& record;                    // this step's record, kept after after_update
  const CostModel* cost_model;           // the step's price (null: the measured clock alone)
  const AppliedPlan* applied = nullptr;  // from shape_batch on: the batch's requests
};

class StepExtension {
 public:
  virtual ~StepExtension() = default;

  // Arrivals: `held` KV positions (prompt + max tokens, or less under a window) at most, or
  // fewer if the extension keeps fewer.
  virtual std::int64_t max_held(const RequestState& request, std::int64_t held) const {
    (void)request;
    return held;
  }
  virtual void on_leave(StepState& step, RequestId id) {
    (void)step;
    (void)id;
  }

  virtual void before_plan(StepState& step) { (void)step; }
  virtual bool retry_empty_batch(StepState& step) {
    (void)step;
    return false;
  }
  // `batch`: one entry per request of step.applied->batch, in order, then any rows extensions
  // before this one appended.
  virtual void shape_batch(StepState& step, std::vector<BatchEntry>& batch) {
    (void)step;
    (void)batch;
  }
  // Rows the step costs beyond its requests' entries (appended to `rows`), and times the clock
  // adds (`timing`).
  virtual void price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) {
    (void)step;
    (void)rows;
    (void)timing;
  }
  // `requests`: the step's requests' entries (rows appended after them are not included).
  virtual void after_forward(StepState& step, std::span<const BatchEntry> requests,
                             const ForwardResult& result) {
    (void)step;
    (void)requests;
    (void)result;
  }
  // `held`: requests of a padded static batch that finished this step, their KV still allocated
  // (apply_tokens' `held`).
  virtual void after_update(StepState& step, std::span<const RequestId> held) {
    (void)step;
    (void)held;
  }
  virtual void finish(EngineResult& result) { (void)result; }
};

}  // namespace kvlab
