#include "kvlab/engine/live_cluster.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <future>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// The replica's callbacks, ending with the cluster's id instead of the replica's.
LiveCallbacks with_cluster_id(LiveCallbacks callbacks, RequestId id) {
  if (callbacks.on_done)
    callbacks.on_done = [done = std::move(callbacks.on_done), id](const LiveOutcome& local) {
      LiveOutcome outcome = local;
      outcome.id = id;
      done(outcome);
    };
  return callbacks;
}

LiveStats& operator+=(LiveStats& a, const LiveStats& b) {
  a.steps += b.steps;
  a.queued += b.queued;
  a.waiting += b.waiting;
  a.running += b.running;
  a.prefill_tokens += b.prefill_tokens;
  a.decode_tokens += b.decode_tokens;
  a.preemptions += b.preemptions;
  a.swap_bytes += b.swap_bytes;
  a.finished += b.finished;
  a.cancelled += b.cancelled;
  a.rejected += b.rejected;
  a.kv = a.kv + b.kv;
  return a;
}

}  // namespace

KvAllocatorStats operator+(const KvAllocatorStats& a, const KvAllocatorStats& b) {
  KvAllocatorStats s = a;
  s.capacity += b.capacity;
  s.used += b.used;
  s.reserved_unused += b.reserved_unused;
  s.last_block_slack += b.last_block_slack;
  s.free += b.free;
  s.unusable_free += b.unusable_free;
  s.cached_free += b.cached_free;
  s.bytes_copied += b.bytes_copied;
  s.prefix_query_tokens += b.prefix_query_tokens;
  s.prefix_hit_tokens += b.prefix_hit_tokens;
  s.evictions += b.evictions;
  s.live_sequences += b.live_sequences;
  s.host_hit_tokens += b.host_hit_tokens;
  s.disk_hit_tokens += b.disk_hit_tokens;
  s.host_bytes_stored += b.host_bytes_stored;
  s.host_bytes_loaded += b.host_bytes_loaded;
  s.disk_bytes_stored += b.disk_bytes_stored;
  s.disk_bytes_loaded += b.disk_bytes_loaded;
  s.host_copies += b.host_copies;
  s.disk_copies += b.disk_copies;
  s.tier_dropped_blocks += b.tier_dropped_blocks;
  s.tier_copy_seconds += b.tier_copy_seconds;
  return s;
}

LiveCluster::LiveCluster(std::vector<std::unique_ptr<LiveEngine>> replicas, Router* router)
    : replicas_(std::move(replicas)), router_(router) {
  if (replicas_.empty()) throw Error("a live cluster needs at least one replica");
  if (replicas_.size() > 1 && router_ == nullptr)
    throw Error(fmt::format("a live cluster of {} replicas needs a router", replicas_.size()));
}

LiveCluster::~LiveCluster() {
  (void)shutdown(false);
}

SubmitResult LiveCluster::submit(WorkloadRequest request, LiveCallbacks callbacks) {
  std::lock_guard lock(mutex_);
  if (stopping_) return {SubmitStatus::shutting_down, -1, {}};
  const auto id = static_cast<RequestId>(routes_.size());
  RouteRecord route;
  route.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (replicas_.size() > 1) {
    std::vector<ReplicaLoad> loads;
    for (const auto& replica : replicas_) loads.push_back(replica->load());
    RouteRequest r{id, route.time_s, request.prompt, request.output_tokens, request.priority};
    try {
      RouteDecision decision = router_->route(r, loads);
      route.replica = decision.replica;
      route.reason = std::move(decision.reason);
    } catch (const std::exception& e) {
      return {SubmitStatus::failed, -1, fmt::format("the router failed: {}", e.what())};
    }
    if (route.replica >= replicas_.size())
      return {SubmitStatus::failed, -1,
              fmt::format("the router chose replica {} of {}", route.replica, replicas_.size())};
  }
  const SubmitResult local = replicas_[route.replica]->submit(
      std::move(request), with_cluster_id(std::move(callbacks), id));
  if (local.status != SubmitStatus::accepted) return local;
  route.id_in_replica = local.id;
  routes_.push_back(std::move(route));
  return {SubmitStatus::accepted, id, {}};
}

void LiveCluster::cancel(RequestId id) {
  RouteRecord route;
  {
    std::lock_guard lock(mutex_);
    if (id < 0 || static_cast<std::size_t>(id) >= routes_.size()) return;
    route = routes_[static_cast<std::size_t>(id)];
  }
  replicas_[route.replica]->cancel(route.id_in_replica);
}

ShutdownReport LiveCluster::shutdown(bool drain) {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  // All at once, so a request that ends on one replica while another drains counts as drained.
  std::vector<std::future<ShutdownReport>> ends;
  for (const auto& replica : replicas_)
    ends.push_back(
        std::async(std::launch::async, [&replica, drain] { return replica->shutdown(drain); }));
  ShutdownReport report;
  for (auto& end : ends) {
    const ShutdownReport r = end.get();
    report.drained += r.drained;
    report.aborted += r.aborted;
  }
  return report;
}

ClusterResult LiveCluster::take_result() {
  ClusterResult result;
  for (const auto& replica : replicas_) {
    result.replicas.push_back(replica->take_result());
    result.duration_s = std::max(result.duration_s, result.replicas.back().duration_s);
  }
  std::lock_guard lock(mutex_);
  result.routes = routes_;
  return result;
}

LiveStats LiveCluster::stats() const {
  LiveStats sum;
  for (const auto& replica : replicas_) sum += replica->stats();
  return sum;
}

LiveStats LiveCluster::replica_stats(std::size_t replica) const {
  return replicas_.at(replica)->stats();
}

std::string LiveCluster::fault() const {
  for (const auto& replica : replicas_)
    if (std::string f = replica->fault(); !f.empty()) return f;
  return {};
}

}  // namespace kvlab
