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
#include "kvlab/engine/live_engine.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "plugin_registry.hpp"

namespace kvlab {
namespace {

const cpu::LlamaWeights& live_weights() {
  static const cpu::LlamaWeights w = test::scaled_random_weights(model_preset("tiny"), 99);
  return w;
}

using Params = std::map<std::string, ParamValue, std::less<>>;

// The tiny model's serving stack: paged KV, fcfs with `scheduler_params`, the cpu backend.
struct Stack {
  explicit Stack(Params scheduler_params = {})
      : pool({live_weights().config.num_hidden_layers, live_weights().config.num_key_value_heads,
              live_weights().config.head_dim, 512}) {
    PluginContext context;
    context.pool = &pool;
    context.model = &live_weights().config;
    context.max_seq_len = 64;
    allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
        "paged", {{"block_size", std::int64_t{4}}}, context);
    scheduler = test::plugin_registry().create<PluginKind::scheduler>(
        "fcfs", std::move(scheduler_params), context);
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

TEST(LiveEngine, RequestsFromSeveralThreadsStreamTheOfflineTokensAndEndOnce) {
  std::vector<WorkloadRequest> requests;
  for (std::int32_t i = 0; i < 8; ++i) requests.push_back(request(5 + 3 * i, 6 + i, 10 + i));
  const EngineResult offline = [&] {
    Stack stack;
    stack.options.clock = EngineClock::steps;
    Engine engine(*stack.backend, *stack.allocator, *stack.scheduler, stack.options);
    return engine.run(requests);
  }();
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

// A backend that fails on its `fail_at`th forward (an engine-level fault: a device lost, NaN).
class FailingBackend final : public Backend {
 public:
  FailingBackend(Backend& inner, int fail_at) : inner_(inner), fail_at_(fail_at) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    if (++calls_ == fail_at_) throw Error("the device fell off the bus");
    return inner_.forward(batch, choices);
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }

 private:
  Backend& inner_;
  int calls_ = 0, fail_at_;
};

// An engine fault ends the loop, and still every request accepted ends once: rejected with the
// fault as its reason; later submissions are refused; fault() says what happened.
TEST(LiveEngine, AnEngineFaultEndsEveryRequestInFlightWithTheFault) {
  Stack stack({{"max_batch", std::int64_t{1}}});
  FailingBackend failing(*stack.backend, 5);
  LiveEngine live(failing, *stack.allocator, *stack.scheduler, stack.options);
  std::vector<Seen> seen(3);
  for (auto& s : seen)
    ASSERT_EQ(live.submit(request(4, 6, 40), s.callbacks()).status, SubmitStatus::accepted);
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

}  // namespace
}  // namespace kvlab
