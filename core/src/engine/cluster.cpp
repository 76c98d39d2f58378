#include "kvlab/engine/cluster.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// The busy replica whose clock is furthest behind, or nullptr when none has work.
Engine* furthest_behind(std::span<Engine* const> replicas) {
  Engine* behind = nullptr;
  for (Engine* e : replicas)
    if (e->has_work() && (behind == nullptr || e->now() < behind->now())) behind = e;
  return behind;
}

RouteRecord route_one(std::span<Engine* const> replicas, Router& router, const WorkloadRequest& w,
                      std::int64_t index) {
  std::vector<ReplicaLoad> loads;
  loads.reserve(replicas.size());
  for (const Engine* e : replicas) loads.push_back(e->load());
  const RouteDecision d = plugin_call(
      "the router", index,
      [&] {
        return router.route({index, w.arrival_s, w.prompt, w.output_tokens, w.priority}, loads);
      },
      "request");
  if (d.replica >= replicas.size())
    throw Error(fmt::format("router sent request {} to replica {}, but the cluster has {}", index,
                            d.replica, replicas.size()));
  return {d.replica, replicas[d.replica]->submit(w), w.arrival_s, d.reason};
}

}  // namespace

ClusterResult run_cluster(std::span<Engine* const> replicas, Router& router,
                          const std::vector<WorkloadRequest>& requests) {
  if (replicas.empty()) throw Error("a cluster needs at least one replica");
  static const std::vector<WorkloadRequest> kNone;
  for (Engine* e : replicas) e->start(kNone);
  std::vector<std::size_t> order(requests.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return requests[a].arrival_s < requests[b].arrival_s;
  });
  ClusterResult result;
  result.routes.resize(requests.size());
  std::size_t next = 0;
  while (true) {
    const double arrival = next < order.size() ? requests[order[next]].arrival_s
                                               : std::numeric_limits<double>::infinity();
    if (Engine* behind = furthest_behind(replicas); behind != nullptr && behind->now() < arrival) {
      (void)behind->step();
      continue;
    }
    if (next == order.size()) break;  // nothing to route, no replica busy
    const std::size_t index = order[next++];
    result.routes[index] =
        route_one(replicas, router, requests[index], static_cast<std::int64_t>(index));
  }
  for (Engine* e : replicas) {
    result.duration_s = std::max(result.duration_s, e->now());
    result.replicas.push_back(e->take_result());
  }
  return result;
}

std::vector<RequestTimeline> cluster_timelines(const ClusterResult& result) {
  std::vector<RequestTimeline> timelines;
  timelines.reserve(result.routes.size());
  for (std::size_t i = 0; i < result.routes.size(); ++i) {
    const RouteRecord& route = result.routes[i];
    RequestTimeline t = result.replicas.at(route.replica)
                            .requests.at(static_cast<std::size_t>(route.id_in_replica));
    t.id = static_cast<RequestId>(i);
    timelines.push_back(std::move(t));
  }
  return timelines;
}

EngineResult merged_result(const ClusterResult& result) {
  EngineResult merged;
  merged.requests = cluster_timelines(result);
  merged.duration_s = result.duration_s;
  std::vector<std::vector<RequestId>> global(result.replicas.size());  // local id -> workload
  for (std::size_t r = 0; r < result.replicas.size(); ++r)
    global[r].resize(result.replicas[r].requests.size());
  for (std::size_t i = 0; i < result.routes.size(); ++i) {
    const RouteRecord& route = result.routes[i];
    global[route.replica][static_cast<std::size_t>(route.id_in_replica)] =
        static_cast<RequestId>(i);
    const EngineResult& replica = result.replicas[route.replica];
    const auto local = static_cast<std::size_t>(route.id_in_replica);
    merged.tokens.push_back(replica.tokens[local]);
    merged.logprobs.push_back(replica.logprobs.at(local));  // empty unless asked for
    merged.events.push_back({-1, route.time_s, EventKind::event_route, static_cast<RequestId>(i),
                             route.reason, 0, static_cast<std::int64_t>(route.replica)});
  }
  for (std::size_t r = 0; r < result.replicas.size(); ++r) {
    for (StepRecord step : result.replicas[r].steps) {
      step.replica = static_cast<std::int64_t>(r);
      merged.steps.push_back(step);
    }
    for (EngineEvent event : result.replicas[r].events) {
      if (event.request >= 0) event.request = global[r][static_cast<std::size_t>(event.request)];
      event.replica = static_cast<std::int64_t>(r);
      merged.events.push_back(std::move(event));
    }
  }
  std::stable_sort(merged.steps.begin(), merged.steps.end(),
                   [](const StepRecord& a, const StepRecord& b) { return a.start_s < b.start_s; });
  std::stable_sort(merged.events.begin(), merged.events.end(),
                   [](const EngineEvent& a, const EngineEvent& b) { return a.t < b.t; });
  return merged;
}

}  // namespace kvlab
