// The engine under live traffic (LiveEngine): requests from several threads while steps run on the
// wall clock stream the tokens an offline run gives them and end exactly once; a cancel ends a
// request within a step; a full queue refuses instead of growing; a request that can never fit
// is rejected with the reason; a shutdown drains or aborts what is in flight and counts it; every
// request is in the run's record. Loops are bounded in count and time.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "cpu_reference/test_models.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/engine/live_cluster.hpp"
#include "kvlab/engine/live_engine.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/workload/workload.hpp"
#include "plugin_registry.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const cpu::LlamaWeights& live_weights() {
  static const cpu::LlamaWeights w = test::scaled_random_weights(model_preset("tiny"), 99);
  return w;
}

using Params = std::map<std::string, ParamValue, std::less<>>;

// The tiny model's serving stack: paged KV, fcfs (or `scheduler_name`) with `scheduler_params`,
// the cpu backend.
struct Stack {
  explicit Stack(Params scheduler_params = {}, const std::string& scheduler_name = "fcfs")
      : pool({live_weights().config.num_hidden_layers, live_weights().config.num_key_value_heads,
              live_weights().config.head_dim, 512}) {
    PluginContext context;
    context.pool = &pool;
    context.model = &live_weights().config;
    context.max_seq_len = 64;
    allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
        "paged", {{"block_size", std::int64_t{4}}}, context);
    scheduler = test::plugin_registry().create<PluginKind::scheduler>(
        scheduler_name, std::move(scheduler_params), context);
    backend = std::make_unique<cpu::CpuBackend>(live_weights(), pool, std::nullopt);
    options.rules.context = 64;
    options.rules.eos_token_ids = live_weights().config.eos_token_ids;
    options.pool = &pool;
  }
  KvPool pool;
  PluginObject<KvAllocator> allocator;
  PluginObject<Scheduler> scheduler;
  std::unique_ptr<cpu::CpuBackend> backend;
  EngineOptions options;
};

WorkloadRequest request(std::int32_t first_token, std::int64_t prompt, std::int64_t output) {
  WorkloadRequest r;
  for (std::int64_t i = 0; i < prompt; ++i)
    r.prompt.push_back(first_token + static_cast<std::int32_t>(i));
  r.output_tokens = output;
  r.sampling.ignore_eos = true;
  return r;
}

// What one request's callbacks saw.
struct Seen {
  std::mutex mutex;
  std::vector<std::int32_t> tokens;
  std::vector<LiveOutcome> ends;
  std::promise<void> done;
  LiveCallbacks callbacks() {
    return {[this](std::int32_t t, const GeneratedLogprobs*) {
              std::lock_guard lock(mutex);
              tokens.push_back(t);
            },
            [this](const LiveOutcome& o) {
              {
                std::lock_guard lock(mutex);
                ends.push_back(o);
              }
              if (ends.size() == 1) done.set_value();
            }};
  }
  bool wait(double seconds) {
    return done.get_future().wait_for(std::chrono::duration<double>(seconds)) ==
           std::future_status::ready;
  }
};

// The requests run offline on a Stack of their own (the steps clock): the tokens to expect.
EngineResult run_offline(const std::vector<WorkloadRequest>& requests) {
  Stack stack;
  stack.options.clock = EngineClock::steps;
  Engine engine(*stack.backend, *stack.allocator, *stack.scheduler, stack.options);
  return engine.run(requests);
}

