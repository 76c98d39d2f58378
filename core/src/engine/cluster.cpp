#include "kvlab/engine/cluster.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <limits>
#include <numeric>
#include <queue>

#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"
#include "replica_stepper.hpp"

namespace kvlab {
namespace {

// A replica starts with no request (the router hands them over) and room for its share of the
// workload's steps.
void start_replica(Engine& engine, const std::vector<Submission>& requests, std::size_t replicas) {
  static const std::vector<Submission> kNone;
  engine.start(kNone);
  engine.reserve_steps(expected_steps(requests) / static_cast<std::int64_t>(replicas));
}

// The busy replica whose clock is furthest behind, or nullptr when none has work.
Engine* furthest_behind(std::span<Engine* const> replicas) {
  Engine* behind = nullptr;
  for (Engine* e : replicas)
    if (e->has_work() && (behind == nullptr || e->now() < behind->now())) behind = e;
  return behind;
}

RouteRecord route_one(std::span<Engine* const> replicas, Router& router, const Submission& w,
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

std::vector<std::size_t> arrival_order(const std::vector<Submission>& requests) {
  std::vector<std::size_t> order(requests.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return requests[a].arrival_s < requests[b].arrival_s;
  });
  return order;
}

// A handoff waiting for its decode route (at the time its prefill replica handed it off).
struct PendingHandoff {
  double time_s = 0;
  std::size_t index = 0;  // in the workload
  KvHandoff handoff;
  bool operator>(const PendingHandoff& other) const {
    return time_s > other.time_s || (time_s == other.time_s && index > other.index);
  }
};

// The disaggregated cluster's run: the engines of both sides, the handoffs in time order.
class DisaggregatedRun {
 public:
  DisaggregatedRun(const Disaggregation& c, const std::vector<Submission>& requests)
      : c_(c), requests_(requests), order_(arrival_order(requests)) {
    engines_.assign(c.prefill.begin(), c.prefill.end());
    engines_.insert(engines_.end(), c.decode.begin(), c.decode.end());
    local_to_index_.resize(c.prefill.size());
    link_free_.assign(engines_.size(), 0.0);
    result_.routes.resize(requests.size());
    result_.decode_routes.resize(requests.size());
  }

  ClusterResult run() {
    for (Engine* e : engines_) start_replica(*e, requests_, engines_.size());
    while (true) {
      const double arrival = next_ < order_.size() ? requests_[order_[next_]].arrival_s
                                                   : std::numeric_limits<double>::infinity();
      const double handoff =
          pending_.empty() ? std::numeric_limits<double>::infinity() : pending_.top().time_s;
      const double event = std::min(arrival, handoff);
      if (Engine* behind = furthest_behind(engines_); behind != nullptr && behind->now() < event) {
        step(*behind);
        continue;
      }
      if (next_ == order_.size() && pending_.empty()) break;
      if (arrival <= handoff)
        route_prefill(order_[next_++]);
      else
        route_decode();
    }
    for (Engine* e : engines_) {
      result_.duration_s = std::max(result_.duration_s, e->now());
      result_.replicas.push_back(e->take_result());
    }
    return std::move(result_);
  }

