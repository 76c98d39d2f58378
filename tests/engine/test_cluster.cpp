// A cluster of simulated replicas behind the shipped routers: every request served once, routes
// that follow each router's rule, deterministic runs.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>

#include "kvlab/engine/cluster.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/workload/workload.hpp"
#include "plugin_registry.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

// One simulated Llama-2-7B replica on an H200 profile: pool, plugins, backend, engine.
struct Replica {
  Replica(const ModelConfig& model, const CostModel& cost, std::int64_t slots)
      : pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, slots},
             KvStorage::none),
        backend(model.vocab_size, model.eos_token_ids) {
    PluginContext context;
    context.pool = &pool;
    context.model = &model;
    context.max_seq_len = model.max_position_embeddings;
    allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
        "paged", {{"block_size", std::int64_t{16}}, {"prefix_caching", true}}, context);
    scheduler = test::plugin_registry().create<PluginKind::scheduler>("fcfs", {}, context);
    EngineOptions options;
    options.rules.context = model.max_position_embeddings;
    options.rules.eos_token_ids = model.eos_token_ids;
    options.pool = &pool;
    options.cost_model = &cost;
    engine = std::make_unique<Engine>(backend, *allocator, *scheduler, options);
  }
  KvPool pool;
  SimulatedBackend backend;
  PluginObject<KvAllocator> allocator;
  PluginObject<Scheduler> scheduler;
  std::unique_ptr<Engine> engine;
};

struct Cluster {
  explicit Cluster(std::size_t n, std::int64_t slots = 1 << 16)
      : model(model_preset("llama2-7b")), cost(model, load_hardware_profile("h200")) {
    for (std::size_t i = 0; i < n; ++i)
      replicas.push_back(std::make_unique<Replica>(model, cost, slots));
  }
  ClusterResult run(Router& router, const std::vector<WorkloadRequest>& requests, int threads = 1) {
    std::vector<Engine*> engines;
    for (auto& r : replicas) engines.push_back(r->engine.get());
    return run_cluster(engines, router, requests, threads);
  }
  ModelConfig model;
  CostModel cost;
  std::vector<std::unique_ptr<Replica>> replicas;
};

std::vector<WorkloadRequest> workload(std::int64_t n, std::int64_t prefix_groups = 0) {
  SyntheticWorkload spec;
  spec.requests = n;
  spec.seed = 5;
  spec.arrival = {ArrivalKind::poisson, 40.0, 1.0, 1};
  spec.prompt_tokens = {.kind = LengthKind::uniform, .min = 64, .max = 512};
  spec.output_tokens = {.kind = LengthKind::uniform, .min = 8, .max = 256};
  spec.prefix_groups = prefix_groups;
  spec.prefix_tokens = prefix_groups > 0 ? 48 : 0;
  return generate_workload(spec);
}

PluginObject<Router> router(const std::string& name,
                            std::map<std::string, ParamValue, std::less<>> params = {}) {
  return test::plugin_registry().create<PluginKind::router>(name, params, PluginContext{});
}

TEST(Cluster, RoundRobinServesEveryRequestOnceInTurn) {
  Cluster cluster(3);
  const auto requests = workload(60);
  auto rr = router("round_robin");
  const ClusterResult result = cluster.run(*rr, requests);
  ASSERT_EQ(result.replicas.size(), 3u);
  ASSERT_EQ(result.routes.size(), requests.size());
  std::vector<std::size_t> served(3, 0);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(result.routes[i].replica, i % 3) << i;  // Poisson arrivals are in index order
    ++served[result.routes[i].replica];
  }
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(result.replicas[r].requests.size(), served[r]);
  const auto timelines = cluster_timelines(result);
  ASSERT_EQ(timelines.size(), requests.size());
  for (std::size_t i = 0; i < timelines.size(); ++i) {
    EXPECT_EQ(timelines[i].id, static_cast<RequestId>(i));
    EXPECT_FALSE(timelines[i].rejected) << timelines[i].reject_reason;
    EXPECT_DOUBLE_EQ(timelines[i].arrival_s, requests[i].arrival_s);
    ASSERT_TRUE(timelines[i].ttft_s() && timelines[i].finish_s) << i;
    EXPECT_GT(*timelines[i].ttft_s(), 0);
    EXPECT_GT(*timelines[i].finish_s, requests[i].arrival_s + *timelines[i].ttft_s());
    const auto& tokens = result.replicas[result.routes[i].replica]
                             .tokens[static_cast<std::size_t>(result.routes[i].id_in_replica)];
    EXPECT_EQ(static_cast<std::int64_t>(tokens.size()), requests[i].output_tokens) << i;
  }
  double latest = 0;
  for (const auto& t : timelines) latest = std::max(latest, *t.finish_s);
  EXPECT_DOUBLE_EQ(result.duration_s, latest);
}