TEST(LiveEngine, RequestsFromSeveralThreadsStreamTheOfflineTokensAndEndOnce) {
  std::vector<WorkloadRequest> requests;
  for (std::int32_t i = 0; i < 8; ++i) requests.push_back(request(5 + 3 * i, 6 + i, 10 + i));
  const EngineResult offline = run_offline(requests);
  Stack stack;
  LiveEngine live(*stack.backend, *stack.allocator, *stack.scheduler, stack.options);
  std::vector<Seen> seen(requests.size());
  std::vector<RequestId> ids(requests.size(), -1);
  std::vector<std::thread> clients;
  for (std::size_t t = 0; t < 4; ++t)  // 4 client threads, 2 requests each
    clients.emplace_back([&, t] {
      for (std::size_t i = t; i < requests.size(); i += 4) {
        const SubmitResult r = live.submit(requests[i], seen[i].callbacks());
        EXPECT_EQ(r.status, SubmitStatus::accepted);
        ids[i] = r.id;
      }
    });
  for (auto& c : clients) c.join();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(seen[i].wait(60)) << "request " << i << " did not end within 60 s";
    std::lock_guard lock(seen[i].mutex);
    ASSERT_EQ(seen[i].ends.size(), 1u) << i;
    EXPECT_EQ(seen[i].ends[0].id, ids[i]);
    EXPECT_EQ(seen[i].ends[0].finish_reason, "max_tokens") << i;
    EXPECT_EQ(seen[i].tokens, offline.tokens[i]) << "request " << i << ": greedy, as offline";
  }
  const ShutdownReport report = live.shutdown(true);
  EXPECT_EQ(report.drained + report.aborted, 0) << "nothing was in flight";
  const EngineResult result = live.take_result();
  ASSERT_EQ(result.requests.size(), requests.size()) << "every request in the record";
  for (std::size_t i = 0; i < requests.size(); ++i)
    EXPECT_EQ(result.tokens[static_cast<std::size_t>(ids[i])], offline.tokens[i]);
}

