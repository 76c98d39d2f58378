#pragma once
// What kvlab serve's /ui draws of a live engine: its latest steps, events, step frames and
// requests, each kept to a bound (the oldest dropped), as the JSON of one run of kvlab view's
// data (kvlab/experiment/results_view.hpp: the same page draws both).
#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "kvlab/engine/engine.hpp"

namespace kvlab {

// How much of the engine a client of kvlab serve's /ui sees. Every client shares the engine, so
// per-step prefill counts, pool frames (shared prefix blocks), events and request lanes tell one
// client whether another client's prompt starts with a guessed text (a prefix-cache hit
// prefills fewer tokens).
enum class LiveViewDetail {
  aggregate,  // the default: per step only the batch, queue and step times; no pool, no requests
  full,       // everything (kvlab serve --ui full: the operator's choice)
};

struct LiveViewLimits {
  std::size_t steps = 5'000, events = 20'000, frames = 300, requests = 2'000;
};

class LiveViewFeed {
 public:
  explicit LiveViewFeed(LiveViewLimits limits = {}) : limits_(limits) {}
  void add_steps(std::span<const StepRecord> steps);
  void add_events(std::span<const EngineEvent> events);
  void add_frame(const StepFrame& frame);
  void arrived(const Submission& request);  // its arrival_s on the engine's clock
  void token(RequestId id, double t);
  // {"name", "steps": {column: [...]}, "requests": {...}, "events": [...], "frames": [...]},
  // as text (the frames were written once, as they came). `aggregate`: the step columns of
  // kAggregateStepKeys only, no requests, events or frames, and "withheld" saying so.
  std::string json_text(const std::string& name,
                        LiveViewDetail detail = LiveViewDetail::full) const;

 private:
  struct Lane {
    double arrival = 0;
    std::optional<double> scheduled, first_token, last_token, finish;
    std::int64_t prompt = 0, output = 0, preemptions = 0;
    bool rejected = false;
    std::string reason;
  };
  template <typename T>
  void keep_within(std::deque<T>& items, std::size_t most) {
    while (items.size() > most) items.pop_front();
  }
  void forget_old_requests();
  nlohmann::json step_columns(LiveViewDetail detail) const;
  nlohmann::json request_columns(LiveViewDetail detail) const;
  LiveViewLimits limits_;
  std::deque<StepRecord> steps_;
  std::deque<EngineEvent> events_;
  std::deque<std::string> frames_;  // frame_json's, made once
  std::map<RequestId, Lane> lanes_;
};

}  // namespace kvlab
