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
  a.handed_off += b.handed_off;
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

// Where a disaggregated request is, and how it ended.
struct LiveCluster::Tracked {
  enum class Phase { prefill, transit, decode, done };
  Phase phase = Phase::prefill;
  Submission request;                     // what the decode replica is given (moved there)
  std::shared_ptr<LiveCallbacks> client;  // both sides' tokens; on_done once
  std::size_t replica = 0;                // where it is (prefill, then decode)
  RequestId local = -1;                   // its id there (-1 in transit)
  bool cancel_asked = false;
  bool at_shutdown = false;  // in flight when the shutdown began
  bool cancelled = false, rejected = false;
};

// A handoff crossing the link to decode replica `replica`, delivered at `due`.
struct LiveCluster::Transit {
  RequestId id = -1;
  std::size_t replica = 0;
  std::chrono::steady_clock::time_point due;
  KvHandoff handoff;
};

LiveCluster::LiveCluster(std::vector<std::unique_ptr<LiveEngine>> replicas, Router* router,
                         std::optional<LiveDisaggregation> split)
    : replicas_(std::move(replicas)), router_(router), split_(std::move(split)) {
  if (replicas_.empty()) throw Error("a live cluster needs at least one replica");
  if (replicas_.size() > 1 && router_ == nullptr)
    throw Error(fmt::format("a live cluster of {} replicas needs a router", replicas_.size()));
  if (!split_) return;
  if (split_->prefill_replicas < 1 || split_->prefill_replicas >= replicas_.size())
    throw Error(
        fmt::format("a disaggregated live cluster of {} replicas cannot have {} prefill "
                    "replicas: each side needs one",
                    replicas_.size(), split_->prefill_replicas));
  if (split_->decode_router == nullptr || !split_->transfer_seconds)
    throw Error("internal: a disaggregated live cluster needs a decode router and a link price");
  link_free_.assign(replicas_.size(), start_);
  link_thread_ = std::thread([this] { link_loop(); });
}

LiveCluster::~LiveCluster() {
  (void)shutdown(false);
}

// Routes among replicas [first, end) by their loads now; the replica (an index of replicas_), or
// nullopt with why_not when the router throws or names none of them.
std::optional<std::size_t> LiveCluster::route(std::size_t first, std::size_t end, Router& router,
                                              const RouteRequest& request, RouteRecord& record,
                                              std::string& why_not) {
  std::vector<ReplicaLoad> loads;
  for (std::size_t i = first; i < end; ++i) loads.push_back(replicas_[i]->load());
  try {
    RouteDecision decision = router.route(request, loads);
    if (decision.replica >= loads.size()) {
      why_not = fmt::format("the router chose replica {} of {}", decision.replica, loads.size());
      return std::nullopt;
    }
    record.replica = first + decision.replica;
    record.reason = std::move(decision.reason);
    return record.replica;
  } catch (const std::exception& e) {
    why_not = fmt::format("the router failed: {}", e.what());
    return std::nullopt;
  }
}

SubmitResult LiveCluster::submit(Submission request, LiveCallbacks callbacks) {
  if (split_) return submit_disaggregated(std::move(request), std::move(callbacks));
  std::lock_guard lock(mutex_);
  if (stopping_) return {SubmitStatus::shutting_down, -1, {}};
  const auto id = static_cast<RequestId>(routes_.size());
  RouteRecord route;
  route.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (replicas_.size() > 1) {
    const RouteRequest r{id, route.time_s, request.prompt, request.output_tokens, request.priority};
    std::string why_not;
    if (!this->route(0, replicas_.size(), *router_, r, route, why_not))
      return {SubmitStatus::failed, -1, std::move(why_not)};
  }
  const SubmitResult local = replicas_[route.replica]->submit(
      std::move(request), with_cluster_id(std::move(callbacks), id));
  if (local.status != SubmitStatus::accepted) return local;
  route.id_in_replica = local.id;
  routes_.push_back(std::move(route));
  return {SubmitStatus::accepted, id, {}};
}

void LiveCluster::cancel(RequestId id) {
  std::size_t replica = 0;
  RequestId local = -1;
  {
    std::lock_guard lock(mutex_);
    if (id < 0 || static_cast<std::size_t>(id) >= routes_.size()) return;
    if (!split_) {
      replica = routes_[static_cast<std::size_t>(id)].replica;
      local = routes_[static_cast<std::size_t>(id)].id_in_replica;
    } else {
      Tracked& t = *tracked_[static_cast<std::size_t>(id)];
      if (t.phase == Tracked::Phase::done || t.cancel_asked) return;
      t.cancel_asked = true;
      if (t.phase == Tracked::Phase::transit) {  // delivered now, and cancelled there
        for (Transit& transit : link_)
          if (transit.id == id) transit.due = std::chrono::steady_clock::now();
        link_wake_.notify_all();
        return;
      }
      replica = t.replica;
      local = t.local;
    }
  }
  replicas_[replica]->cancel(local);
}