// The client goes away after its third token: no token comes after the step that streamed it,
// the request ends "cancelled", its KV is back in the pool.
TEST(LiveEngine, CancelEndsAStreamingRequestWithinAStep) {
  Stack stack;
  LiveEngine live(*stack.backend, *stack.allocator, *stack.scheduler, stack.options);
  Seen seen;
  std::atomic<RequestId> id = -1;
  std::atomic<int> tokens = 0;
  LiveCallbacks callbacks = seen.callbacks();
  callbacks.on_token = [&, record = callbacks.on_token](std::int32_t t,
                                                        const GeneratedLogprobs* logprobs) {
    record(t, logprobs);
    if (++tokens < 3) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (id < 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    live.cancel(id);  // from the engine thread, as a server's connection handler might
  };
  const SubmitResult r = live.submit(request(9, 8, 50), std::move(callbacks));
  ASSERT_EQ(r.status, SubmitStatus::accepted);
  id = r.id;
  ASSERT_TRUE(seen.wait(60));
  {
    std::lock_guard lock(seen.mutex);
    ASSERT_EQ(seen.ends.size(), 1u);
    EXPECT_EQ(seen.ends[0].finish_reason, "cancelled");
    EXPECT_EQ(seen.tokens.size(), 3u) << "the cancel took effect at the next step";
  }
  live.cancel(r.id);   // again, after its end: nothing
  live.cancel(12345);  // never given: nothing
  (void)live.shutdown(true);
  const EngineResult result = live.take_result();
  ASSERT_EQ(result.requests.size(), 1u);
  EXPECT_EQ(result.requests[0].finish_reason, "cancelled");
  EXPECT_EQ(stack.allocator->stats().used, 0) << "its KV is back in the pool";
}

// One request runs at a time (max_batch 1) and the queue holds 3: of 5 sent back to back at least
// one is refused; once the queue has room again a request is accepted. A prompt past the context is
// rejected with the engine's reason.
TEST(LiveEngine, AFullQueueRefusesAndARequestThatCannotFitIsRejected) {
  Stack stack({{"max_batch", std::int64_t{1}}});
  LiveOptions options;
  options.max_queued = 3;
  LiveEngine live(*stack.backend, *stack.allocator, *stack.scheduler, stack.options, options);
  std::vector<Seen> seen(5);
  std::int64_t accepted = 0, refused = 0;
  for (auto& s : seen) {  // back to back: a 40-token request takes far longer than these calls
    const SubmitResult r = live.submit(request(3, 6, 40), s.callbacks());
    accepted += r.status == SubmitStatus::accepted;
    refused += r.status == SubmitStatus::queue_full;
  }
  // Three fit the queue; a fourth only if the engine admitted the first meanwhile.
  EXPECT_EQ(accepted + refused, 5);
  EXPECT_GE(refused, 1) << "at most one runs: the fifth never fits the queue";
  EXPECT_GE(accepted, 3);
  for (std::size_t i = 0; i < static_cast<std::size_t>(accepted); ++i)
    ASSERT_TRUE(seen[i].wait(60));
  Seen later, too_long;
  EXPECT_EQ(live.submit(request(3, 6, 4), later.callbacks()).status, SubmitStatus::accepted)
      << "the queue has room again";
  EXPECT_EQ(live.submit(request(3, 60, 10), too_long.callbacks()).status, SubmitStatus::accepted);
  ASSERT_TRUE(later.wait(60));
  ASSERT_TRUE(too_long.wait(60));
  std::lock_guard lock(too_long.mutex);
  EXPECT_TRUE(too_long.ends[0].rejected);
  EXPECT_NE(too_long.ends[0].reject_reason.find("exceed the context of 64"), std::string::npos)
      << too_long.ends[0].reject_reason;
  EXPECT_TRUE(too_long.tokens.empty());
}

// Shutdown: an abort cancels what runs and what was still queued (every one ends, and is in the
// record); a drain lets them finish. After it, submissions are refused.
TEST(LiveEngine, ShutdownAbortsOrDrainsWhatIsInFlightAndCountsIt) {
  for (const bool drain : {false, true}) {
    Stack stack({{"max_batch", std::int64_t{2}}});
    LiveEngine live(*stack.backend, *stack.allocator, *stack.scheduler, stack.options);
    std::vector<Seen> seen(4);
    for (auto& s : seen)
      ASSERT_EQ(live.submit(request(4, 6, 40), s.callbacks()).status, SubmitStatus::accepted);
    const ShutdownReport report = live.shutdown(drain);
    EXPECT_EQ(report.drained + report.aborted, 4) << "drain " << drain;
    EXPECT_EQ(drain ? report.aborted : report.drained, 0) << "drain " << drain;
    for (auto& s : seen) {
      ASSERT_TRUE(s.wait(0)) << "ended before shutdown returned";
      EXPECT_EQ(s.ends.size(), 1u);
      EXPECT_EQ(s.ends[0].finish_reason, drain ? "max_tokens" : "cancelled");
    }
    Seen after;
    EXPECT_EQ(live.submit(request(4, 6, 4), after.callbacks()).status, SubmitStatus::shutting_down);
    const EngineResult result = live.take_result();
    EXPECT_EQ(result.requests.size(), 4u);
    EXPECT_EQ(stack.allocator->stats().used, 0);
  }
}

// A backend that holds every forward until armed, then fails its `fail_at`th (an engine-level
// fault: a device lost, NaN). Armed by the test after its submissions: a count alone raced them
// (on a loaded machine the engine thread reached the 5th forward before the third submission,
// which was then refused), and a fault armed late raced the other way (CI: the first request
// decoded all its tokens and finished before the test armed it).
class FailingBackend final : public Backend {
 public:
  FailingBackend(Backend& inner, int fail_at) : inner_(inner), fail_at_(fail_at) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    armed_.wait(false);
    if (++calls_ >= fail_at_) throw Error("the device fell off the bus");
    return inner_.forward(batch, choices);
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  void arm() {
    armed_ = true;
    armed_.notify_all();
  }

 private:
  Backend& inner_;
  int calls_ = 0, fail_at_;
  std::atomic<bool> armed_{false};
};

// An engine fault ends the loop, and still every request accepted ends once: rejected with the
// fault as its reason; later submissions are refused; fault() says what happened.
TEST(LiveEngine, AnEngineFaultEndsEveryRequestInFlightWithTheFault) {
  Stack stack({{"max_batch", std::int64_t{1}}});
  FailingBackend failing(*stack.backend, 5);
  LiveEngine live(failing, *stack.allocator, *stack.scheduler, stack.options);
  std::vector<Seen> seen(3);
  std::vector<SubmitStatus> statuses;
  for (auto& s : seen) statuses.push_back(live.submit(request(4, 6, 40), s.callbacks()).status);
  failing.arm();  // before any assertion: an unarmed backend would hold the engine's shutdown
  for (const SubmitStatus status : statuses) ASSERT_EQ(status, SubmitStatus::accepted);
  for (auto& s : seen) {
    ASSERT_TRUE(s.wait(60));
    std::lock_guard lock(s.mutex);
    ASSERT_EQ(s.ends.size(), 1u);
    EXPECT_TRUE(s.ends[0].rejected);
    EXPECT_NE(s.ends[0].reject_reason.find("the device fell off the bus"), std::string::npos)
        << s.ends[0].reject_reason;
  }
  EXPECT_NE(live.fault().find("the device fell off the bus"), std::string::npos) << live.fault();
  Seen after;
  EXPECT_EQ(live.submit(request(4, 6, 4), after.callbacks()).status, SubmitStatus::shutting_down);
  const ShutdownReport report = live.shutdown(true);
  EXPECT_EQ(report.drained + report.aborted, 0);
}

// A backend whose every forward takes at least 20 ms more (a replica that is busy for a while).
class SlowBackend final : public Backend {
 public:
  explicit SlowBackend(Backend& inner) : inner_(inner) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return inner_.forward(batch, choices);
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }

 private:
  Backend& inner_;
};

