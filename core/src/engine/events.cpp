#include "kvlab/engine/events.hpp"

#include <nlohmann/json.hpp>

namespace kvlab {

const char* event_kind_name(EventKind kind) {
  switch (kind) {
    case EventKind::event_admit:
      return "admit";
    case EventKind::event_defer:
      return "defer";
    case EventKind::event_preempt:
      return "preempt";
    case EventKind::event_swap_out:
      return "swap_out";
    case EventKind::event_swap_full:
      return "swap_full";
    case EventKind::event_swap_in:
      return "swap_in";
    case EventKind::event_finish:
      return "finish";
    case EventKind::event_reject:
      return "reject";
    case EventKind::event_evict:
      return "evict";
    case EventKind::event_route:
      return "route";
  }
  return "unknown";
}

std::string event_json(const EngineEvent& event) {
  nlohmann::json j = {{"step", event.step}, {"t", event.t}, {"event", event_kind_name(event.kind)}};
  if (event.kind == EventKind::event_evict)
    j["blocks"] = event.blocks;
  else
    j["request"] = event.request;
  if (!event.reason.empty()) j["reason"] = event.reason;
  if (event.replica >= 0) j["replica"] = event.replica;
  return j.dump();
}

}  // namespace kvlab
