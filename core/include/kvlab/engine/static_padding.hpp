#pragma once
// A padded static batch's finished rows (Hugging Face generate()): a request that finishes before
// the rest of its batch keeps its KV and costs a row of every step until the batch ends, adding
// one discarded pad token per step. The engine holds them here: the cost model prices their
// shapes on every clock, and on a clock that times the backend they are also computed (rows()),
// so that static batching is timed with the padding the simulator charges it.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

class StaticPadding {
 public:
  // `context`: the model's context (0: none); a pad token never goes past its last position.
  explicit StaticPadding(std::int64_t context) : context_(context) {}

  // After a step's update: every held row moves one pad token further, and `finished` (requests
  // of the batch that finished this step, their KV still allocated) join them. Frees everything
  // when no request of the batch still runs.
  void hold(const std::vector<RequestId>& finished, const RequestTable& table, KvAllocator& kv);
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
  std::vector<RequestId> ids_;
  std::vector<EntryShape> shapes_;  // ids_' rows: the position of the discarded token each step
  std::int64_t slots_ = 0;
};

}  // namespace kvlab