// A served cluster: a LiveEngine per replica (each its own Stack) behind a router plugin; `slow`:
// each replica's forwards take 20 ms more (its requests stay in flight for a while).
struct ClusterOf {
  ClusterOf(std::size_t n, const std::string& router_name, Params router_params = {},
            Params scheduler_params = {}, bool slow = false) {
    router = test::plugin_registry().create<PluginKind::router>(router_name,
                                                                std::move(router_params), {});
    std::vector<std::unique_ptr<LiveEngine>> engines;
    for (std::size_t r = 0; r < n; ++r) {
      stacks.push_back(std::make_unique<Stack>(scheduler_params));
      Stack& s = *stacks.back();
      Backend* backend = s.backend.get();
      if (slow) backend = slow_backends.emplace_back(std::make_unique<SlowBackend>(*backend)).get();
      engines.push_back(
          std::make_unique<LiveEngine>(*backend, *s.allocator, *s.scheduler, s.options));
    }
    live = std::make_unique<LiveCluster>(std::move(engines), router.get());
  }
  std::vector<std::unique_ptr<Stack>> stacks;
  std::vector<std::unique_ptr<SlowBackend>> slow_backends;
  PluginObject<Router> router;
  std::unique_ptr<LiveCluster> live;  // last: it stops before the stacks go
};

// Submits request i from client thread i % threads; the cluster's ids, by request.
std::vector<RequestId> submit_from_threads(LiveCluster& cluster,
                                           const std::vector<WorkloadRequest>& requests,
                                           std::vector<Seen>& seen, std::size_t threads) {
  std::vector<RequestId> ids(requests.size(), -1);
  std::vector<std::thread> clients;
  for (std::size_t t = 0; t < threads; ++t)
    clients.emplace_back([&, t] {
      for (std::size_t i = t; i < requests.size(); i += threads) {
        const SubmitResult r = cluster.submit(requests[i], seen[i].callbacks());
        EXPECT_EQ(r.status, SubmitStatus::accepted);
        ids[i] = r.id;
      }
    });
  for (auto& c : clients) c.join();
  return ids;
}

// Requests from several threads, round robin over 3 replicas: each streams the offline tokens and
// ends once with the cluster's id; the record routes every request once, 3 per replica, and the
// merged run holds them all with their tokens.
TEST(LiveCluster, RoutesEveryRequestOnceAndStreamsTheOfflineTokens) {
  std::vector<WorkloadRequest> requests;
  for (std::int32_t i = 0; i < 9; ++i) requests.push_back(request(5 + 3 * i, 6 + i, 8 + i));
  const EngineResult offline = run_offline(requests);
  ClusterOf cluster(3, "round_robin");
  std::vector<Seen> seen(requests.size());
  const std::vector<RequestId> ids = submit_from_threads(*cluster.live, requests, seen, 3);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(seen[i].wait(60)) << "request " << i;
    std::lock_guard lock(seen[i].mutex);
    ASSERT_EQ(seen[i].ends.size(), 1u) << i;
    EXPECT_EQ(seen[i].ends[0].id, ids[i]) << "the cluster's id, not the replica's";
    EXPECT_EQ(seen[i].tokens, offline.tokens[i]) << "request " << i;
  }
  EXPECT_EQ(cluster.live->stats().finished, 9);
  (void)cluster.live->shutdown(true);
  ClusterResult result = cluster.live->take_result();
  ASSERT_EQ(result.routes.size(), 9u);
  std::vector<int> per_replica(3, 0);
  for (const RouteRecord& route : result.routes) ++per_replica[route.replica];
  EXPECT_EQ(per_replica, (std::vector<int>{3, 3, 3}));
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(result.replicas[r].requests.size(), 3u);
  const EngineResult merged = merged_result(std::move(result));
  ASSERT_EQ(merged.requests.size(), 9u);
  for (std::size_t i = 0; i < requests.size(); ++i)
    EXPECT_EQ(merged.tokens[static_cast<std::size_t>(ids[i])], offline.tokens[i]);
}