TEST(Cluster, RunsAreDeterministic) {
  const auto requests = workload(40, 4);
  Cluster a(2), b(2);
  auto ra = router("prefix_affinity"), rb = router("prefix_affinity");
  const ClusterResult x = a.run(*ra, requests), y = b.run(*rb, requests);
  ASSERT_EQ(x.routes.size(), y.routes.size());
  for (std::size_t i = 0; i < x.routes.size(); ++i) {
    EXPECT_EQ(x.routes[i].replica, y.routes[i].replica);
    EXPECT_EQ(x.routes[i].reason, y.routes[i].reason);
  }
  EXPECT_EQ(x.duration_s, y.duration_s);
  EXPECT_EQ(x.replicas[0].events, y.replicas[0].events);
}

// Replicas stepped on 3 threads between arrivals run exactly as on one: the same routes, every
// replica's steps, events and tokens (bit-identical times: they share nothing but the router).
TEST(Cluster, ReplicasSteppedOnThreadsRunAsOnOne) {
  const auto requests = workload(120, 6);
  Cluster one(4), three(4);
  auto r1 = router("prefix_affinity"), r3 = router("prefix_affinity");
  const ClusterResult x = one.run(*r1, requests, 1), y = three.run(*r3, requests, 3);
  ASSERT_EQ(x.routes.size(), y.routes.size());
  for (std::size_t i = 0; i < x.routes.size(); ++i) {
    EXPECT_EQ(x.routes[i].replica, y.routes[i].replica) << i;
    EXPECT_EQ(x.routes[i].reason, y.routes[i].reason) << i;
  }
  EXPECT_EQ(x.duration_s, y.duration_s);
  std::set<std::size_t> used;
  for (const RouteRecord& r : x.routes) used.insert(r.replica);
  EXPECT_EQ(used.size(), 4u) << "every replica ran, so the threads had work to share";
  for (std::size_t r = 0; r < 4; ++r) {
    EXPECT_EQ(x.replicas[r].events, y.replicas[r].events) << r;
    EXPECT_EQ(x.replicas[r].tokens, y.replicas[r].tokens) << r;
    ASSERT_EQ(x.replicas[r].steps.size(), y.replicas[r].steps.size()) << r;
    for (std::size_t s = 0; s < x.replicas[r].steps.size(); ++s)
      ASSERT_EQ(x.replicas[r].steps[s].start_s, y.replicas[r].steps[s].start_s) << r << " " << s;
  }
}

// The merged run's steps are every replica's, in start order, each replica's in its own order.
TEST(Cluster, MergedStepsAreEveryReplicasInStartOrder) {
  const auto requests = workload(60, 3);
  Cluster cluster(3);
  auto rr = router("round_robin");
  ClusterResult result = cluster.run(*rr, requests, 2);
  std::vector<std::vector<std::int64_t>> per_replica(3);
  for (std::size_t r = 0; r < 3; ++r)
    for (const StepRecord& s : result.replicas[r].steps) per_replica[r].push_back(s.step);
  const EngineResult merged = merged_result(std::move(result));
  std::size_t total = 0;
  for (const auto& steps : per_replica) total += steps.size();
  ASSERT_EQ(merged.steps.size(), total);
  std::vector<std::vector<std::int64_t>> seen(3);
  for (std::size_t i = 0; i < merged.steps.size(); ++i) {
    if (i > 0) {
      EXPECT_LE(merged.steps[i - 1].start_s, merged.steps[i].start_s) << i;
    }
    seen[static_cast<std::size_t>(merged.steps[i].replica)].push_back(merged.steps[i].step);
  }
  EXPECT_EQ(seen, per_replica);
}

