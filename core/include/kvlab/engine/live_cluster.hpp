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
//
// Disaggregated (LiveDisaggregation: [cluster] prefill_replicas): the first replicas only
// prefill. A request is routed among them at submission; its first token streams from there;
// when its KV is handed off, the decode router picks a decode replica by their loads then, the
// KV crosses the link (transfer_seconds, on the wall clock: the link thread submits it to the
// decode replica when the transfer ends, after the links' earlier transfers when they contend)
// and the rest of its tokens stream from the decode replica, to the same callbacks.
//
//   prefill replica's thread: on_handoff -> decode router -> the link's queue (due time)
//   link thread: at the due time, submit_with_kv on the decode replica
//   cancel: wherever the request is: its prefill replica, the link (submitted at once and
//   cancelled there, so the record has it) or its decode replica
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvlab/engine/cluster.hpp"
#include "kvlab/engine/live_engine.hpp"
#include "kvlab/router.hpp"

namespace kvlab {

// A live cluster's split into prefill and decode replicas.
struct LiveDisaggregation {
  std::size_t prefill_replicas = 1;  // the first ones; the rest decode
  Router* decode_router = nullptr;   // must outlive the cluster
  // Seconds for `bytes` of KV to cross, given what copying them out took (Disaggregation's).
  std::function<double(std::int64_t bytes, double copy_out_s)> transfer_seconds;
  bool links_contend = true;  // a transfer waits for both replicas' links to be free
};

class LiveCluster {
 public:
  // `replicas`: not empty, each running. `router`: used for more than one replica (it must
  // outlive the cluster); ignored for one. With `split`, it routes among the prefill replicas.
  LiveCluster(std::vector<std::unique_ptr<LiveEngine>> replicas, Router* router,
              std::optional<LiveDisaggregation> split = std::nullopt);
  ~LiveCluster();  // each replica aborts what it holds, if no shutdown was asked
  LiveCluster(const LiveCluster&) = delete;
  LiveCluster& operator=(const LiveCluster&) = delete;

  // Any thread. Routed now; the answer is the chosen replica's (queue_full: its queue is full),
  // or failed when the router throws or names no replica (the reason says which).
  SubmitResult submit(Submission request, LiveCallbacks callbacks);
  // Any thread; nothing for an id never given or already ended.
  void cancel(RequestId id);
  // Stops taking requests, then every replica drains or aborts what it holds (at once: each on
  // its own thread); the counts are summed. Disaggregated: the prefill replicas first, then the
  // link, then the decode replicas; a request counts once, where it ended.
  ShutdownReport shutdown(bool drain);
  // After shutdown: every replica's run (requests by its own ids) and the routes, one per
  // cluster id. Throws kvlab::Error before the shutdown.
  ClusterResult take_result();

  std::size_t size() const { return replicas_.size(); }
  // Any thread: the replicas' counters summed (KV capacity and use too: the cluster's pool).
  LiveStats stats() const;
  LiveStats replica_stats(std::size_t replica) const;
  // Any thread: the replica's latest steps for kvlab serve's /ui (LiveEngine::view_json).
  std::string replica_view_json(std::size_t replica, const std::string& name,
                                LiveViewDetail detail) const {
    return replicas_.at(replica)->view_json(name, detail);
  }
  // The first replica's fault, or "".
  std::string fault() const;

 private:
  struct Tracked;  // a disaggregated request: where it is
  struct Transit;  // a handoff on the link
  std::optional<std::size_t> route(std::size_t first, std::size_t end, Router& router,
                                   const RouteRequest& request, RouteRecord& record,
                                   std::string& why_not);
  SubmitResult submit_disaggregated(Submission request, LiveCallbacks callbacks);
  void handed_off(RequestId id, KvHandoff&& handoff);
  void ended(RequestId id, const LiveOutcome& outcome);
  void link_loop();
  bool take_due(std::vector<Transit>& due);
  void deliver(Transit& transit);
  ShutdownReport shutdown_disaggregated(bool drain);
  ShutdownReport shutdown_side(std::size_t first, std::size_t end, bool drain);

  std::vector<std::unique_ptr<LiveEngine>> replicas_;
  Router* router_;
  std::optional<LiveDisaggregation> split_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();

  mutable std::mutex mutex_;         // orders the routes; guards what follows
  std::vector<RouteRecord> routes_;  // by the cluster's id
  bool stopping_ = false;
  // Disaggregated only:
  std::vector<std::optional<RouteRecord>> decode_routes_;         // by the cluster's id
  std::vector<std::unique_ptr<Tracked>> tracked_;                 // by the cluster's id
  std::vector<Transit> link_;                                     // handoffs not yet delivered
  std::vector<std::chrono::steady_clock::time_point> link_free_;  // per replica
  std::condition_variable link_wake_;
  bool link_stop_ = false;
  std::thread link_thread_;  // last
};

// The sum of two replicas' KV counters (capacity and use included).
KvAllocatorStats operator+(const KvAllocatorStats& a, const KvAllocatorStats& b);

}  // namespace kvlab