// The router sees what each replica holds, submissions it has not taken yet included: by queued
// tokens, a long request on slow replica 0 (6 + 50 tokens, 20 ms a step) sends the next three
// short ones (6 + 4 each) to replica 1, where a router blind to them would alternate.
TEST(LiveCluster, TheRouterSeesSubmissionsNotYetTaken) {
  Stack a, b;
  SlowBackend slow(*a.backend);
  auto router = test::plugin_registry().create<PluginKind::router>(
      "least_loaded", {{"by", std::string("queued_tokens")}}, {});
  std::vector<std::unique_ptr<LiveEngine>> engines;
  engines.push_back(std::make_unique<LiveEngine>(slow, *a.allocator, *a.scheduler, a.options));
  engines.push_back(
      std::make_unique<LiveEngine>(*b.backend, *b.allocator, *b.scheduler, b.options));
  LiveCluster cluster(std::move(engines), router.get());
  std::vector<Seen> seen(4);
  ASSERT_EQ(cluster.submit(request(3, 6, 50), seen[0].callbacks()).status, SubmitStatus::accepted);
  for (std::size_t i = 1; i < 4; ++i)
    ASSERT_EQ(cluster.submit(request(3, 6, 4), seen[i].callbacks()).status, SubmitStatus::accepted);
  (void)cluster.shutdown(false);  // an abort: replica 0's 50 steps are not needed
  for (auto& s : seen) ASSERT_TRUE(s.wait(0));
  const ClusterResult result = cluster.take_result();
  std::vector<std::size_t> replicas;
  for (const RouteRecord& route : result.routes) replicas.push_back(route.replica);
  EXPECT_EQ(replicas, (std::vector<std::size_t>{0, 1, 1, 1}));
}

// A router that names no replica, or throws: that request is refused with the reason and nothing
// is routed for it; the cluster goes on serving.
class FaultyRouter final : public Router {
 public:
  RouteDecision route(const RouteRequest& request, std::span<const ReplicaLoad>) override {
    if (request.prompt.size() == 7) return {7, "nowhere"};
    if (request.prompt.size() == 8) throw Error("routing table corrupt");
    return {1, "replica 1"};
  }
};

TEST(LiveCluster, ARouterThatFailsRefusesThatRequestWithTheReason) {
  Stack a, b;
  FaultyRouter router;
  std::vector<std::unique_ptr<LiveEngine>> engines;
  engines.push_back(
      std::make_unique<LiveEngine>(*a.backend, *a.allocator, *a.scheduler, a.options));
  engines.push_back(
      std::make_unique<LiveEngine>(*b.backend, *b.allocator, *b.scheduler, b.options));
  LiveCluster cluster(std::move(engines), &router);
  Seen nowhere, corrupt, fine;
  const SubmitResult r7 = cluster.submit(request(3, 7, 4), nowhere.callbacks());
  EXPECT_EQ(r7.status, SubmitStatus::failed);
  EXPECT_EQ(r7.reason, "the router chose replica 7 of 2");
  const SubmitResult r8 = cluster.submit(request(3, 8, 4), corrupt.callbacks());
  EXPECT_EQ(r8.status, SubmitStatus::failed);
  EXPECT_EQ(r8.reason, "the router failed: routing table corrupt");
  const SubmitResult ok = cluster.submit(request(3, 6, 4), fine.callbacks());
  ASSERT_EQ(ok.status, SubmitStatus::accepted);
  EXPECT_EQ(ok.id, 0) << "a refused request takes no id";
  ASSERT_TRUE(fine.wait(60));
  (void)cluster.shutdown(true);
  const ClusterResult result = cluster.take_result();
  ASSERT_EQ(result.routes.size(), 1u);
  EXPECT_EQ(result.routes[0].replica, 1u);
  EXPECT_EQ(result.replicas[0].requests.size(), 0u);
  EXPECT_EQ(result.replicas[1].requests.size(), 1u);
}