 private:
  void step(Engine& engine) {
    (void)engine.step();
    const auto prefill = static_cast<std::size_t>(
        std::find(c_.prefill.begin(), c_.prefill.end(), &engine) - c_.prefill.begin());
    if (prefill == c_.prefill.size()) return;
    for (KvHandoff& h : engine.take_handoffs()) {
      const std::size_t index = local_to_index_[prefill].at(static_cast<std::size_t>(h.id));
      pending_.push({h.time_s, index, std::move(h)});
    }
  }
  void route_prefill(std::size_t index) {
    const Submission& w = requests_[index];
    const RouteRecord route =
        route_to(c_.prefill, *c_.prefill_router, w, index, w.arrival_s,
                 [&](Engine& e, std::size_t) { return e.submit_for_prefill(w); });
    local_to_index_[route.replica].push_back(index);
    result_.routes[index] = route;
  }
  // At its handoff the decode replica is chosen; the request arrives there when the KV has crossed.
  void route_decode() {
    PendingHandoff p = std::move(const_cast<PendingHandoff&>(pending_.top()));
    pending_.pop();
    Submission& w = decode_requests_.emplace_back(requests_[p.index]);
    const double price = c_.transfer_seconds(p.handoff.bytes, p.handoff.copy_out_s);
    const std::int64_t bytes = p.handoff.bytes;
    RouteRecord route = route_to(c_.decode, *c_.decode_router, w, p.index, p.time_s,
                                 [&](Engine& e, std::size_t replica) {
                                   w.arrival_s = transfer_end(p, replica, price);
                                   return e.submit_with_kv(w, std::move(p.handoff));
                                 });
    route.replica += c_.prefill.size();
    route.time_s = w.arrival_s;
    route.kv_bytes = bytes;
    result_.decode_routes[p.index] = route;
  }
  template <typename Submit>
  RouteRecord route_to(std::span<Engine* const> side, Router& router, const Submission& w,
                       std::size_t index, double time_s, Submit&& submit) {
    std::vector<ReplicaLoad> loads;
    loads.reserve(side.size());
    for (const Engine* e : side) loads.push_back(e->load());
    const auto i = static_cast<std::int64_t>(index);
    const RouteDecision d = plugin_call(
        "the router", i,
        [&] {
          return router.route({i, time_s, w.prompt, w.output_tokens, w.priority}, loads);
        },
        "request");
    if (d.replica >= side.size())
      throw Error(fmt::format("router sent request {} to replica {}, but that side has {}", index,
                              d.replica, side.size()));
    return {d.replica, submit(*side[d.replica], d.replica), time_s, d.reason};
  }
  // When a handoff's KV has crossed to decode replica `replica`: `price` after both links are
  // free (links_contend), else after its handoff.
  double transfer_end(const PendingHandoff& p, std::size_t replica, double price) {
    if (!c_.links_contend) return p.time_s + price;
    double& from = link_free_[result_.routes[p.index].replica];
    double& to = link_free_[c_.prefill.size() + replica];
    const double end = std::max({p.time_s, from, to}) + price;
    from = to = end;
    return end;
  }

