#include "kvlab/engine/live_view.hpp"

namespace kvlab {

void LiveViewFeed::add_steps(std::span<const StepRecord> steps) {
  steps_.insert(steps_.end(), steps.begin(), steps.end());
  keep_within(steps_, limits_.steps);
}

// Events also move the lanes: admitted (first scheduled), preempted, finished, rejected.
void LiveViewFeed::add_events(std::span<const EngineEvent> events) {
  for (const EngineEvent& e : events) {
    events_.push_back(e);
    const auto lane = lanes_.find(e.request);
    if (lane == lanes_.end()) continue;
    Lane& l = lane->second;
    if (e.kind == EventKind::event_admit && !l.scheduled) l.scheduled = e.t;
    if (e.kind == EventKind::event_preempt || e.kind == EventKind::event_swap_out) ++l.preemptions;
    if (e.kind == EventKind::event_finish) l.finish = e.t;
    if (e.kind == EventKind::event_reject) {
      l.rejected = true;
      l.reason = e.reason;
      l.finish = e.t;
    }
  }
  keep_within(events_, limits_.events);
}

void LiveViewFeed::add_frame(const StepFrame& frame) {
  frames_.push_back(frame_json(frame));
  keep_within(frames_, limits_.frames);
}

void LiveViewFeed::arrived(const Submission& request) {
  Lane& lane = lanes_[request.id];
  lane.arrival = request.arrival_s;
  lane.prompt = static_cast<std::int64_t>(request.prompt.size());
  forget_old_requests();
}

void LiveViewFeed::token(RequestId id, double t) {
  const auto lane = lanes_.find(id);
  if (lane == lanes_.end()) return;
  Lane& l = lane->second;
  if (!l.first_token) l.first_token = t;
  l.last_token = t;
  ++l.output;
}

// The oldest requests go first (ids grow with arrival), finished or not.
void LiveViewFeed::forget_old_requests() {
  while (lanes_.size() > limits_.requests) lanes_.erase(lanes_.begin());
}

namespace {

nlohmann::json optional_number(const std::optional<double>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

// The step columns a client sees in the aggregate view: none depends on which prompt tokens
// were found in the prefix cache (a step's duration does, as any client's TTFT does: serving.md).
constexpr const char* kAggregateStepKeys[] = {"step", "t", "dur", "batch", "waiting", "running"};

nlohmann::json LiveViewFeed::step_columns(LiveViewDetail detail) const {
  constexpr const char* kStepKeys[] = {
      "step",    "t",        "dur",  "batch",    "prefill", "decode", "preempted", "waiting",
      "running", "capacity", "used", "reserved", "slack",   "free",   "cached",    "padding"};
  nlohmann::json steps = nlohmann::json::object();
  for (const char* key : kStepKeys) steps[key] = nlohmann::json::array();
  for (const StepRecord& s : steps_) {
    const double row[] = {static_cast<double>(s.step),
                          s.start_s,
                          s.duration_s,
                          static_cast<double>(s.batch),
                          static_cast<double>(s.prefill_tokens),
                          static_cast<double>(s.decode_tokens),
                          static_cast<double>(s.preempted),
                          static_cast<double>(s.waiting),
                          static_cast<double>(s.running),
                          static_cast<double>(s.kv.capacity),
                          static_cast<double>(s.kv.used),
                          static_cast<double>(s.kv.reserved_unused),
                          static_cast<double>(s.kv.last_block_slack),
                          static_cast<double>(s.kv.free),
                          static_cast<double>(s.kv.cached_free),
                          static_cast<double>(s.padding_slots)};
    for (std::size_t k = 0; k < std::size(kStepKeys); ++k) steps[kStepKeys[k]].push_back(row[k]);
  }
  if (detail == LiveViewDetail::full) return steps;
  nlohmann::json kept = nlohmann::json::object();
  for (const char* key : kAggregateStepKeys) kept[key] = std::move(steps[key]);
  return kept;
}

nlohmann::json LiveViewFeed::request_columns(LiveViewDetail detail) const {
  nlohmann::json requests = nlohmann::json::object();
  for (const char* key : {"id", "arrival", "scheduled", "first_token", "finish", "prompt", "output",
                          "ttft", "tpot", "preemptions", "rejected", "reason"})
    requests[key] = nlohmann::json::array();
  if (detail == LiveViewDetail::aggregate) return requests;
  for (const auto& [id, l] : lanes_) {
    requests["id"].push_back(id);
    requests["arrival"].push_back(l.arrival);
    requests["scheduled"].push_back(optional_number(l.scheduled));
    requests["first_token"].push_back(optional_number(l.first_token));
    requests["finish"].push_back(optional_number(l.finish));
    requests["prompt"].push_back(l.prompt);
    requests["output"].push_back(l.output);
    requests["ttft"].push_back(l.first_token ? nlohmann::json(*l.first_token - l.arrival)
                                             : nlohmann::json(nullptr));
    requests["tpot"].push_back(l.output > 1 ? nlohmann::json((*l.last_token - *l.first_token) /
                                                             static_cast<double>(l.output - 1))
                                            : nlohmann::json(nullptr));
    requests["preemptions"].push_back(l.preemptions);
    requests["rejected"].push_back(l.rejected ? 1 : 0);
    requests["reason"].push_back(l.reason);
  }
  return requests;
}

std::string LiveViewFeed::json_text(const std::string& name, LiveViewDetail detail) const {
  const bool full = detail == LiveViewDetail::full;
  nlohmann::json events = nlohmann::json::array();
  if (full)
    for (const EngineEvent& e : events_)
      events.push_back({e.step, event_kind_name(e.kind), e.request, e.reason});
  nlohmann::json run = {{"name", name},
                        {"steps", step_columns(detail)},
                        {"requests", request_columns(detail)},
                        {"events", std::move(events)},
                        {"block_size", 0}};
  if (!full)
    run["withheld"] =
        "the KV pool, prefill counts, events and requests: other clients' prefix-cache hits "
        "would show in them (the operator's kvlab serve --ui full shows them)";
  std::string text = run.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text.pop_back();  // the closing brace: the frames go before it
  text += ",\"frames\":[";
  if (full)
    for (std::size_t i = 0; i < frames_.size(); ++i) (text += i ? "," : "") += frames_[i];
  return text + "]}";
}

}  // namespace kvlab