// A cancel by the cluster's id reaches the replica holding it; a shutdown drains or aborts every
// replica's requests and sums the counts; afterwards submissions are refused.
TEST(LiveCluster, CancelAndShutdownReachEveryReplica) {
  for (const bool drain : {false, true}) {
    ClusterOf cluster(2, "round_robin", {}, {{"max_batch", std::int64_t{2}}}, true);
    std::vector<Seen> seen(5);
    std::vector<RequestId> ids;
    for (auto& s : seen) {  // 20 steps of 20 ms each, at most 2 at once on a replica
      const SubmitResult r = cluster.live->submit(request(4, 6, 20), s.callbacks());
      ASSERT_EQ(r.status, SubmitStatus::accepted);
      ids.push_back(r.id);
    }
    cluster.live->cancel(ids[1]);  // on replica 1
    ASSERT_TRUE(seen[1].wait(60));
    EXPECT_EQ(seen[1].ends[0].finish_reason, "cancelled");
    EXPECT_EQ(seen[1].ends[0].id, ids[1]);
    const ShutdownReport report = cluster.live->shutdown(drain);
    EXPECT_EQ(report.drained + report.aborted, 4) << "drain " << drain;
    EXPECT_EQ(drain ? report.aborted : report.drained, 0) << "drain " << drain;
    for (std::size_t i : {0u, 2u, 3u, 4u}) {
      ASSERT_TRUE(seen[i].wait(0)) << i;
      EXPECT_EQ(seen[i].ends[0].finish_reason, drain ? "max_tokens" : "cancelled");
    }
    Seen after;
    EXPECT_EQ(cluster.live->submit(request(4, 6, 4), after.callbacks()).status,
              SubmitStatus::shutting_down);
    const ClusterResult result = cluster.live->take_result();
    EXPECT_EQ(result.replicas[0].requests.size() + result.replicas[1].requests.size(), 5u);
    for (const auto& stack : cluster.stacks) EXPECT_EQ(stack->allocator->stats().used, 0);
  }
}

// A disaggregated served cluster: `prefill` replicas, then `decode` ones, round robin on both
// sides, every handoff taking `link_s` seconds to cross; `slow`: every forward 20 ms more.
struct DisaggregatedOf {
  DisaggregatedOf(std::size_t prefill, std::size_t decode, double link_s, bool slow = false,
                  bool contend = true, const Params& scheduler_params = {},
                  const std::string& scheduler_name = "fcfs") {
    router = test::plugin_registry().create<PluginKind::router>("round_robin", {}, {});
    decode_router = test::plugin_registry().create<PluginKind::router>("round_robin", {}, {});
    std::vector<std::unique_ptr<LiveEngine>> engines;
    for (std::size_t r = 0; r < prefill + decode; ++r) {
      Stack& s = *stacks.emplace_back(std::make_unique<Stack>(scheduler_params, scheduler_name));
      Backend* backend = s.backend.get();
      if (slow) backend = slow_backends.emplace_back(std::make_unique<SlowBackend>(*backend)).get();
      engines.push_back(
          std::make_unique<LiveEngine>(*backend, *s.allocator, *s.scheduler, s.options));
    }
    const LiveDisaggregation split{prefill, decode_router.get(),
                                   [link_s](std::int64_t, double) { return link_s; }, contend};
    live = std::make_unique<LiveCluster>(std::move(engines), router.get(), split);
  }
  std::int64_t kv_used() const {
    std::int64_t used = 0;
    for (const auto& stack : stacks) used += stack->allocator->stats().used;
    return used;
  }
  std::vector<std::unique_ptr<Stack>> stacks;
  std::vector<std::unique_ptr<SlowBackend>> slow_backends;
  PluginObject<Router> router, decode_router;
  std::unique_ptr<LiveCluster> live;  // last
};

