#pragma once
// Step frames: what kvlab view animates. Each recorded step's batch (who prefilled how many
// tokens, who decoded) and the KV pool slot by slot after it (KvAllocator::pool_map). A long
// run keeps a bounded number of entries: past the budget every other frame is dropped and the
// stride doubles, so the frames stay evenly spaced (every step, every 2nd, every 4th, ...).
// A frame costs a pass over the pool, so a big pool starts on a stride that keeps that work
// under kMapSlotsPerStep slots a step (a 30M-slot pool: a frame every 512 steps).
#include <cstdint>
#include <string>
#include <vector>

#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/kv_allocator.hpp"

namespace kvlab {

struct FrameEntry {
  RequestId request = 0;
  std::int64_t tokens = 0;  // fed this step: a prefill chunk's, or a decode's (1 + proposals)
  bool decode = false;
  std::int64_t proposals = 0, accepted = 0;  // speculative decoding's verify
};

struct StepFrame {
  std::int64_t step = 0;
  double t = 0;  // the clock when the step ended
  std::vector<FrameEntry> batch;
  KvPoolMap pool;
  bool drawn_by_allocator = true;  // false: the engine drew the running sequences' views
  std::int64_t replica = -1;       // in a cluster: the replica (ids are the workload's); -1: one
};

// Step `step`'s frame: `applied`'s batch and `kv`'s pool map (or, for an allocator that draws
// none, the running sequences' views).
StepFrame make_frame(std::int64_t step, double t, const AppliedPlan& applied, KvAllocator& kv,
                     const RequestTable& table);

// Told of frames as steps end (kvlab serve's /ui): asked after each step whether it wants one,
// which is then made for it alone (a frame costs O(pool blocks)).
class FrameObserver {
 public:
  virtual ~FrameObserver() = default;
  virtual bool wants_frame() = 0;
  virtual void on_frame(StepFrame frame) = 0;
};

// A step extension (kvlab/engine/step_extension.hpp): after each step's update it records the
// step's frame (when the stride takes it) and offers one to the observer.
class FrameRecorder final : public StepExtension {
 public:
  static constexpr std::int64_t kMapSlotsPerStep = 65'536;
  // At most about `budget` batch entries and slot runs in all (0: no frames), of a pool of
  // `pool_slots`; `observer` (or null) is asked after each step.
  explicit FrameRecorder(std::int64_t budget = 0, std::int64_t pool_slots = 0,
                         FrameObserver* observer = nullptr);
  bool enabled() const { return budget_ > 0; }
  void after_update(StepState& step, std::span<const RequestId> held) override;
  void finish(EngineResult& result) override;
  // Records step `step` if the stride takes it.
  void record(std::int64_t step, double t, const AppliedPlan& applied, KvAllocator& kv,
              const RequestTable& table);
  std::int64_t stride() const { return stride_; }
  std::vector<StepFrame> take() { return std::move(frames_); }

 private:
  void thin_out();
  std::int64_t budget_, stride_ = 1, entries_ = 0;
  std::vector<StepFrame> frames_;
  FrameObserver* observer_;
};

// {"step":..,"t":..,"batch":[[request,tokens,decode,proposals,accepted],...],
//  "runs":[[start,length,owner,"state"],...],"tiers":[host,host_cap,disk,disk_cap],
//  "drawn_by":"allocator"|"engine"[,"replica":r]}
std::string frame_json(const StepFrame& frame);

}  // namespace kvlab
