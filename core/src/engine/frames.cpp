#include "kvlab/engine/frames.hpp"

#include "kvlab/engine/engine.hpp"  // EngineResult

#include <algorithm>
#include <nlohmann/json.hpp>

namespace kvlab {
namespace {

// An allocator that draws no map: the running sequences' views as used slots (positions_view
// would not name slots).
void draw_views(const KvAllocator& kv, const RequestTable& table, KvPoolMap& map) {
  for (const RequestState* r : table.running())
    for (const KvExtent& e : kv.view(r->id).extents)
      if (e.start_slot >= 0 && e.length > 0)
        map.runs.push_back({e.start_slot, e.length, r->id, KvSlotState::used});
  sort_runs(map.runs);
}

std::int64_t entries_of(const StepFrame& frame) {
  return static_cast<std::int64_t>(frame.batch.size() + frame.pool.runs.size()) + 1;
}

}  // namespace

StepFrame make_frame(std::int64_t step, double t, const AppliedPlan& applied, KvAllocator& kv,
                     const RequestTable& table) {
  StepFrame frame;
  frame.step = step;
  frame.t = t;
  frame.batch.reserve(applied.batch.size());
  for (const ScheduledWork& w : applied.batch)
    frame.batch.push_back({w.id, w.tokens, w.decode, w.proposals, w.accepted});
  const KvPoolDrawing* drawing = kv.features().drawing;
  frame.drawn_by_allocator = drawing != nullptr;
  if (drawing != nullptr)
    drawing->pool_map(frame.pool);
  else
    draw_views(kv, table, frame.pool);
  return frame;
}

FrameRecorder::FrameRecorder(std::int64_t budget, std::int64_t pool_slots, FrameObserver* observer)
    : budget_(budget), observer_(observer) {
  while (stride_ * kMapSlotsPerStep < pool_slots) stride_ *= 2;
}

void FrameRecorder::after_update(StepState& step, std::span<const RequestId> held) {
  (void)held;
  record(step.step, step.now, *step.applied, step.allocator, step.table);
  if (observer_ != nullptr && observer_->wants_frame())
    observer_->on_frame(make_frame(step.step, step.now, *step.applied, step.allocator, step.table));
}

void FrameRecorder::finish(EngineResult& result) {
  result.frame_stride = stride_;
  result.frames = take();
}

void FrameRecorder::record(std::int64_t step, double t, const AppliedPlan& applied, KvAllocator& kv,
                           const RequestTable& table) {
  if (!enabled() || step % stride_ != 0) return;
  const StepFrame& frame = frames_.emplace_back(make_frame(step, t, applied, kv, table));
  entries_ += entries_of(frame);
  if (entries_ > budget_) thin_out();
}

// Keeps the frames on a doubled stride: memory stays within the budget however long the run.
void FrameRecorder::thin_out() {
  while (entries_ > budget_ && frames_.size() > 1) {
    stride_ *= 2;
    std::erase_if(frames_, [&](const StepFrame& f) { return f.step % stride_ != 0; });
    entries_ = 0;
    for (const StepFrame& f : frames_) entries_ += entries_of(f);
  }
}

std::string frame_json(const StepFrame& frame) {
  nlohmann::json batch = nlohmann::json::array();
  for (const FrameEntry& e : frame.batch)
    batch.push_back({e.request, e.tokens, e.decode ? 1 : 0, e.proposals, e.accepted});
  nlohmann::json runs = nlohmann::json::array();
  for (const KvSlotRun& r : frame.pool.runs) {  // [start, length, owner, state(, KV group)]
    runs.push_back({r.start, r.length, r.owner, slot_state_name(r.state)});
    if (r.group > 0) runs.back().push_back(r.group);
  }
  const KvPoolMap& p = frame.pool;
  nlohmann::json j = {{"step", frame.step},
                      {"t", frame.t},
                      {"batch", std::move(batch)},
                      {"runs", std::move(runs)},
                      {"tiers", {p.host_blocks, p.host_capacity, p.disk_blocks, p.disk_capacity}},
                      {"drawn_by", frame.drawn_by_allocator ? "allocator" : "engine"}};
  if (frame.replica >= 0) j["replica"] = frame.replica;
  return j.dump();
}

}  // namespace kvlab