// 1 prefill replica, 2 decode replicas: each request's first token streams from the prefill
// replica and the rest from a decode replica, to the same callbacks: the offline tokens, ended
// once with the cluster's id. The record has each request's handoff (its KV bytes) and its
// decode route, and the merged run the whole timelines.
TEST(LiveCluster, DisaggregatedStreamsTheOfflineTokensAcrossTheHandoff) {
  std::vector<WorkloadRequest> requests;
  for (std::int32_t i = 0; i < 6; ++i) requests.push_back(request(7 + 2 * i, 5 + i, 6 + i));
  const EngineResult offline = run_offline(requests);
  DisaggregatedOf cluster(1, 2, 0.0);
  std::vector<Seen> seen(requests.size());
  const std::vector<RequestId> ids = submit_from_threads(*cluster.live, requests, seen, 2);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(seen[i].wait(60)) << "request " << i;
    std::lock_guard lock(seen[i].mutex);
    ASSERT_EQ(seen[i].ends.size(), 1u) << i;
    EXPECT_EQ(seen[i].ends[0].id, ids[i]);
    EXPECT_EQ(seen[i].ends[0].finish_reason, "max_tokens") << i;
    EXPECT_EQ(seen[i].tokens, offline.tokens[i]) << "request " << i;
  }
  EXPECT_EQ(cluster.live->stats().handed_off, 6);
  EXPECT_EQ(cluster.live->stats().finished, 6);
  const ShutdownReport report = cluster.live->shutdown(true);
  EXPECT_EQ(report.drained + report.aborted, 0);  // nothing was in flight
  ClusterResult result = cluster.live->take_result();
  ASSERT_EQ(result.routes.size(), 6u);
  ASSERT_EQ(result.decode_routes.size(), 6u);
  std::vector<int> decoded(3, 0);
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(result.routes[i].replica, 0u);
    ASSERT_TRUE(result.decode_routes[i]) << i;
    EXPECT_GT(result.decode_routes[i]->kv_bytes, 0);
    ++decoded[result.decode_routes[i]->replica];
  }
  EXPECT_EQ(decoded, (std::vector<int>{0, 3, 3}));
  const std::vector<RequestTimeline> timelines = cluster_timelines(result);
  const EngineResult merged = merged_result(std::move(result));
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto id = static_cast<std::size_t>(ids[i]);
    EXPECT_EQ(merged.tokens[id], offline.tokens[i]);
    EXPECT_EQ(timelines[id].finish_reason, "max_tokens");
    EXPECT_EQ(timelines[id].token_times_s.size(), offline.tokens[i].size());
  }
  EXPECT_EQ(cluster.kv_used(), 0);
}

// Handoffs share the links: three requests handed off at about once each wait for the one
// before (0.15 s a transfer), so they reach the decode replica 0.15 s apart; links that do not
// contend take them together.
TEST(LiveCluster, DisaggregatedTransfersQueueOnTheLinks) {
  for (const bool contend : {true, false}) {
    DisaggregatedOf cluster(1, 1, 0.15, false, contend);
    std::vector<Seen> seen(3);
    for (auto& s : seen)
      ASSERT_EQ(cluster.live->submit(request(3, 4, 3), s.callbacks()).status,
                SubmitStatus::accepted);
    for (auto& s : seen) ASSERT_TRUE(s.wait(60));
    (void)cluster.live->shutdown(true);
    const ClusterResult result = cluster.live->take_result();
    std::vector<double> arrivals;
    for (const auto& route : result.decode_routes) arrivals.push_back(route->time_s);
    std::sort(arrivals.begin(), arrivals.end());
    if (contend) {
      EXPECT_GE(arrivals[1] - arrivals[0], 0.15 - 1e-6);
      EXPECT_GE(arrivals[2] - arrivals[1], 0.15 - 1e-6);
    } else {
      EXPECT_LT(arrivals[2] - arrivals[0], 0.15);  // handed off within one prefill step or two
    }
  }
}

