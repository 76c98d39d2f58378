#pragma once
// A cluster under live traffic (kvlab serve with [cluster] replicas > 1): a LiveEngine per replica,
// each stepping on its own thread and clock, behind a router plugin that picks each request's
// replica when it is submitted, by what every replica holds at that moment (its queue, running
// batch and KV use; submissions a replica has not taken yet count as waiting there). The ids it
// gives are the cluster's (submission order); its record is a `kvlab run` cluster's: every
// replica's run and one route per request, for merged_result. One replica needs no router.
//
//   client threads: submit -> router.route(request, every replica's load()) -> that replica
//   each replica's thread: its own LiveEngine loop; callbacks carry the cluster's id
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvlab/engine/cluster.hpp"
#include "kvlab/engine/live_engine.hpp"
#include "kvlab/router.hpp"

namespace kvlab {

class LiveCluster {
 public:
  // `replicas`: not empty, each running. `router`: used for more than one replica (it must
  // outlive the cluster); ignored for one.
  LiveCluster(std::vector<std::unique_ptr<LiveEngine>> replicas, Router* router);
  ~LiveCluster();  // each replica aborts what it holds, if no shutdown was asked
  LiveCluster(const LiveCluster&) = delete;
  LiveCluster& operator=(const LiveCluster&) = delete;

  // Any thread. Routed now; the answer is the chosen replica's (queue_full: its queue is full),
  // or failed when the router throws or names no replica (the reason says which).
  SubmitResult submit(WorkloadRequest request, LiveCallbacks callbacks);
  // Any thread; nothing for an id never given or already ended.
  void cancel(RequestId id);
  // Stops taking requests, then every replica drains or aborts what it holds (at once: each on
  // its own thread); the counts are summed.
  ShutdownReport shutdown(bool drain);
  // After shutdown: every replica's run (requests by its own ids) and the routes, one per
  // cluster id. Throws kvlab::Error before the shutdown.
  ClusterResult take_result();

  std::size_t size() const { return replicas_.size(); }
  // Any thread: the replicas' counters summed (KV capacity and use too: the cluster's pool).
  LiveStats stats() const;
  LiveStats replica_stats(std::size_t replica) const;
  // The first replica's fault, or "".
  std::string fault() const;

 private:
  std::vector<std::unique_ptr<LiveEngine>> replicas_;
  Router* router_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();

  mutable std::mutex mutex_;         // orders the routes; guards what follows
  std::vector<RouteRecord> routes_;  // by the cluster's id
  bool stopping_ = false;
};

// The sum of two replicas' KV counters (capacity and use included).
KvAllocatorStats operator+(const KvAllocatorStats& a, const KvAllocatorStats& b);

}  // namespace kvlab