  const Disaggregation& c_;
  const std::vector<Submission>& requests_;
  std::vector<std::size_t> order_;
  std::size_t next_ = 0;
  std::vector<Engine*> engines_;
  std::vector<std::vector<std::size_t>> local_to_index_;  // per prefill replica: local id -> index
  std::priority_queue<PendingHandoff, std::vector<PendingHandoff>, std::greater<>> pending_;
  std::deque<Submission> decode_requests_;  // outlive the run (engines keep pointers)
  std::vector<double> link_free_;           // by engine (prefill, then decode): its link busy until
  ClusterResult result_;
};

}  // namespace

ClusterResult run_disaggregated(const Disaggregation& cluster,
                                const std::vector<Submission>& requests) {
  if (cluster.prefill.empty() || cluster.decode.empty())
    throw Error("a disaggregated cluster needs at least one prefill and one decode replica");
  if (cluster.prefill_router == nullptr || cluster.decode_router == nullptr ||
      !cluster.transfer_seconds)
    throw Error("internal: a disaggregated cluster needs both routers and a transfer price");
  return DisaggregatedRun(cluster, requests).run();
}

ClusterResult run_cluster(std::span<Engine* const> replicas, Router& router,
                          const std::vector<Submission>& requests, int threads) {
  if (replicas.empty()) throw Error("a cluster needs at least one replica");
  for (Engine* e : replicas) start_replica(*e, requests, replicas.size());
  ClusterResult result;
  result.routes.resize(requests.size());
  {
    // Every replica reaches a request's arrival before the router sees their loads.
    ReplicaStepper stepper(replicas, threads);
    for (const std::size_t index : arrival_order(requests)) {
      stepper.advance_to(requests[index].arrival_s);
      result.routes[index] =
          route_one(replicas, router, requests[index], static_cast<std::int64_t>(index));
    }
    stepper.advance_to(std::numeric_limits<double>::infinity());
  }
  for (Engine* e : replicas) {
    result.duration_s = std::max(result.duration_s, e->now());
    result.replicas.push_back(e->take_result());
  }
  return result;
}

namespace {

// A disaggregated request's whole timeline: its prefill replica's (arrival, first scheduling,
// first token) and then its decode replica's (the KV's arrival, scheduling, the other tokens).
void add_decode_side(RequestTimeline& t, const RequestTimeline& d, std::int64_t bytes) {
  t.kv_transfer_bytes = bytes;
  t.kv_arrival_s = d.arrival_s;
  t.decode_scheduled_s = d.first_scheduled_s;
  t.token_times_s.insert(t.token_times_s.end(), d.token_times_s.begin(), d.token_times_s.end());
  t.finish_s = d.finish_s;
  t.finish_reason = d.finish_reason;
  t.rejected = d.rejected;
  t.reject_reason = d.reject_reason;
  t.preemptions += d.preemptions;
  t.recomputed_tokens += d.recomputed_tokens;
  t.swapped_bytes += d.swapped_bytes;
}

const RequestTimeline& local_timeline(const ClusterResult& result, const RouteRecord& route) {
  return result.replicas.at(route.replica)
      .requests.at(static_cast<std::size_t>(route.id_in_replica));
}

}  // namespace

std::vector<RequestTimeline> cluster_timelines(const ClusterResult& result) {
  std::vector<RequestTimeline> timelines;
  timelines.reserve(result.routes.size());
  for (std::size_t i = 0; i < result.routes.size(); ++i) {
    RequestTimeline t = local_timeline(result, result.routes[i]);
    if (i < result.decode_routes.size() && result.decode_routes[i])
      add_decode_side(t, local_timeline(result, *result.decode_routes[i]),
                      result.decode_routes[i]->kv_bytes);
    t.id = static_cast<RequestId>(i);
    timelines.push_back(std::move(t));
  }
  return timelines;
}

EngineResult merged_result(const ClusterResult& result) {
  ClusterResult copy = result;
  return merged_result(std::move(copy));
}

namespace {

bool starts_before(const StepRecord& a, const StepRecord& b) {
  return a.start_s < b.start_s;
}

// Steps from sorted runs, one a replica, merged (ties: the lower replica first).
std::vector<StepRecord> merge_sorted_steps(std::vector<EngineResult>& replicas, std::size_t total) {
  std::vector<StepRecord> merged;
  merged.reserve(total);
  std::vector<std::size_t> next(replicas.size(), 0);
  while (merged.size() < total) {
    std::size_t pick = replicas.size();
    for (std::size_t r = 0; r < replicas.size(); ++r) {
      if (next[r] == replicas[r].steps.size()) continue;
      if (pick == replicas.size() ||
          starts_before(replicas[r].steps[next[r]], replicas[pick].steps[next[pick]]))
        pick = r;
    }
    merged.push_back(std::move(replicas[pick].steps[next[pick]++]));
  }
  return merged;
}

// Every replica's steps, tagged, in start order (ties: the lower replica first), moved out of
// the replicas. Each replica's steps are in start order already (its clock never goes back), so
// this is a k-way merge: no sort, and no second copy of millions of records.
std::vector<StepRecord> merge_steps(std::vector<EngineResult>& replicas) {
  std::size_t total = 0;
  bool runs_sorted = true;
  for (std::size_t r = 0; r < replicas.size(); ++r) {
    for (StepRecord& step : replicas[r].steps) step.replica = static_cast<std::int64_t>(r);
    total += replicas[r].steps.size();
    runs_sorted = runs_sorted &&
                  std::is_sorted(replicas[r].steps.begin(), replicas[r].steps.end(), starts_before);
  }
  std::vector<StepRecord> merged;
  if (runs_sorted) {
    merged = merge_sorted_steps(replicas, total);
  } else {  // the same order, the long way
    merged.reserve(total);
    for (EngineResult& replica : replicas)
      std::move(replica.steps.begin(), replica.steps.end(), std::back_inserter(merged));
    std::stable_sort(merged.begin(), merged.end(), starts_before);
  }
  for (EngineResult& replica : replicas) replica.steps = {};
  return merged;
}

// A replica's frame with the workload's request ids (its batch's, its runs' owners).
StepFrame global_frame(StepFrame frame, std::size_t replica, const std::vector<RequestId>& global) {
  const auto to_global = [&](RequestId id) {
    return id >= 0 && static_cast<std::size_t>(id) < global.size()
               ? global[static_cast<std::size_t>(id)]
               : id;
  };
  for (FrameEntry& e : frame.batch) e.request = to_global(e.request);
  for (KvSlotRun& run : frame.pool.runs) run.owner = to_global(run.owner);
  frame.replica = static_cast<std::int64_t>(replica);
  return frame;
}

}  // namespace

EngineResult merged_result(ClusterResult&& result) {
  EngineResult merged;
  merged.requests = cluster_timelines(result);
  merged.duration_s = result.duration_s;
  std::vector<std::vector<RequestId>> global(result.replicas.size());  // local id -> workload
  for (std::size_t r = 0; r < result.replicas.size(); ++r)
    global[r].resize(result.replicas[r].requests.size());
  auto add_route = [&](const RouteRecord& route, std::size_t i) {
    global[route.replica][static_cast<std::size_t>(route.id_in_replica)] =
        static_cast<RequestId>(i);
    merged.events.push_back({-1, route.time_s, EventKind::event_route, static_cast<RequestId>(i),
                             route.reason, 0, static_cast<std::int64_t>(route.replica)});
  };
  for (std::size_t i = 0; i < result.routes.size(); ++i) {
    // The tokens of the replica that ran it last (a decode replica holds the first one too).
    const bool decoded = i < result.decode_routes.size() && result.decode_routes[i].has_value();
    const RouteRecord& last = decoded ? *result.decode_routes[i] : result.routes[i];
    const EngineResult& replica = result.replicas[last.replica];
    const auto local = static_cast<std::size_t>(last.id_in_replica);
    merged.tokens.push_back(replica.tokens[local]);
    std::vector<GeneratedLogprobs> logprobs;  // empty unless asked for
    if (decoded)
      logprobs = result.replicas[result.routes[i].replica].logprobs.at(
          static_cast<std::size_t>(result.routes[i].id_in_replica));
    const auto& rest = replica.logprobs.at(local);
    logprobs.insert(logprobs.end(), rest.begin(), rest.end());
    merged.logprobs.push_back(std::move(logprobs));
    add_route(result.routes[i], i);
    if (decoded) add_route(*result.decode_routes[i], i);
  }
  merged.steps = merge_steps(result.replicas);
  for (std::size_t r = 0; r < result.replicas.size(); ++r) {
    for (EngineEvent& event : result.replicas[r].events) {
      if (event.request >= 0) event.request = global[r][static_cast<std::size_t>(event.request)];
      event.replica = static_cast<std::int64_t>(r);
      merged.events.push_back(std::move(event));
    }
    for (StepFrame& frame : result.replicas[r].frames)  // replica by replica, in step order
      merged.frames.push_back(global_frame(std::move(frame), r, global[r]));
    merged.frame_stride = std::max(merged.frame_stride, result.replicas[r].frame_stride);
    for (VerifyRecord verify : result.replicas[r].verifies) {  // workload ids, replica by replica
      verify.request = global[r][static_cast<std::size_t>(verify.request)];
      merged.verifies.push_back(verify);
    }
  }
  std::stable_sort(merged.events.begin(), merged.events.end(),
                   [](const EngineEvent& a, const EngineEvent& b) { return a.t < b.t; });
  return merged;
}

}  // namespace kvlab