// A cancel finds the request wherever it is: on its prefill replica (it ends there, never handed
// off), on the link (a 30 s transfer: it ends at once, delivered and cancelled, so its decode
// replica's record has it, with no token decoded) or on its decode replica mid-stream. Each
// frees its KV; each ends once.
TEST(LiveCluster, DisaggregatedCancelFindsTheRequestWhereverItIs) {
  {
    // 20 ms a forward, prompts in chunks of 4 tokens: a's 40 take 200 ms to prefill.
    DisaggregatedOf cluster(1, 1, 0.0, true, true, {{"max_tokens_per_step", std::int64_t{4}}},
                            "chunked");
    Seen in_prefill, in_decode;
    const SubmitResult a = cluster.live->submit(request(3, 40, 20), in_prefill.callbacks());
    cluster.live->cancel(a.id);
    const SubmitResult b = cluster.live->submit(request(3, 4, 40), in_decode.callbacks());
    ASSERT_TRUE(test::eventually([&] {
      std::lock_guard lock(in_decode.mutex);
      return in_decode.tokens.size() >= 3;  // the first from prefill, two from decode
    }));
    cluster.live->cancel(b.id);
    ASSERT_TRUE(in_prefill.wait(60));
    ASSERT_TRUE(in_decode.wait(60));
    EXPECT_EQ(in_prefill.ends[0].finish_reason, "cancelled") << in_prefill.ends[0].reject_reason;
    EXPECT_EQ(in_decode.ends[0].finish_reason, "cancelled");
    EXPECT_LT(in_decode.tokens.size(), 40u);
    (void)cluster.live->shutdown(true);
    const ClusterResult result = cluster.live->take_result();
    EXPECT_FALSE(result.decode_routes[0]) << "cancelled before its handoff";
    ASSERT_TRUE(result.decode_routes[1]);
    EXPECT_EQ(cluster_timelines(result)[1].finish_reason, "cancelled");
    EXPECT_EQ(cluster.kv_used(), 0);
  }
  DisaggregatedOf cluster(1, 1, 30.0);
  Seen on_link;
  const SubmitResult r = cluster.live->submit(request(3, 4, 10), on_link.callbacks());
  ASSERT_TRUE(test::eventually([&] { return cluster.live->stats().handed_off == 1; }));
  const auto asked = std::chrono::steady_clock::now();
  cluster.live->cancel(r.id);
  ASSERT_TRUE(on_link.wait(20)) << "a cancel does not wait for the transfer";
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count(), 20);
  EXPECT_EQ(on_link.ends[0].finish_reason, "cancelled");
  EXPECT_EQ(on_link.tokens.size(), 1u);  // the prefill's token only
  (void)cluster.live->shutdown(true);
  const ClusterResult result = cluster.live->take_result();
  ASSERT_TRUE(result.decode_routes[0]);
  EXPECT_EQ(result.replicas[1].requests.size(), 1u);
  EXPECT_EQ(result.replicas[1].requests[0].finish_reason, "cancelled");
  EXPECT_EQ(cluster.kv_used(), 0);
}

// A shutdown ends every request once, wherever it is: draining, the ones on the link cross and
// decode to their end; aborting, they end cancelled at once. Each counts once, where it ended.
TEST(LiveCluster, DisaggregatedShutdownDrainsOrAbortsTheLinkToo) {
  for (const bool drain : {true, false}) {
    DisaggregatedOf cluster(1, 1, drain ? 0.2 : 30.0);
    std::vector<Seen> seen(3);
    for (auto& s : seen)
      ASSERT_EQ(cluster.live->submit(request(5, 4, 6), s.callbacks()).status,
                SubmitStatus::accepted);
    ASSERT_TRUE(test::eventually([&] { return cluster.live->stats().handed_off >= 1; }));
    const ShutdownReport report = cluster.live->shutdown(drain);
    for (std::size_t i = 0; i < 3; ++i) {
      ASSERT_TRUE(seen[i].wait(0)) << i;
      ASSERT_EQ(seen[i].ends.size(), 1u);
      EXPECT_EQ(seen[i].ends[0].finish_reason, drain ? "max_tokens" : "cancelled") << i;
    }
    EXPECT_EQ(report.drained + report.aborted, 3) << "drain " << drain;
    EXPECT_EQ(drain ? report.aborted : report.drained, 0) << "drain " << drain;
    const ClusterResult result = cluster.live->take_result();
    EXPECT_EQ(cluster_timelines(result).size(), 3u);
    EXPECT_EQ(cluster.kv_used(), 0);
  }
}

}  // namespace
}  // namespace kvlab