TEST(Cluster, PrefixAffinityKeepsEachSystemPromptOnOneReplica) {
  const auto requests = workload(80, 4);  // 4 groups sharing a 48-token system prompt
  Cluster cluster(4);
  auto affinity =
      router("prefix_affinity", {{"max_imbalance_tokens", std::int64_t{1000000000000}}});
  const ClusterResult result = cluster.run(*affinity, requests);
  std::map<std::int64_t, std::set<std::size_t>> replicas_of_group;
  for (std::size_t i = 0; i < requests.size(); ++i)
    replicas_of_group[requests[i].prefix_group].insert(result.routes[i].replica);
  ASSERT_EQ(replicas_of_group.size(), 4u);
  for (const auto& [group, replicas] : replicas_of_group)
    EXPECT_EQ(replicas.size(), 1u) << "group " << group;  // never split: no imbalance limit
  // The first of each group found no prefix; the others followed it.
  std::size_t followed = 0;
  for (const auto& route : result.routes)
    followed += route.reason.rfind("prefix affinity:", 0) == 0 ? 1 : 0;
  EXPECT_EQ(followed, requests.size() - 4);
}

TEST(Routers, LeastLoadedPicksTheSmallestLoadByItsMeasure) {
  std::vector<ReplicaLoad> loads(3);
  loads[0] = {.waiting = 1,
              .running = 4,
              .queued_tokens = 900,
              .queued_prefill_tokens = 500,
              .kv_used = 10,
              .kv_capacity = 100};
  loads[1] = {.waiting = 0,
              .running = 9,
              .queued_tokens = 300,
              .queued_prefill_tokens = 0,
              .kv_used = 80,
              .kv_capacity = 100};
  loads[2] = {.waiting = 2,
              .running = 1,
              .queued_tokens = 600,
              .queued_prefill_tokens = 400,
              .kv_used = 50,
              .kv_capacity = 100};
  const RouteRequest request;
  auto by = [&](const char* measure) {
    return router("least_loaded", {{"by", std::string(measure)}})->route(request, loads).replica;
  };
  EXPECT_EQ(router("least_loaded")->route(request, loads).replica, 1u);  // prefill tokens
  EXPECT_EQ(by("queued_tokens"), 1u);
  EXPECT_EQ(by("kv"), 0u);
  EXPECT_EQ(by("requests"), 2u);
  loads[1].queued_prefill_tokens = 400;  // ties with replica 2: ties go round
  auto tied = router("least_loaded");
  EXPECT_EQ(tied->route(request, loads).replica, 1u);
  EXPECT_EQ(tied->route(request, loads).replica, 2u);
  EXPECT_EQ(tied->route(request, loads).replica, 1u);
  const std::vector<ReplicaLoad> idle(4);  // all equal: round robin, not a pile on replica 0
  auto spread = router("least_loaded");
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(spread->route(request, idle).replica, i % 4);
  test::expect_error_containing(
      [&] {
        router("least_loaded", {{"by", std::string("gpu")}});
      },
      {"by = \"gpu\"", "prefill_tokens"});
}