ShutdownReport LiveCluster::shutdown(bool drain) {
  if (split_) return shutdown_disaggregated(drain);
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  return shutdown_side(0, replicas_.size(), drain);
}

// Replicas [first, end) drain or abort at once, so a request that ends on one while another
// drains counts as drained; their counts summed.
ShutdownReport LiveCluster::shutdown_side(std::size_t first, std::size_t end, bool drain) {
  std::vector<std::future<ShutdownReport>> ends;
  for (std::size_t i = first; i < end; ++i)
    ends.push_back(
        std::async(std::launch::async, [this, i, drain] { return replicas_[i]->shutdown(drain); }));
  ShutdownReport report;
  for (auto& e : ends) {
    const ShutdownReport r = e.get();
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
  if (split_) result.decode_routes = decode_routes_;
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

// --- disaggregated prefill and decode ---

SubmitResult LiveCluster::submit_disaggregated(Submission request, LiveCallbacks callbacks) {
  std::lock_guard lock(mutex_);
  if (stopping_) return {SubmitStatus::shutting_down, -1, {}};
  const auto id = static_cast<RequestId>(routes_.size());
  RouteRecord route;
  route.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const RouteRequest r{id, route.time_s, request.prompt, request.output_tokens, request.priority};
  std::string why_not;
  if (!this->route(0, split_->prefill_replicas, *router_, r, route, why_not))
    return {SubmitStatus::failed, -1, std::move(why_not)};
  auto tracked = std::make_unique<Tracked>();
  tracked->request = request;
  tracked->client = std::make_shared<LiveCallbacks>(std::move(callbacks));
  tracked->replica = route.replica;
  LiveCallbacks prefill;
  prefill.on_token = [client = tracked->client](std::int32_t token, const GeneratedLogprobs* lp) {
    if (client->on_token) client->on_token(token, lp);
  };
  prefill.on_done = [this, id](const LiveOutcome& outcome) { ended(id, outcome); };
  // Its callbacks wait for this lock: they find it tracked.
  const SubmitResult local = replicas_[route.replica]->submit_for_prefill(
      std::move(request), std::move(prefill),
      [this, id](KvHandoff&& handoff) { handed_off(id, std::move(handoff)); });
  if (local.status != SubmitStatus::accepted) return local;
  tracked->local = route.id_in_replica = local.id;
  routes_.push_back(std::move(route));
  decode_routes_.emplace_back();
  tracked_.push_back(std::move(tracked));
  return {SubmitStatus::accepted, id, {}};
}

// On the prefill replica's thread: the decode router picks a replica now; the KV is delivered to
// it when the transfer ends (after the earlier transfers of both replicas' links, when they
// contend). A decode router that fails ends the request, rejected with its reason.
void LiveCluster::handed_off(RequestId id, KvHandoff&& handoff) {
  std::shared_ptr<LiveCallbacks> client;
  std::string why_not;
  {
    std::lock_guard lock(mutex_);
    Tracked& t = *tracked_[static_cast<std::size_t>(id)];
    const auto now = std::chrono::steady_clock::now();
    RouteRecord route;
    route.kv_bytes = handoff.bytes;
    const RouteRequest r{id, std::chrono::duration<double>(now - start_).count(), t.request.prompt,
                         t.request.output_tokens, t.request.priority};
    if (this->route(split_->prefill_replicas, replicas_.size(), *split_->decode_router, r, route,
                    why_not)) {
      const auto price = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::duration<double>(
              split_->transfer_seconds(handoff.bytes, handoff.copy_out_s)));
      auto due = now + price;
      if (t.cancel_asked) {  // its client is gone: delivered now, cancelled there, no transfer
        due = now;
      } else if (split_->links_contend) {
        auto& from = link_free_[t.replica];
        auto& to = link_free_[route.replica];
        due = std::max({now, from, to}) + price;
        from = to = due;
      }
      route.time_s = std::chrono::duration<double>(due - start_).count();
      t.phase = Tracked::Phase::transit;
      t.replica = route.replica;
      t.local = -1;
      link_.push_back({id, route.replica, due, std::move(handoff)});
      decode_routes_[static_cast<std::size_t>(id)] = std::move(route);
      link_wake_.notify_all();
      return;
    }
    t.phase = Tracked::Phase::done;
    t.rejected = true;
    client = std::move(t.client);
  }
  if (client->on_done) client->on_done({id, {}, true, "the decode router: " + why_not});
}

// Either side's end of a request: recorded, then the client's on_done with the cluster's id.
void LiveCluster::ended(RequestId id, const LiveOutcome& local) {
  std::shared_ptr<LiveCallbacks> client;
  {
    std::lock_guard lock(mutex_);
    Tracked& t = *tracked_[static_cast<std::size_t>(id)];
    t.phase = Tracked::Phase::done;
    t.cancelled = local.finish_reason == "cancelled";
    t.rejected = local.rejected;
    // Released here, on the engine thread, as a LiveEngine releases its callbacks: what they hold
    // (a server's connection) must not outlive the server.
    client = std::move(t.client);
  }
  LiveOutcome outcome = local;
  outcome.id = id;
  if (client->on_done) client->on_done(outcome);
}

// The link's thread: each handoff submitted to its decode replica when its transfer ends. Ends
// when asked to and nothing is left on the link.
void LiveCluster::link_loop() {
  std::vector<Transit> due;
  while (take_due(due)) {
    for (Transit& transit : due) deliver(transit);
  }
}

bool LiveCluster::take_due(std::vector<Transit>& due) {
  due.clear();
  std::unique_lock lock(mutex_);
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    auto next = std::chrono::steady_clock::time_point::max();
    for (std::size_t i = 0; i < link_.size();) {
      if (link_[i].due <= now) {
        due.push_back(std::move(link_[i]));
        link_.erase(link_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        next = std::min(next, link_[i].due);
        ++i;
      }
    }
    if (!due.empty()) return true;
    if (link_stop_ && link_.empty()) return false;
    if (link_.empty())
      link_wake_.wait(lock);
    else
      link_wake_.wait_until(lock, next);
  }
}

// On the link's thread: the request arrives at its decode replica with its KV, its tokens
// streaming to the client from there; cancelled there at once if its client already went.
void LiveCluster::deliver(Transit& transit) {
  std::shared_ptr<LiveCallbacks> client;
  Submission request;
  bool gone = false;  // its client went while it crossed
  {
    std::lock_guard lock(mutex_);
    Tracked& t = *tracked_[static_cast<std::size_t>(transit.id)];
    client = t.client;
    request = std::move(t.request);  // the decode replica is its last reader
    gone = t.cancel_asked;
  }
  const RequestId id = transit.id;
  LiveCallbacks decode;
  decode.on_token = [client](std::int32_t token, const GeneratedLogprobs* lp) {
    if (client->on_token) client->on_token(token, lp);
  };
  decode.on_done = [this, id](const LiveOutcome& outcome) { ended(id, outcome); };
  const SubmitResult r = replicas_[transit.replica]->submit_with_kv(
      std::move(request), std::move(transit.handoff), std::move(decode), gone);
  bool cancel = false;
  {
    std::lock_guard lock(mutex_);
    Tracked& t = *tracked_[static_cast<std::size_t>(id)];
    if (r.status == SubmitStatus::accepted) {
      t.local = r.id;
      decode_routes_[static_cast<std::size_t>(id)]->id_in_replica = r.id;
      if (t.phase == Tracked::Phase::transit) t.phase = Tracked::Phase::decode;
      cancel = t.cancel_asked && !gone;  // asked while it was being submitted
    } else {
      t.phase = Tracked::Phase::done;  // the decode replica stopped first: not this cluster's order
      t.rejected = true;
      t.client.reset();
      decode_routes_[static_cast<std::size_t>(id)].reset();
    }
  }
  if (r.status != SubmitStatus::accepted && client->on_done)
    client->on_done({id, {}, true, "the decode replica was shutting down"});
  if (cancel) replicas_[transit.replica]->cancel(r.id);
}

// The prefill replicas drain or abort first (handing off what they finish), then the link
// delivers what it holds (at once, cancelled, when aborting), then the decode replicas drain or
// abort. Each request in flight at the start counts once, by how it ended.
ShutdownReport LiveCluster::shutdown_disaggregated(bool drain) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return {};
    stopping_ = true;
    for (const auto& t : tracked_) t->at_shutdown = t->phase != Tracked::Phase::done;
  }
  (void)shutdown_side(0, split_->prefill_replicas, drain);
  {
    std::lock_guard lock(mutex_);
    if (!drain)
      for (Transit& transit : link_) {
        transit.due = std::chrono::steady_clock::now();
        tracked_[static_cast<std::size_t>(transit.id)]->cancel_asked = true;
      }
    link_stop_ = true;
    link_wake_.notify_all();
  }
  if (link_thread_.joinable()) link_thread_.join();
  (void)shutdown_side(split_->prefill_replicas, replicas_.size(), drain);
  ShutdownReport report;
  std::lock_guard lock(mutex_);
  for (const auto& t : tracked_)
    if (t->at_shutdown && !t->rejected) ++(t->cancelled ? report.aborted : report.drained);
  return report;
}

}  // namespace kvlab
