#pragma once
// A cluster of replicas behind a router (what Vidur, LLMServingSim, Llumnix and Preble study):
// each replica is a whole engine — its allocator, scheduler, backend and clock — and every
// request is routed when it arrives, by what each replica holds at that moment. The replicas
// advance in time order (the one furthest behind steps first), so a route sees every busy
// replica as of the arrival (a replica in the middle of a step shows its state after it).
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/engine/engine.hpp"
#include "kvlab/router.hpp"

namespace kvlab {

struct RouteRecord {
  std::size_t replica = 0;
  RequestId id_in_replica = 0;
  double time_s = 0;          // when it was routed (its arrival)
  std::string reason;         // the router's
  std::int64_t kv_bytes = 0;  // a decode route: the KV handed over
};

struct ClusterResult {
  std::vector<EngineResult> replicas;  // each replica's own run, its requests by local id
  std::vector<RouteRecord> routes;     // one per request, in workload order
  // Disaggregated: where each request's KV went after its prefill (nullopt: it ended there).
  std::vector<std::optional<RouteRecord>> decode_routes;
  double duration_s = 0;  // the last replica's clock at the end
};

// Disaggregated prefill and decode (DistServe, Splitwise): `prefill` replicas compute prompts
// and first tokens, `decode` replicas the rest. Each request is routed among the prefill
// replicas at its arrival; when its first token is out, its KV is handed off and crosses the
// link between them, taking transfer_seconds(bytes, measured copy-out seconds); then it is
// routed among the decode replicas, arriving there when the transfer ends. The whole request's
// KV moves in one transfer once the prefill is done (not layer by layer during it).
struct Disaggregation {
  std::span<Engine*const> prefill, decode;
  Router* prefill_router = nullptr;
  Router* decode_router = nullptr;
  std::function<double(std::int64_t bytes, double copy_out_s)> transfer_seconds;
  // Whole-request transfers share each replica's link: a handoff starts when its prefill
  // replica's and its decode replica's links are both free (first come, first served), so
  // transfers that overlap queue. Off for clocks that time the real copies (measured, wall).
  bool links_contend = true;
};
ClusterResult run_disaggregated(const Disaggregation& cluster,
                                const std::vector<Submission>& requests);

// Runs `requests` (which must outlive the call) on `replicas` (not started; each is started
// empty here) behind `router`. Throws kvlab::Error when the router names a replica that does
// not exist; every request ends finished or rejected by the replica that got it. Between two
// arrivals the replicas step on up to `threads` threads: the same runs as on one, for replicas
// that share nothing and whose clocks do not read the wall (the virtual clock).
ClusterResult run_cluster(std::span<Engine* const> replicas, Router& router,
                          const std::vector<Submission>& requests, int threads = 1);

// Every request's timeline in workload order (id = its index in the workload), from the
// replica that served it.
std::vector<RequestTimeline> cluster_timelines(const ClusterResult& result);

// The whole cluster as one run: timelines and tokens in workload order, every replica's steps
// (tagged with their replica) and events (request ids remapped to the workload's, tagged) in
// time order, a route event per request; the duration is the last replica's.
// The rvalue one moves the replicas' steps and events out instead of copying them (a whole-trace
// replay holds millions of steps).
EngineResult merged_result(const ClusterResult& result);
EngineResult merged_result(ClusterResult&& result);

}  // namespace kvlab