TEST(Routers, PrefixAffinityYieldsToTheLeastLoadedBeyondItsImbalance) {
  auto affinity = router("prefix_affinity", {{"max_imbalance_tokens", std::int64_t{100}},
                                             {"block_size", std::int64_t{4}}});
  const std::vector<std::int32_t> prompt{1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<ReplicaLoad> loads(2);
  loads[1].queued_tokens = 50;
  RouteRequest request;
  request.prompt = prompt;
  const RouteDecision first = affinity->route(request, loads);  // no prefix yet: least loaded
  EXPECT_EQ(first.replica, 0u);
  loads[0].queued_tokens = 140;  // 90 more than replica 1: within 100, the prefix wins
  EXPECT_EQ(affinity->route(request, loads).replica, 0u);
  loads[0].queued_tokens = 151;  // 101 more: too far, least loaded
  const RouteDecision yielded = affinity->route(request, loads);
  EXPECT_EQ(yielded.replica, 1u);
  EXPECT_NE(yielded.reason.find("least loaded"), std::string::npos) << yielded.reason;
}

// A system prompt every conversation shares, sent to every replica in turn, does not end a
// conversation's run: its next turn goes back to the replica that holds the rest of its prefix
// (the router keeps every replica a block was sent to, not only the last).
TEST(Routers, PrefixAffinityFollowsAConversationPastASharedSystemPrompt) {
  auto affinity = router("prefix_affinity", {{"max_imbalance_tokens", std::int64_t{1000}},
                                             {"block_size", std::int64_t{4}}});
  std::vector<ReplicaLoad> loads(3);
  auto send = [&](std::vector<std::int32_t> prompt, std::size_t least_loaded) {
    for (std::size_t r = 0; r < loads.size(); ++r)
      loads[r].queued_tokens = r == least_loaded ? 0 : 10;
    RouteRequest request;
    request.prompt = prompt;
    return affinity->route(request, loads);
  };
  const std::vector<std::int32_t> system{7, 7, 7, 7};
  auto turn = [&](std::int32_t conversation, int turns) {
    std::vector<std::int32_t> prompt = system;
    for (int t = 0; t < turns; ++t)
      for (std::int32_t k = 0; k < 4; ++k) prompt.push_back(100 * conversation + 10 * t + k);
    return prompt;
  };
  EXPECT_EQ(send(turn(1, 1), 0).replica, 0u);  // the system prompt is new: least loaded
  EXPECT_EQ(send(turn(2, 1), 1).replica, 0u);  // it shares the system prompt with replica 0
  EXPECT_EQ(send(turn(3, 1), 2).replica, 0u);
  // Conversation 4 lands on replica 2 (the least loaded: no block of it anywhere but the shared
  // one, and replica 0 is busy beyond the imbalance).
  loads = std::vector<ReplicaLoad>(3);
  loads[0].queued_tokens = 5000;
  RouteRequest fourth;
  const auto first_turn = turn(4, 1);
  fourth.prompt = first_turn;
  ASSERT_EQ(affinity->route(fourth, loads).replica, 1u);
  // Conversation 5 goes to replica 2, the system prompt with it (0 and 1 are busy).
  loads[1].queued_tokens = 5000;
  RouteRequest fifth;
  const auto other = turn(5, 1);
  fifth.prompt = other;
  ASSERT_EQ(affinity->route(fifth, loads).replica, 2u);
  // Conversation 4's second turn follows it to replica 1, although replica 2 was sent the system
  // prompt last (a router keeping only the last replica of each block sends it to 2).
  const RouteDecision second = send(turn(4, 2), 2);
  EXPECT_EQ(second.replica, 1u);
  EXPECT_NE(second.reason.find("prefix affinity: 2 of 3 prompt blocks"), std::string::npos)
      << second.reason;
}

struct OutOfRange final : Router {
  RouteDecision route(const RouteRequest&, std::span<const ReplicaLoad> replicas) override {
    return {replicas.size(), "nowhere"};
  }
};

TEST(Cluster, ARouterNamingNoReplicaIsAnError) {
  Cluster cluster(2);
  OutOfRange bad;
  test::expect_error_containing([&] { cluster.run(bad, workload(3)); },
                                {"router sent request 0 to replica 2, but the cluster has 2"});
}

}  // namespace
}  // namespace kvlab
