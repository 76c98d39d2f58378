#pragma once
// A padded static batch's finished rows (Hugging Face generate()): a request that finishes before
// the rest of its batch keeps its KV and costs a row of every step until the batch ends, adding
// one discarded pad token per step. The engine holds them here: the cost model prices their
// shapes on every clock, and on a clock that times the backend they are also computed
// (append_rows), so that static batching is timed with the padding the simulator charges it.
// A step extension (kvlab/engine/step_extension.hpp): before each plan, and when a plan applied
// to nothing, the rows of a batch that ended are freed; the batch gets the rows (computes_rows);
// the step is priced with them; after the update the batch's newly finished requests join.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

class StaticPadding final : public StepExtension {
 public:
  // `context`: the model's context (0: none); a pad token never goes past its last position.
  // `computes_rows`: the backend computes the rows too (a clock that times it: measured, wall).
  StaticPadding(std::int64_t context, bool computes_rows)
      : context_(context), computes_rows_(computes_rows) {}

  void before_plan(StepState& step) override {
    (void)release_if_batch_ended(step.table, step.allocator);
  }
  bool retry_empty_batch(StepState& step) override {
    return release_if_batch_ended(step.table, step.allocator);
  }
  void shape_batch(StepState& step, std::vector<BatchEntry>& batch) override {
    if (computes_rows_) append_rows(step.table, step.allocator, batch);
  }
  void price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) override;
  void after_update(StepState& step, std::span<const RequestId> held) override;

  // After a step's update: every held row moves one pad token further, and `finished` (requests
  // of the batch that finished this step, their KV still allocated) join them. Frees everything
  // when no request of the batch still runs.
  void hold(std::span<const RequestId> finished, const RequestTable& table, KvAllocator& kv);
  // Frees every held request's KV once nothing of the batch still runs; true when it freed some.
  bool release_if_batch_ended(const RequestTable& table, KvAllocator& kv);
  void clear();

  // The held rows as the cost model prices them, and the KV slots their views hold.
  std::span<const EntryShape> shapes() const { return shapes_; }
  std::int64_t slots() const { return slots_; }

  // The held rows for the backend, appended to `batch`: a pad token (the request's last token)
  // decoded at the position priced for it, attending to as many keys (the view extended by pool
  // slots when it has gone past what it holds), every layer and the LM head; it writes no K/V
  // and its result is discarded.
  void append_rows(const RequestTable& table, const KvAllocator& kv,
                   std::vector<BatchEntry>& batch) const;

 private:
  std::int64_t context_;
  bool computes_rows_;
  std::vector<RequestId> ids_;
  std::vector<EntryShape> shapes_;  // ids_' rows: the position of the discarded token each step
  std::int64_t slots_ = 0;
};

}  // namespace kvlab
