#pragma once
// The router plugin interface: a cluster of replicas (each its own engine: allocator, scheduler,
// backend) takes every request at its arrival time, and a router says which replica serves it
// (round_robin, least_loaded, prefix_affinity ship as plugins; engine/cluster.hpp runs them).
// A disaggregated cluster runs two: one over its prefill replicas at each arrival, one over its
// decode replicas at each KV handoff; each sees only its side's replicas.
#include <cstdint>
#include <span>
#include <string>

namespace kvlab {

// A replica as a router sees it when a request arrives.
struct ReplicaLoad {
  std::int64_t waiting = 0;  // requests queued (or routed, not yet arrived), swapped included
  std::int64_t running = 0;
  // Tokens still to compute: prompts not yet in KV and outputs not yet generated, of every
  // request it holds (the work its queue stands for).
  std::int64_t queued_tokens = 0;
  // Of those, the prompt tokens of waiting requests: the prefill work ahead of a new arrival's
  // first token.
  std::int64_t queued_prefill_tokens = 0;
  std::int64_t kv_used = 0, kv_capacity = 0;  // slots of its KV pool
};

// The request being routed.
struct RouteRequest {
  std::int64_t index = 0;  // in the cluster's workload
  double arrival_s = 0;
  std::span<const std::int32_t> prompt;
  std::int64_t max_tokens = 0;
  int priority = 0;
};

struct RouteDecision {
  std::size_t replica = 0;
  std::string reason;  // for the event log: why this replica
};

class Router {
 public:
  virtual ~Router() = default;
  // Called once per request, in arrival order; `replicas` is never empty. A replica index out
  // of range is an error the cluster reports.
  virtual RouteDecision route(const RouteRequest& request,
                              std::span<const ReplicaLoad> replicas) = 0;
};

}  // namespace kvlab
