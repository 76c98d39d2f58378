// The engine end to end on the tiny model: every scheduler x allocator produces the reference's
// greedy tokens; submitted = finished + rejected over many random workloads; same input, same
// bytes out (events, tokens, timelines).
#include <gtest/gtest.h>

#include <functional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "cpu_reference/test_models.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/engine.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/workload/workload.hpp"
#include "plugin_registry.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const cpu::LlamaWeights& weights() {
  static const cpu::LlamaWeights w = test::scaled_random_weights(model_preset("tiny"), 99);
  return w;
}

struct EngineSetup {
  std::string scheduler = "fcfs";
  std::map<std::string, ParamValue, std::less<>> scheduler_params;
  std::string allocator = "paged";
  std::map<std::string, ParamValue, std::less<>> allocator_params{{"block_size", std::int64_t{4}}};
  std::int64_t slots = 256;
  std::int64_t max_seq_len = 64;
  std::int64_t swap_slots = 0;
  DType kv_dtype = DType::dtype_f32;
  std::int64_t kivi_residual = kKiviResidualDefault;  // a KIVI pool's fp16 tokens
  EngineClock clock = EngineClock::virtual_clock;
  bool cost_model = true;                           // price steps with the cpu profile
  std::function<void(const SchedulerInput&)> sees;  // what the scheduler is shown, each step
  std::optional<std::int64_t> window;               // sliding-window attention
  std::string kv_policy;                            // a kv_policy plugin, or none
  std::map<std::string, ParamValue, std::less<>> kv_policy_params;
  const cpu::LlamaWeights* model = nullptr;  // another model than weights()
  SpeculationOptions speculation;  // speculative decoding: off unless speculation.tokens > 0
  Proposer* proposer = nullptr;    // a proposer object of the test's, or the built-in one
  // Called after each step (its number from 1) of a run driven step by step; unset: Engine::run.
  std::function<void(Engine&, std::int64_t)> after_step;
  std::vector<StepExtension*> extensions;  // EngineOptions::extensions
};

// The scheduler plugin, with what it is shown passed on to `sees` first.
class WatchedScheduler final : public Scheduler {
 public:
  WatchedScheduler(Scheduler& inner, std::function<void(const SchedulerInput&)> sees)
      : inner_(inner), sees_(std::move(sees)) {}
  StepPlan schedule(const SchedulerInput& input) override {
    sees_(input);
    return inner_.schedule(input);
  }

 private:
  Scheduler& inner_;
  std::function<void(const SchedulerInput&)> sees_;
};

EngineResult run_engine(const EngineSetup& setup, const std::vector<WorkloadRequest>& requests) {
  const cpu::LlamaWeights& model = setup.model != nullptr ? *setup.model : weights();
  const ModelConfig& c = model.config;
  KvPoolShape shape{c.num_hidden_layers, c.num_key_value_heads, c.head_dim, setup.slots,
                    setup.kv_dtype};
  shape.kivi_residual = setup.kivi_residual;
  KvPool pool(shape);
  PluginContext context;
  context.pool = &pool;
  context.model = &c;
  context.max_seq_len = setup.max_seq_len;
  auto allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
      setup.allocator, setup.allocator_params, context);
  auto scheduler = test::plugin_registry().create<PluginKind::scheduler>(
      setup.scheduler, setup.scheduler_params, context);
  cpu::CpuBackend backend(model, pool, setup.window);
  const CostModel cost(c, load_hardware_profile("cpu"));  // prices the virtual clock's steps
  EngineOptions options;
  PluginObject<KvPolicy> policy;
  if (!setup.kv_policy.empty()) {
    policy = test::plugin_registry().create<PluginKind::kv_policy>(setup.kv_policy,
                                                                   setup.kv_policy_params, context);
    options.kv_policy = policy.get();
  }
  options.rules.window = setup.window;
  options.clock = setup.clock;
  if (setup.cost_model) options.cost_model = &cost;
  options.rules.context = setup.max_seq_len;
  options.rules.eos_token_ids = c.eos_token_ids;
  options.pool = &pool;
  options.swap_slots = setup.swap_slots;
  options.speculation = setup.speculation;
  options.proposer = setup.proposer;
  options.extensions = setup.extensions;
  WatchedScheduler watched(
      *scheduler, setup.sees ? setup.sees : [](const SchedulerInput&) {});
  Engine engine(backend, *allocator, watched, options);
  if (!setup.after_step) return engine.run(requests);
  engine.start(requests);
  for (std::int64_t step = 1; engine.step(); ++step) setup.after_step(engine, step);
  return engine.take_result();
}

// A backend that picks tokens "on its device" (here: after the CPU backend's forward, with
// kvlab::pick_token, or the argmax's -1 for a non-finite row) when the engine gives it choices
// and it accepts them: what the engine offers per step, and what it gets back, are visible.
class DeviceSamplingBackend final : public Backend {
 public:
  DeviceSamplingBackend(cpu::CpuBackend& inner, bool accepts) : inner_(inner), accepts_(accepts) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    const ForwardResult logits = inner_.forward(batch, {});
    if (!choices.empty()) ++requests;
    modes.push_back(accepts_ && !choices.empty());
    chosen_.clear();
    logprobs_.clear();
    if (!modes.back()) return logits;
    EXPECT_EQ(choices.size(), batch.size());
    const auto vocab = static_cast<std::size_t>(vocab_size());
    std::int32_t width = 0;  // 1 + the most logprobs asked, as ForwardResult::logprobs says
    for (const TokenChoice& c : choices) width = std::max(width, c.logprobs + 1);
    for (std::size_t e = 0; e < batch.size(); ++e) {
      const auto row = logits.logits.subspan(e * vocab, vocab);
      if (std::any_of(row.begin(), row.end(), [](float v) { return !std::isfinite(v); })) {
        chosen_.push_back(-1);
        logprobs_.insert(logprobs_.end(), static_cast<std::size_t>(width), {-1, NAN});
        continue;
      }
      SamplingParams p;
      p.temperature = choices[e].temperature;
      p.top_k = choices[e].top_k;
      p.top_p = choices[e].top_p;
      if (p.temperature > 0) ++sampled_rows;
      chosen_.push_back(pick_token(row, p, choices[e].uniform));
      if (width == 0) continue;
      const auto top = top_logprobs(row, std::max(choices[e].logprobs, 0));
      logprobs_.push_back({chosen_.back(), token_logprob(row, chosen_.back()) + logprob_error});
      logprobs_.insert(logprobs_.end(), top.begin(), top.end());
      logprobs_.resize(logprobs_.size() + static_cast<std::size_t>(width) - 1 - top.size(),
                       {-1, NAN});
    }
    if (without_logprobs) return ForwardResult::of_tokens(chosen_);
    return ForwardResult::of_tokens(chosen_, logprobs_, static_cast<std::size_t>(width));
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  std::vector<bool> modes;  // per forward: whether it chose the tokens
  int requests = 0;         // forwards given choices
  int sampled_rows = 0;     // rows it drew from (temperature > 0)
  float logprob_error = 0;  // added to each chosen token's log-probability
  bool without_logprobs = false;

 private:
  cpu::CpuBackend& inner_;
  bool accepts_;
  std::vector<std::int32_t> chosen_;
  std::vector<TokenLogprob> logprobs_;
};

struct DeviceSamplingRun {
  EngineResult result;
  std::vector<bool> modes;
  int requests = 0, sampled_rows = 0;
};

struct DeviceFaults {
  float logprob_error = 0;
  bool without_logprobs = false;
};

DeviceSamplingRun run_device_sampling(const cpu::LlamaWeights& w,
                                      const std::vector<WorkloadRequest>& requests, bool accepts,
                                      bool read_logits,
                                      std::vector<std::vector<float>>* logits_read = nullptr,
                                      DeviceFaults faults = {}) {
  const ModelConfig& c = w.config;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256});
  PluginContext context;
  context.pool = &pool;
  context.model = &c;
  context.max_seq_len = 64;
  auto allocator = test::plugin_registry().create<PluginKind::kv_allocator>("paged", {}, context);
  auto scheduler = test::plugin_registry().create<PluginKind::scheduler>("fcfs", {}, context);
  cpu::CpuBackend cpu(w, pool, std::nullopt);
  DeviceSamplingBackend backend(cpu, accepts);
  backend.logprob_error = faults.logprob_error;
  backend.without_logprobs = faults.without_logprobs;
  EngineOptions options;
  options.clock = EngineClock::steps;
  options.rules.context = 64;
  options.rules.eos_token_ids = c.eos_token_ids;
  options.pool = &pool;
  if (read_logits)
    options.observers.on_logits = [logits_read](RequestId, std::span<const float> row) {
      if (logits_read != nullptr) logits_read->emplace_back(row.begin(), row.end());
    };
  DeviceSamplingRun run;
  Engine engine(backend, *allocator, *scheduler, options);
  run.result = engine.run(requests);
  run.modes = backend.modes;
  run.requests = backend.requests;
  run.sampled_rows = backend.sampled_rows;
  return run;
}

// Three requests sharing steps: greedy, temperature 0.8 with top-k, temperature 1.2 with top-p;
// a fourth, greedy, arrives alone after them.
std::vector<WorkloadRequest> mixed_sampling_requests() {
  std::vector<WorkloadRequest> requests(4);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = static_cast<std::int64_t>(i);
    requests[i].prompt = {1, static_cast<std::int32_t>(5 + i), 9, 2};
    requests[i].output_tokens = 8;
    requests[i].sampling.ignore_eos = true;
    requests[i].sampling.seed = 11 + i;
  }
  requests[1].sampling.temperature = 0.8;
  requests[1].sampling.top_k = 20;
  requests[2].sampling.temperature = 1.2;
  requests[2].sampling.top_p = 0.9;
  requests[3].arrival_s = 1e9;  // joins after the others finished (steps clock: when idle)
  return requests;
}

// Every step whose logits nobody reads is offered to the backend with each entry's choice and
// draw: the tokens are the host sampler's, greedy and sampled alike (the draws are taken
// before the forward either way); a run that reads the logits never offers; a backend that
// returns logits although offered choices gets its tokens picked by the host with the same
// draws (the offer is per call: nothing of it outlives the forward).
TEST(Engine, TokensArePickedOnTheBackendWhenItCanWithTheHostsDraws) {
  const auto requests = mixed_sampling_requests();
  const DeviceSamplingRun host = run_device_sampling(weights(), requests, false, false);
  EXPECT_EQ(host.requests, static_cast<int>(host.modes.size()));  // offered every step
  for (const bool mode : host.modes) EXPECT_FALSE(mode);
  const DeviceSamplingRun device = run_device_sampling(weights(), requests, true, false);
  EXPECT_EQ(device.result.tokens, host.result.tokens);
  EXPECT_EQ(device.requests, static_cast<int>(device.modes.size()));  // every step offered
  for (const bool mode : device.modes) EXPECT_TRUE(mode);
  EXPECT_EQ(device.sampled_rows, 16);  // requests 1 and 2, 8 tokens each
  // Sampled tokens are not all the argmax's: the draws matter (request 2 at temperature 1.2).
  std::vector<WorkloadRequest> greedy = requests;
  for (auto& r : greedy) r.sampling = requests[0].sampling;
  const DeviceSamplingRun argmax = run_device_sampling(weights(), greedy, true, false);
  EXPECT_NE(argmax.result.tokens[2], device.result.tokens[2]);
  const DeviceSamplingRun reading = run_device_sampling(weights(), requests, true, true);
  for (const bool mode : reading.modes) EXPECT_FALSE(mode);
  EXPECT_EQ(reading.requests, 0);
  EXPECT_EQ(reading.result.tokens, host.result.tokens);
}

// Requests that ask for log-probabilities get, per generated token, its log-probability and the
// k most likely tokens: from the logits on the host, or from the backend that picked the tokens
// (only they cross), the same values either way; others get none. A backend that picked tokens
// but gave no log-probabilities is an error naming the request.
TEST(Engine, LogprobsComeWithEachTokenWhereverItWasPicked) {
  auto requests = mixed_sampling_requests();
  requests[0].sampling.logprobs = 3;
  requests[1].sampling.logprobs = 0;
  requests[2].sampling.logprobs = kMaxLogprobs;  // request 3: none
  std::vector<std::vector<float>> rows;  // every sampled row, in the order the engine read them
  const DeviceSamplingRun reading = run_device_sampling(weights(), requests, true, true, &rows);
  const DeviceSamplingRun device = run_device_sampling(weights(), requests, true, false);
  ASSERT_EQ(reading.result.logprobs.size(), 4u);
  EXPECT_TRUE(reading.result.logprobs[3].empty());
  // The host's values are those of the rows it read (token by token, request by request).
  std::size_t checked = 0;
  for (const auto& row : rows)
    for (std::size_t i = 0; i < 3; ++i)
      for (std::size_t t = 0; t < reading.result.tokens[i].size(); ++t) {
        const GeneratedLogprobs& g = reading.result.logprobs[i][t];
        const std::int32_t token = reading.result.tokens[i][t];
        if (g.logprob != token_logprob(row, token)) continue;
        const auto top = top_logprobs(row, requests[i].sampling.logprobs);
        if (g.top.size() != top.size() ||
            !std::equal(top.begin(), top.end(), g.top.begin(), [](auto a, auto b) {
              return a.token == b.token && a.logprob == b.logprob;
            }))
          continue;
        ++checked;
      }
  EXPECT_GE(checked, 24u);  // 3 requests x 8 tokens each found their row
  for (std::size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(reading.result.logprobs[i].size(), reading.result.tokens[i].size()) << i;
    EXPECT_EQ(reading.result.logprobs[i][0].top.size(),
              static_cast<std::size_t>(requests[i].sampling.logprobs))
        << i;
    for (const GeneratedLogprobs& g : reading.result.logprobs[i]) EXPECT_LE(g.logprob, 0.0f);
  }
  // The device's: every value equal to the host's.
  EXPECT_EQ(device.result.tokens, reading.result.tokens);
  for (std::size_t i = 0; i < 4; ++i) {
    ASSERT_EQ(device.result.logprobs[i].size(), reading.result.logprobs[i].size()) << i;
    for (std::size_t t = 0; t < device.result.logprobs[i].size(); ++t) {
      EXPECT_EQ(device.result.logprobs[i][t].logprob, reading.result.logprobs[i][t].logprob);
      ASSERT_EQ(device.result.logprobs[i][t].top.size(), reading.result.logprobs[i][t].top.size());
      for (std::size_t k = 0; k < device.result.logprobs[i][t].top.size(); ++k)
        EXPECT_EQ(device.result.logprobs[i][t].top[k].token,
                  reading.result.logprobs[i][t].top[k].token);
    }
  }
  // What the device gives is what the results hold (not recomputed on the host).
  const DeviceSamplingRun shifted =
      run_device_sampling(weights(), requests, true, false, nullptr, {0.5f, false});
  EXPECT_EQ(shifted.result.logprobs[0][0].logprob, device.result.logprobs[0][0].logprob + 0.5f);
  const std::string message = test::error_of<Error>([&] {
    run_device_sampling(weights(), requests, true, false, nullptr, {0, true});
  });
  EXPECT_NE(message.find("request 0 asks for log-probabilities"), std::string::npos) << message;
}

// Logits with NaN (broken weights, a broken backend) stop the run with the request and the
// step; they used to become token 0 with a null logprob and exit 0. The same when the backend
// picks the tokens (-1 for the row).
// A client that goes away (Engine::cancel): at the next step its request finishes as
// "cancelled", whatever its state: running (its pool KV freed before that step's plan), waiting
// (never admitted), swapped out (its host KV dropped) or not arrived yet (cancelled as it
// arrives). The others are untouched: the reference's tokens, in full. submitted = finished +
// rejected still holds, each cancel is one event, and cancelling an ended or unknown request
// does nothing.
TEST(Engine, CancelledRequestsEndAtTheNextStepWhateverTheirState) {
  std::vector<WorkloadRequest> requests(6);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    WorkloadRequest& r = requests[i];
    r.id = static_cast<std::int64_t>(i);
    r.prompt.assign(12, static_cast<std::int32_t>(3 + i));
    r.output_tokens = 24;
    r.sampling.ignore_eos = true;
  }
  requests[5].arrival_s = 100;  // arrives long after the rest are done
  const EngineResult uncancelled = [&] {
    EngineSetup setup;
    setup.slots = 96;  // two or three sequences at a time: preemptions (swaps)
    setup.swap_slots = 512;
    setup.scheduler_params = {{"preemption", std::string("swap")}};
    return run_engine(setup, requests);
  }();
  EngineSetup setup;
  setup.slots = 96;
  setup.swap_slots = 512;
  setup.scheduler_params = {{"preemption", std::string("swap")}};
  std::int64_t used_before = -1, used_after = -1;  // after step 4; at the next plan
  const KvAllocator* kv = nullptr;
  std::vector<RequestId> running_now;
  bool cancelled = false;
  setup.sees = [&](const SchedulerInput& input) {
    kv = input.kv;
    running_now.clear();
    for (const RequestState* r : input.running) running_now.push_back(r->id);
    if (cancelled && used_after < 0) {  // the first plan after the cancel
      used_after = input.kv->stats().used;
      EXPECT_EQ(std::find(running_now.begin(), running_now.end(), 0), running_now.end());
    }
  };
  setup.after_step = [&](Engine& engine, std::int64_t step) {
    if (step == 4) {  // request 0 runs: cancel it, and 5 before it arrives
      ASSERT_NE(std::find(running_now.begin(), running_now.end(), 0), running_now.end());
      used_before = kv->stats().used;
      EXPECT_TRUE(engine.cancel(0));
      EXPECT_TRUE(engine.cancel(0)) << "twice before it takes effect: still one cancel";
      EXPECT_TRUE(engine.cancel(5));
      EXPECT_FALSE(engine.cancel(42)) << "no such request";
      cancelled = true;
    }
    if (step == 5) {
      EXPECT_FALSE(engine.cancel(0)) << "already ended";
    }
  };
  const EngineResult result = run_engine(setup, requests);
  ASSERT_EQ(result.requests.size(), requests.size());
  // Nothing runs between step 4's end and step 5's plan but the cancel: at least its prompt's KV
  // (12 tokens) left the pool.
  EXPECT_LE(used_after, used_before - 12) << "request 0's KV was freed before step 5's plan";
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const RequestTimeline& t = result.requests[i];
    EXPECT_FALSE(t.rejected) << i;
    if (i == 0 || i == 5) {
      EXPECT_EQ(t.finish_reason, "cancelled") << i;
      EXPECT_LT(result.tokens[i].size(), 24u) << i;
    } else {
      EXPECT_EQ(t.finish_reason, "max_tokens") << i;
      EXPECT_EQ(result.tokens[i], uncancelled.tokens[i]) << i;
    }
  }
  EXPECT_TRUE(result.tokens[5].empty()) << "cancelled as it arrived";
  const auto cancels = std::count_if(result.events.begin(), result.events.end(), [](const auto& e) {
    return e.kind == EventKind::event_finish && e.reason == "cancelled";
  });
  EXPECT_EQ(cancels, 2);
}

// A waiting request (never admitted) and a swapped-out one are cancelled from the queue too (the
// swap pool is small enough to preempt by swapping); every other request still finishes.
TEST(Engine, CancelledWaitingAndSwappedRequestsLeaveQueueAndSwapPool) {
  std::vector<WorkloadRequest> requests(5);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = static_cast<std::int64_t>(i);
    requests[i].prompt.assign(12, static_cast<std::int32_t>(7 + i));
    requests[i].output_tokens = 30;
    requests[i].sampling.ignore_eos = true;
  }
  EngineSetup setup;
  setup.slots = 64;
  setup.swap_slots = 512;
  setup.scheduler_params = {{"preemption", std::string("swap")}};
  std::map<RequestId, RequestStatus> waiting_states;
  setup.sees = [&](const SchedulerInput& input) {
    waiting_states.clear();
    for (const RequestState* r : input.waiting) waiting_states[r->id] = r->status;
  };
  std::set<RequestStatus> cancelled_from;
  setup.after_step = [&](Engine& engine, std::int64_t) {
    for (const auto& [id, status] : waiting_states) {
      if (!cancelled_from.contains(status) && engine.cancel(id)) cancelled_from.insert(status);
    }
  };
  const EngineResult result = run_engine(setup, requests);
  EXPECT_TRUE(cancelled_from.contains(RequestStatus::waiting));
  EXPECT_TRUE(cancelled_from.contains(RequestStatus::swapped)) << "the pool preempts by swapping";
  std::int64_t cancelled = 0;
  for (const RequestTimeline& t : result.requests) {
    EXPECT_TRUE(t.finish_reason == "cancelled" || t.finish_reason == "max_tokens")
        << t.finish_reason;
    cancelled += t.finish_reason == "cancelled";
  }
  EXPECT_EQ(cancelled, 2);
}

TEST(Engine, NonFiniteLogitsAreAnErrorNamingRequestAndStep) {
  cpu::LlamaWeights broken = weights();
  broken.final_norm(3) = std::numeric_limits<float>::quiet_NaN();  // every logit turns NaN
  const std::string message = test::error_of<Error>(
      [&] { run_device_sampling(broken, mixed_sampling_requests(), false, false); });
  EXPECT_NE(message.find("request 0, step 0"), std::string::npos) << message;
  EXPECT_NE(message.find("nan"), std::string::npos) << message;
  const std::string device = test::error_of<Error>(
      [&] { run_device_sampling(broken, mixed_sampling_requests(), true, false); });
  EXPECT_NE(device.find("request 0, step 0"), std::string::npos) << device;
  EXPECT_NE(device.find("non-finite"), std::string::npos) << device;
}

struct TokenRange {
  std::int64_t min, max;
};

// `count` requests of `vocab_size` tokens a few steps apart on the virtual clock (Poisson at
// 400/s), prompt and output lengths uniform over their ranges.
SyntheticWorkload spaced_workload(std::uint64_t seed, std::int64_t count, std::int64_t vocab_size,
                                  TokenRange prompt, TokenRange output) {
  SyntheticWorkload spec;
  spec.requests = count;
  spec.seed = seed;
  spec.vocab_size = vocab_size;
  spec.arrival = {ArrivalKind::poisson, 400.0, 1.0, 1};
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, prompt.min, prompt.max};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, output.min, output.max};
  return spec;
}

std::vector<WorkloadRequest> small_workload(std::uint64_t seed, std::int64_t count) {
  SyntheticWorkload spec =
      spaced_workload(seed, count, weights().config.vocab_size, {3, 20}, {1, 8});
  spec.prefix_groups = 2;
  spec.prefix_tokens = 8;
  spec.priority_weights = {1, 1};
  return generate_workload(spec);
}

using Combo = std::tuple<std::string, std::string>;
class EngineEquivalence : public ::testing::TestWithParam<Combo> {};

TEST_P(EngineEquivalence, GreedyTokensMatchTheReference) {
  const auto& [scheduler, allocator] = GetParam();
  EngineSetup setup;
  setup.scheduler = scheduler;
  setup.allocator = allocator;
  setup.allocator_params =
      allocator == "paged"
          ? std::map<std::string, ParamValue, std::less<>>{{"block_size", std::int64_t{4}}}
          : std::map<std::string, ParamValue, std::less<>>{};
  if (scheduler == "chunked") setup.scheduler_params = {{"max_tokens_per_step", std::int64_t{8}}};
  if (scheduler == "vtc" || scheduler == "edf")  // with chunks: prompts split as well
    setup.scheduler_params = {{"max_tokens_per_step", std::int64_t{8}}, {"chunked_prefill", true}};
  setup.slots = allocator == "static" ? 64 * 3 : 72;  // tight: preemptions happen
  auto requests = small_workload(5, 8);
  for (std::size_t i = 0; i < requests.size(); ++i) {  // two tenants, deadlines out of order
    requests[i].tenant.assign(1, i % 3 ? 'a' : 'b');
    requests[i].slo.ttft_s = 0.01 * static_cast<double>((i * 5) % 8 + 1);
  }
  const EngineResult result = run_engine(setup, requests);
  const cpu::ReferenceModel reference(weights());
  std::int64_t preemptions = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_FALSE(result.requests[i].rejected) << result.requests[i].reject_reason;
    SamplingParams sampling = requests[i].sampling;
    const auto expected = cpu::generate(reference, requests[i].prompt, sampling);
    std::vector<std::int32_t> expected_tokens;
    for (const auto& t : expected.tokens) expected_tokens.push_back(t.token);
    EXPECT_EQ(result.tokens[i], expected_tokens) << "request " << i;
    preemptions += result.requests[i].preemptions;
  }
  RecordProperty("preemptions", std::to_string(preemptions));
  const RunSummary summary = summarize_run(result.requests, result.duration_s);
  EXPECT_EQ(summary.finished, static_cast<std::int64_t>(requests.size()));
}

INSTANTIATE_TEST_SUITE_P(
    SchedulersByAllocators, EngineEquivalence,
    ::testing::Combine(::testing::Values("static", "fcfs", "priority", "chunked", "sjf_oracle",
                                         "edf", "vtc"),
                       ::testing::Values("static", "dynamic", "paged")),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// The scheduler is shown the clock: each step's start on the engine's clock (the virtual one
// here: arrivals spread out, so the clock idles to them as well as advancing by steps).
// Keeping the newest 8 positions between decode steps is sliding-window attention over 9 (the
// 8 kept and the new token) once the prompt (at most 9 tokens here) is in: the same greedy
// tokens, through views whose first positions were dropped and blocks released.
TEST(Engine, WindowKvPolicyGivesSlidingWindowAttentionsTokens) {
  SyntheticWorkload spec;
  spec.requests = 6;
  spec.seed = 5;
  spec.vocab_size = weights().config.vocab_size;
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, 2, 9};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, 20, 40};
  const std::vector<WorkloadRequest> requests = generate_workload(spec);
  EngineSetup window;
  window.window = 9;
  window.allocator_params["prefix_caching"] = false;
  EngineSetup policy;
  policy.kv_policy = "window";
  policy.kv_policy_params = {{"budget", std::int64_t{8}}};
  policy.allocator_params["prefix_caching"] = false;
  const EngineResult a = run_engine(window, requests), b = run_engine(policy, requests);
  ASSERT_EQ(a.requests.size(), requests.size());
  ASSERT_EQ(b.requests.size(), requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(b.requests[i].finish_reason, a.requests[i].finish_reason) << i;
    EXPECT_EQ(b.tokens[i], a.tokens[i]) << i;
  }
}

// Every shipped policy (h2o, snapkv, pyramidkv and adakv reading the backend's attention
// scores; the last four per layer and K/V head, masking what one head drops and another keeps)
// under fcfs and chunked prefill, with a pool small enough to preempt: every request finishes,
// and after each step a sequence whose heads all keep the same positions holds at most its
// budget of them.
TEST(Engine, KvPoliciesBoundEachSequencesKvAndLoseNoRequest) {
  const std::vector<WorkloadRequest> requests = generate_workload(  // up to 50 tokens each
      spaced_workload(8, 10, weights().config.vocab_size, {3, 20}, {10, 30}));
  struct Policy {
    const char* name;
    bool per_head;
  };
  for (const Policy policy :
       {Policy{"window", false}, Policy{"streaming_llm", false}, Policy{"h2o", false},
        Policy{"snapkv", false}, Policy{"h2o", true}, Policy{"snapkv", true},
        Policy{"pyramidkv", true}, Policy{"adakv", true}}) {
    for (const char* scheduler : {"fcfs", "chunked"}) {
      EngineSetup setup;
      setup.scheduler = scheduler;
      if (std::string(scheduler) == "chunked")  // (most_kv: victims by the KV their views hold)
        setup.scheduler_params = {{"max_tokens_per_step", std::int64_t{16}},
                                  {"victim", std::string("most_kv")}};
      setup.slots = 64;
      setup.allocator_params["prefix_caching"] = false;
      const std::string name = policy.name;
      setup.kv_policy = name;
      setup.kv_policy_params = {{"budget", std::int64_t{8}}};
      if (name != "window" && name != "streaming_llm" && name != "h2o")
        setup.kv_policy_params["window"] = std::int64_t{3};
      if (name == "h2o" || name == "snapkv") setup.kv_policy_params["per_head"] = policy.per_head;
      const EngineResult r = run_engine(setup, requests);
      SCOPED_TRACE(name + (policy.per_head ? " per head " : " ") + scheduler);
      ASSERT_EQ(r.requests.size(), requests.size());
      for (const RequestTimeline& q : r.requests) {
        EXPECT_TRUE(q.finish_reason == "max_tokens" || q.finish_reason == "eos") << q.finish_reason;
      }
      std::int64_t preempted = 0;
      for (const StepRecord& step : r.steps) {
        if (!policy.per_head) {
          EXPECT_LE(step.kv.used, 8 * step.running) << "step " << step.step;
        }
        preempted += step.preempted;
      }
      EXPECT_GT(preempted, 0);  // a sequence rebuilt its KV: the policy started it afresh
    }
  }
  // With sliding-window attention too, which releases old positions between the forward and the
  // policy: h2o reads the scores of the positions still held.
  EngineSetup both;
  both.window = 6;
  both.slots = 64;
  both.allocator_params["prefix_caching"] = false;
  both.kv_policy = "h2o";
  both.kv_policy_params = {{"budget", std::int64_t{8}}};
  const EngineResult r = run_engine(both, requests);
  for (const RequestTimeline& q : r.requests) {
    EXPECT_TRUE(q.finish_reason == "max_tokens" || q.finish_reason == "eos") << q.finish_reason;
  }
}

TEST(Engine, SchedulersSeeTheClockAtEachStepsStart) {
  EngineSetup setup;
  std::vector<double> shown;
  setup.sees = [&](const SchedulerInput& in) { shown.push_back(in.now_s); };
  std::vector<WorkloadRequest> requests = small_workload(5, 3);
  for (std::size_t i = 0; i < requests.size(); ++i)
    requests[i].arrival_s = 0.5 * static_cast<double>(i);
  const EngineResult result = run_engine(setup, requests);
  ASSERT_EQ(shown.size(), result.steps.size());  // every step here ran a batch
  for (std::size_t i = 0; i < shown.size(); ++i)
    EXPECT_DOUBLE_EQ(shown[i], result.steps[i].start_s) << "step " << i;
  EXPECT_GE(shown.back(), 1.0);  // the last arrival came at 1 s
}

TEST(Engine, PreemptionHappensUnderMemoryPressureAndTokensStillMatch) {
  EngineSetup setup;
  setup.slots = 40;  // 10 blocks of 4
  std::vector<WorkloadRequest> requests = small_workload(11, 6);
  for (auto& r : requests) {
    r.arrival_s = 0;
    r.output_tokens = 8;
    r.sampling.max_tokens = 8;
  }
  const EngineResult result = run_engine(setup, requests);
  std::int64_t preemptions = 0;
  for (const auto& t : result.requests) preemptions += t.preemptions;
  EXPECT_GT(preemptions, 0);
  const cpu::ReferenceModel reference(weights());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const auto expected = cpu::generate(reference, requests[i].prompt, requests[i].sampling);
    ASSERT_EQ(result.tokens[i].size(), expected.tokens.size()) << i;
    for (std::size_t t = 0; t < expected.tokens.size(); ++t)
      EXPECT_EQ(result.tokens[i][t], expected.tokens[t].token);
  }
  bool saw_preempt_event = false;
  for (const auto& event : result.events)
    saw_preempt_event |= event.kind == EventKind::event_preempt;
  EXPECT_TRUE(saw_preempt_event);
}

// A 16-bit KV pool: swapping moves its bytes (half of fp32's) and brings back exactly the K/V it
// held, so a run with swap preemption makes the tokens of the same pool never preempted.
TEST(Engine, HalfKvPoolsSwapTheirOwnBytesLosslessly) {
  std::vector<WorkloadRequest> requests = small_workload(11, 6);
  for (auto& r : requests) {
    r.arrival_s = 0;
    r.output_tokens = 8;
    r.sampling.max_tokens = 8;
    r.sampling.ignore_eos = true;  // the same lengths, so the same schedule, in every run
  }
  auto swapped_bytes = [](const EngineResult& result) {
    std::int64_t total = 0;
    for (const auto& t : result.requests) total += t.swapped_bytes;
    return total;
  };
  EngineSetup tight;
  tight.slots = 40;
  tight.swap_slots = 1000;
  tight.scheduler_params = {{"preemption", std::string("swap")}};
  const std::int64_t f32_bytes = swapped_bytes(run_engine(tight, requests));
  for (DType dtype : {DType::dtype_f16, DType::dtype_bf16}) {
    tight.kv_dtype = dtype;
    const EngineResult swapped = run_engine(tight, requests);
    EXPECT_GT(swapped_bytes(swapped), 0);
    EXPECT_EQ(2 * swapped_bytes(swapped), f32_bytes) << dtype_short_name(dtype);
    EngineSetup roomy;
    roomy.kv_dtype = dtype;
    const EngineResult unpreempted = run_engine(roomy, requests);
    EXPECT_EQ(swapped_bytes(unpreempted), 0);
    EXPECT_EQ(swapped.tokens, unpreempted.tokens) << dtype_short_name(dtype);
  }
}

// The tiny model with two heads of 32 (KIVI's groups need head_dim a multiple of 32).
const cpu::LlamaWeights& weights_head_dim_32() {
  static const cpu::LlamaWeights w = [] {
    ModelConfig c = model_preset("tiny");
    c.num_attention_heads = c.num_key_value_heads = 2;
    c.head_dim = 32;
    return test::scaled_random_weights(c, 99);
  }();
  return w;
}

// A KIVI pool (per-channel key groups of 32 slots, the newest in fp16 beside the pool until they
// leave the residual, 32 tokens here so that groups seal while the sequences run): swapping
// carries the sealed rows as stored and the open groups' fp16 rows, so a run with swap
// preemption makes the tokens of the same pool never preempted; freed blocks take their open
// groups with them (none is left once every request is done), and no sequence holds more than
// residual / 32 + 1 open groups. Prefix caching is off here: under KIVI a hit reads the cached
// block as it is then (sealed once its writer moved on), where the request's own prefill would
// have read its prompt in fp16, so hits change tokens (the next test).
TEST(Engine, KiviPoolsSwapTheirSealedAndOpenGroupsLosslessly) {
  SyntheticWorkload spec =
      spaced_workload(17, 6, weights_head_dim_32().config.vocab_size, {40, 70}, {12, 12});
  spec.prefix_groups = 2;
  spec.prefix_tokens = 32;
  std::vector<WorkloadRequest> requests = generate_workload(spec);
  for (auto& r : requests) {
    r.arrival_s = 0;
    r.sampling.max_tokens = r.output_tokens;
    r.sampling.ignore_eos = true;  // the same lengths, so the same schedule, in every run
  }
  for (DType dtype : {DType::dtype_kivi2, DType::dtype_kivi4}) {
    EngineSetup tight;
    tight.model = &weights_head_dim_32();
    tight.kv_dtype = dtype;
    tight.kivi_residual = 32;
    tight.allocator_params = {{"block_size", std::int64_t{32}}, {"prefix_caching", false}};
    tight.max_seq_len = 96;
    tight.slots = 160;  // 5 blocks: two or three sequences at once
    tight.swap_slots = 1000;
    tight.scheduler_params = {{"preemption", std::string("swap")}};
    EngineSetup roomy = tight;
    roomy.slots = 1024;
    const EngineResult swapped = run_engine(tight, requests),
                       unpreempted = run_engine(roomy, requests);
    std::int64_t swapped_bytes = 0;
    for (const auto& t : swapped.requests) swapped_bytes += t.swapped_bytes;
    EXPECT_GT(swapped_bytes, 0) << dtype_short_name(dtype);
    EXPECT_EQ(swapped.tokens, unpreempted.tokens) << dtype_short_name(dtype);
    std::int64_t peak = 0;
    for (const auto& s : swapped.steps) {
      peak = std::max(peak, s.kv_residual_bytes);
      const ModelConfig& c = weights_head_dim_32().config;  // K and V, 32 rows of fp16
      const std::int64_t group_bytes = 2 * c.num_hidden_layers * 32 * c.kv_dim() * 2;
      EXPECT_LE(s.kv_residual_bytes, s.running * kivi_most_open_groups(32) * group_bytes);
    }
    EXPECT_GT(peak, 0);
    EXPECT_EQ(swapped.steps.back().kv_residual_bytes, 0);
  }
}

// Quantize and evict: a KIVI pool under a KV policy (budget 40 a sequence of up to 110 tokens)
// finishes every request; the paged allocator's compaction moves kept rows between groups
// (KvPool::move_slot: requantized in their new group), the backend seals them again, and no
// sequence holds more open groups than the residual allows.
TEST(Engine, KiviPoolsRunUnderAKvPolicy) {
  const std::vector<WorkloadRequest> requests = generate_workload(
      spaced_workload(23, 6, weights_head_dim_32().config.vocab_size, {40, 70}, {40, 40}));
  for (const char* name : {"streaming_llm", "h2o"}) {
    EngineSetup setup;
    setup.model = &weights_head_dim_32();
    setup.kv_dtype = DType::dtype_kivi2;
    setup.kivi_residual = 32;
    setup.allocator_params = {{"block_size", std::int64_t{32}}, {"prefix_caching", false}};
    setup.max_seq_len = 128;
    setup.slots = 1024;
    setup.kv_policy = name;
    setup.kv_policy_params = {{"budget", std::int64_t{40}}};
    const EngineResult r = run_engine(setup, requests);
    SCOPED_TRACE(name);
    ASSERT_EQ(r.requests.size(), requests.size());
    for (const RequestTimeline& q : r.requests) EXPECT_EQ(q.finish_reason, "max_tokens");
    std::int64_t copied = 0;
    const ModelConfig& c = weights_head_dim_32().config;
    const std::int64_t group_bytes = 2 * c.num_hidden_layers * 32 * c.kv_dim() * 2;
    for (const StepRecord& step : r.steps) {
      EXPECT_LE(step.kv_residual_bytes, step.running * kivi_most_open_groups(32) * group_bytes);
      copied = std::max(copied, step.kv.bytes_copied);
    }
    EXPECT_GT(copied, 0);  // compaction moved kept rows
    EXPECT_EQ(r.steps.back().kv_residual_bytes, 0);
  }
}

TEST(Engine, SwapPreemptionKeepsTheKvAndTheTokens) {
  for (const char* victim : {"last_admitted", "most_kv"}) {
    EngineSetup setup;
    setup.slots = 40;
    setup.swap_slots = 1000;
    setup.scheduler_params = {{"preemption", std::string("swap")}, {"victim", std::string(victim)}};
    std::vector<WorkloadRequest> requests = small_workload(11, 6);
    for (auto& r : requests) {
      r.arrival_s = 0;
      r.output_tokens = 8;
      r.sampling.max_tokens = 8;
    }
    const EngineResult result = run_engine(setup, requests);
    std::int64_t swapped = 0, recomputed = 0, preemptions = 0;
    for (const auto& t : result.requests) {
      swapped += t.swapped_bytes;
      recomputed += t.recomputed_tokens;
      preemptions += t.preemptions;
    }
    EXPECT_GT(preemptions, 0) << victim;
    EXPECT_GT(swapped, 0) << victim;
    EXPECT_EQ(recomputed, 0) << victim << ": swapped requests resume without recomputing";
    const cpu::ReferenceModel reference(weights());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const auto expected = cpu::generate(reference, requests[i].prompt, requests[i].sampling);
      ASSERT_EQ(result.tokens[i].size(), expected.tokens.size()) << i;
      for (std::size_t t = 0; t < expected.tokens.size(); ++t)
        EXPECT_EQ(result.tokens[i][t], expected.tokens[t].token)
            << victim << " request " << i << " token " << t;
    }
  }
  // A full swap pool falls back to recompute, and says so.
  EngineSetup setup;
  setup.slots = 40;
  setup.swap_slots = 1;
  setup.scheduler_params = {{"preemption", std::string("swap")}};
  std::vector<WorkloadRequest> requests = small_workload(11, 6);
  for (auto& r : requests) r.arrival_s = 0, r.output_tokens = 8, r.sampling.max_tokens = 8;
  const EngineResult result = run_engine(setup, requests);
  bool swap_full = false;
  for (const auto& event : result.events) swap_full |= event.kind == EventKind::event_swap_full;
  EXPECT_TRUE(swap_full);
}

TEST(Engine, ConservationOverRandomWorkloads) {
  for (std::uint64_t seed = 0; seed < 12; ++seed) {
    std::vector<WorkloadRequest> requests = small_workload(100 + seed, 10);
    requests[seed % 10].output_tokens = 60;  // prompt + 60 > the 64-token context: must be rejected
    requests[seed % 10].sampling.max_tokens = 60;
    EngineSetup setup;
    setup.scheduler = seed % 2 ? "fcfs" : "priority";
    setup.slots = 48;
    const EngineResult result = run_engine(setup, requests);
    std::int64_t finished = 0, rejected = 0;
    for (const auto& t : result.requests) {
      if (t.rejected) {
        ++rejected;
        EXPECT_FALSE(t.reject_reason.empty());
      } else if (t.finish_s) {
        ++finished;
      }
    }
    EXPECT_EQ(finished + rejected, static_cast<std::int64_t>(requests.size())) << "seed " << seed;
    EXPECT_GE(rejected, 1) << "seed " << seed;
    EXPECT_TRUE(result.requests[seed % 10].rejected);
    EXPECT_NE(result.requests[seed % 10].reject_reason.find("exceed the context"),
              std::string::npos);
    EXPECT_EQ(result.steps.back().kv.used, 0) << "everything freed at the end";
  }
}

// The virtual and offline clocks price steps with a cost model; without one the engine says so
// before anything runs (there is no other time model).
TEST(Engine, PricedClocksNeedACostModel) {
  for (const EngineClock clock : {EngineClock::virtual_clock, EngineClock::offline}) {
    EngineSetup setup;
    setup.clock = clock;
    setup.cost_model = false;
    test::expect_error_containing([&] { run_engine(setup, small_workload(1, 2)); },
                                  {"cost model", "hardware profile"});
  }
}

// Requests for speculative decoding: prompts repeating a 5-token pattern, so prompt lookup
// proposes from the first decode on, on an unscaled random tiny model whose greedy outputs
// fall into loops for some prompts (proposals accepted) and not for others (rejected).
const cpu::LlamaWeights& looping_model() {
  static const cpu::LlamaWeights model = cpu::random_llama_weights(model_preset("tiny"), 5);
  return model;
}

// The looping model on `allocator` (paged with 4-token blocks, the others with their defaults).
EngineSetup looping_setup(const char* allocator) {
  EngineSetup setup;
  setup.model = &looping_model();
  setup.allocator = allocator;
  if (std::string(allocator) != "paged") setup.allocator_params.clear();
  return setup;
}

std::vector<WorkloadRequest> patterned_requests() {
  std::vector<WorkloadRequest> requests;
  for (std::int32_t i = 0; i < 6; ++i) {
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = 0.002 * i;
    for (std::int32_t t = 0; t < 12 + 2 * i; ++t) r.prompt.push_back(3 + (t % 5) * 7 + i);
    r.output_tokens = r.sampling.max_tokens = 12 + i;
    r.sampling.ignore_eos = true;
    requests.push_back(r);
  }
  return requests;
}

std::pair<std::int64_t, std::int64_t> proposed_and_accepted(const EngineResult& result) {
  std::int64_t proposed = 0, accepted = 0;
  for (const StepRecord& s : result.steps) {
    proposed += s.proposed_tokens;
    accepted += s.accepted_tokens;
    EXPECT_LE(s.accepted_tokens, s.proposed_tokens);
  }
  return {proposed, accepted};
}

// Speculative decoding (prompt lookup, 4 proposals) in every allocator: the greedy tokens of
// decoding without it, proposals both accepted and rejected (the rejected ones rolled back),
// fewer steps, and every slot returned at the end.
TEST(Engine, SpeculationGivesTheTokensOfPlainDecodingInEveryAllocator) {
  const std::vector<WorkloadRequest> requests = patterned_requests();
  for (const char* allocator : {"static", "dynamic", "paged"}) {
    SCOPED_TRACE(allocator);
    EngineSetup setup = looping_setup(allocator);
    const EngineResult plain = run_engine(setup, requests);
    setup.speculation.tokens = 4;
    const EngineResult speculative = run_engine(setup, requests);
    EXPECT_EQ(speculative.tokens, plain.tokens);
    const auto [proposed, accepted] = proposed_and_accepted(speculative);
    EXPECT_GT(accepted, 0) << "some proposals accepted";
    EXPECT_LT(accepted, proposed) << "some rejected, and rolled back";
    EXPECT_LT(speculative.steps.size(), plain.steps.size());
    EXPECT_EQ(speculative.steps.back().kv.used, 0) << "every slot returned";
  }
}

// A proposer plugin that answers more tokens than asked, or a token outside the vocabulary, stops
// the run with an error naming it, the step and the request, before the scheduler sees the
// proposals; one that answers within the ask speculates (every request asked at most once a step).
class ScriptedProposer final : public Proposer {
 public:
  explicit ScriptedProposer(std::int32_t token, std::int64_t extra)
      : token_(token), extra_(extra) {}
  void propose(std::span<const ProposeAsk> asks) override {
    std::set<RequestId> asked;
    for (const ProposeAsk& ask : asks) {
      EXPECT_TRUE(asked.insert(ask.request->id).second) << "asked twice in one step";
      EXPECT_TRUE(ask.proposed->empty());
      ask.proposed->assign(static_cast<std::size_t>(ask.max_tokens + extra_), token_);
    }
    ++calls;
  }
  int calls = 0;

 private:
  std::int32_t token_;
  std::int64_t extra_;
};

TEST(Engine, AProposersAnswerBeyondItsAskIsAClearError) {
  const std::vector<WorkloadRequest> requests = patterned_requests();
  EngineSetup setup = looping_setup("paged");
  setup.speculation.tokens = 3;
  ScriptedProposer too_many(5, 1), outside(100000, 0), fine(5, 0);
  setup.proposer = &too_many;
  test::expect_error_containing([&] { (void)run_engine(setup, requests); },
                                {"the proposer answered request", "proposals (asked for at most"});
  setup.proposer = &outside;
  test::expect_error_containing([&] { (void)run_engine(setup, requests); }, {"one of them 100000"});
  setup.proposer = &fine;
  const EngineResult plain = run_engine(looping_setup("paged"), requests);
  EXPECT_EQ(run_engine(setup, requests).tokens, plain.tokens);
  EXPECT_GT(fine.calls, 0);
}

// Requests asking for log-probabilities speculate too: each token's logprob and top 3 are those
// of the row that scored it, so they equal decoding's. Tolerance 1e-5 (a verify's rows go
// through products of more rows than a decode's; the top alternatives' ids are compared where
// their logprobs are 1e-4 apart, not near-ties).
TEST(Engine, SpeculationGivesEachTokenTheLogprobsOfPlainDecoding) {
  std::vector<WorkloadRequest> requests = patterned_requests();
  for (WorkloadRequest& r : requests) r.sampling.logprobs = 3;
  EngineSetup setup = looping_setup("paged");
  const EngineResult plain = run_engine(setup, requests);
  setup.speculation.tokens = 4;
  const EngineResult speculative = run_engine(setup, requests);
  ASSERT_EQ(speculative.tokens, plain.tokens);
  EXPECT_GT(proposed_and_accepted(speculative).second, 0) << "some proposals accepted";
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_EQ(speculative.logprobs[i].size(), plain.tokens[i].size()) << "request " << i;
    for (std::size_t t = 0; t < plain.tokens[i].size(); ++t) {
      const GeneratedLogprobs &want = plain.logprobs[i][t], &got = speculative.logprobs[i][t];
      EXPECT_NEAR(got.logprob, want.logprob, 1e-5) << "request " << i << ", token " << t;
      ASSERT_EQ(got.top.size(), 3u);
      for (std::size_t k = 0; k < 3; ++k) {
        EXPECT_NEAR(got.top[k].logprob, want.top[k].logprob, 1e-5);
        const bool tie = k + 1 < 3 && want.top[k].logprob - want.top[k + 1].logprob < 1e-4;
        if (!tie && (k == 0 || want.top[k - 1].logprob - want.top[k].logprob >= 1e-4)) {
          EXPECT_EQ(got.top[k].token, want.top[k].token) << "request " << i << ", token " << t;
        }
      }
    }
  }
}

// Sampled requests speculate too (rejection sampling, verify_sampled: the distribution test is
// Sampling.SpeculativeSamplingEmitsTheTargetsDistributionAtEachPosition): in every allocator
// each request gets all its tokens, proposals are accepted and rejected, every slot returns.
TEST(Engine, SampledRequestsSpeculateAndEndWithEveryToken) {
  std::vector<WorkloadRequest> requests = patterned_requests();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].sampling.temperature = 0.02;  // the random model's logits are flat: sharpened
    requests[i].sampling.seed = 100 + i;
  }
  for (const char* allocator : {"static", "dynamic", "paged"}) {
    SCOPED_TRACE(allocator);
    EngineSetup setup = looping_setup(allocator);
    setup.speculation.tokens = 4;
    const EngineResult result = run_engine(setup, requests);
    for (std::size_t i = 0; i < requests.size(); ++i)
      EXPECT_EQ(std::ssize(result.tokens[i]), requests[i].output_tokens) << "request " << i;
    const auto [proposed, accepted] = proposed_and_accepted(result);
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, proposed);
    EXPECT_EQ(result.steps.back().kv.used, 0);
  }
}

// Prefix caching keeps only verified KV under the verified tokens' hashes: a second wave of
// requests, each prompt a first-wave request's whole sequence (prompt and output), hits the
// cache for exactly the blocks it hits after the same first wave without speculation, and
// generates the same tokens.
TEST(Engine, SpeculationCachesOnlyVerifiedBlocksForPrefixReuse) {
  EngineSetup setup;
  setup.model = &looping_model();
  setup.slots = 1024;
  setup.allocator_params["prefix_caching"] = true;
  const std::vector<WorkloadRequest> first = patterned_requests();
  const EngineResult first_plain = run_engine(setup, first);
  std::vector<WorkloadRequest> both = first;
  for (std::size_t i = 0; i < first.size(); ++i) {
    WorkloadRequest again = first[i];
    again.id = static_cast<RequestId>(first.size() + i);
    again.arrival_s = 1.0 + 0.002 * static_cast<double>(i);  // after the first wave finished
    again.prompt.insert(again.prompt.end(), first_plain.tokens[i].begin(),
                        first_plain.tokens[i].end());
    again.output_tokens = again.sampling.max_tokens = 4;
    both.push_back(again);
  }
  const EngineResult without = run_engine(setup, both);
  setup.speculation.tokens = 4;
  const EngineResult with = run_engine(setup, both);
  EXPECT_EQ(with.tokens, without.tokens);
  const auto [proposed, accepted] = proposed_and_accepted(with);
  EXPECT_LT(accepted, proposed) << "some proposals rejected";
  for (std::size_t i = first.size(); i < both.size(); ++i) {
    EXPECT_GT(without.requests[i].prefix_hit_tokens, 0) << "request " << i;
    EXPECT_EQ(with.requests[i].prefix_hit_tokens, without.requests[i].prefix_hit_tokens)
        << "request " << i;
  }
}

// The simulated proposer replays a measured accept trace (accept_trace): each verify's run of
// right proposals is one of the trace's, so an all-or-nothing trace (half its verifies of 4 accept
// none, half all 4) gives runs of 0 or 4 and never 1-3, about half each (within 0.03 over 4,000
// verifies); 2 proposals are 0 or 2; 8 chain a second draw after a whole run (0, 4 or 8).
TEST(Speculation, TheSimulatedProposerReplaysAnAcceptTrace) {
  test::TempDir dir;
  std::string text = "request,step,proposed,accepted\n";
  for (int i = 0; i < 50; ++i) text += fmt::format("{},1,4,{}\n", i, i % 2 == 0 ? 0 : 4);
  test::write_file(dir / "verifies.csv", text);
  SpeculationOptions options;
  options.proposer = "simulated";
  options.accept_trace = (dir / "verifies.csv").string();
  options.seed = 3;
  const std::vector<std::int32_t> eos{2};
  const std::unique_ptr<Proposer> proposer = make_proposer(options, 1000, eos);
  const SimulatedBackend target(1000, eos);
  std::map<std::int64_t, std::map<std::int64_t, int>> runs;  // proposals -> run -> count
  for (int v = 0; v < 4000; ++v)
    for (const std::int64_t k : {2, 4, 8}) {
      RequestState r;
      r.id = v % 89;
      r.tokens.assign(static_cast<std::size_t>(5 + v / 89), 7);
      const std::vector<std::int32_t> proposed = proposer->propose_one(r, k);
      std::int64_t run = 0;
      for (std::int32_t last = r.tokens.back(); run < k; ++run) {
        if (proposed[static_cast<std::size_t>(run)] !=
            target.token_after(last, r.length() - 1 + run))
          break;
        last = proposed[static_cast<std::size_t>(run)];
      }
      ++runs[k][run];
    }
  EXPECT_EQ(runs[4].size(), 2u);
  EXPECT_NEAR(runs[4][0] / 4000.0, 0.5, 0.03);
  EXPECT_NEAR(runs[4][4] / 4000.0, 0.5, 0.03);
  EXPECT_EQ(runs[2].size(), 2u);
  EXPECT_EQ(runs[2][0] + runs[2][2], 4000);
  EXPECT_EQ(runs[8].size(), 3u);
  EXPECT_NEAR(runs[8][8] / 4000.0, 0.25, 0.03);
}

// A bad accept trace is an error naming the file, the line and what is wrong; a header written
// by a spreadsheet (a byte order mark, spaces) is read.
TEST(Speculation, ABadAcceptTraceIsAClearError) {
  test::TempDir dir;
  const auto error = [&](const std::string& text) {
    test::write_file(dir / "t.csv", text);
    return test::error_of<Error>([&] { (void)load_accept_trace(dir / "t.csv"); });
  };
  EXPECT_NE(error("proposed,taken\n4,1\n").find("no \"accepted\" column"), std::string::npos);
  EXPECT_NE(error("proposed,accepted\n4,5\n").find("t.csv:2: proposed must be in [1, 64]"),
            std::string::npos);
  EXPECT_NE(error("proposed,accepted\n0,0\n").find("proposed must be in"), std::string::npos);
  EXPECT_NE(error("proposed,accepted\n4,x\n").find("accepted \"x\" is not a valid number"),
            std::string::npos);
  EXPECT_NE(error("proposed,accepted\n4\n").find("1 cells, the header has 2"), std::string::npos);
  EXPECT_NE(error("proposed,accepted\n").find("holds no verifies"), std::string::npos);
  // A byte order mark and spaces around the header's names are no error (as in workload traces).
  test::write_file(dir / "ok.csv", "\xEF\xBB\xBFrequest, proposed ,accepted\n0,4,2\n");
  const std::vector<AcceptRecord> read = load_accept_trace(dir / "ok.csv");
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0].proposed, 4);
  EXPECT_EQ(read[0].accepted, 2);
  EXPECT_NE(test::error_of<Error>([&] {
              (void)load_accept_trace(dir / "missing.csv");
            }).find("cannot read the accept trace"),
            std::string::npos);
}

// A measured adaptive length's prices (StepTimes): the moving mean at a count run (a quarter's
// weight to the newest), interpolated between counts, the line through the two smallest below
// them (kept between flat and proportional), and no price above every count or below the only
// one. Exact arithmetic on these inputs; EXPECT_DOUBLE_EQ's 4 ulps where it is not.
TEST(Speculation, StepTimesPriceAStepFromTheStepsRunSoFar) {
  StepTimes times;
  EXPECT_FALSE(times.seconds(8).has_value());
  times.observe(16, 0.010);
  EXPECT_DOUBLE_EQ(*times.seconds(16), 0.010);
  EXPECT_FALSE(times.seconds(8).has_value());   // below the only count: how does it shrink?
  EXPECT_FALSE(times.seconds(17).has_value());  // above every count: run it and see
  times.observe(16, 0.014);                     // 0.010 + (0.014 - 0.010) / 4
  EXPECT_DOUBLE_EQ(*times.seconds(16), 0.011);
  times.observe(48, 0.019);
  EXPECT_DOUBLE_EQ(*times.seconds(32), 0.015);  // halfway between 0.011 and 0.019
  EXPECT_DOUBLE_EQ(*times.seconds(8), 0.009);   // the line: 0.011 - 8 x 0.00025
  times.observe(-1, 5.0);                       // no tokens, or no time: not a step
  times.observe(4, std::nan(""));
  EXPECT_DOUBLE_EQ(*times.seconds(8), 0.009);
  StepTimes steep;
  steep.observe(16, 0.010);
  steep.observe(32, 0.030);
  EXPECT_DOUBLE_EQ(*steep.seconds(4), 0.010 / 4);  // the line would go below proportional
  StepTimes falling;
  falling.observe(16, 0.010);
  falling.observe(32, 0.008);
  EXPECT_DOUBLE_EQ(*falling.seconds(4), 0.010);  // ... or above the smallest count's time
}

// Adaptive lengths per request: decode i's j-th proposal adds a_i^j expected tokens, and the
// step's seconds grow with the proposals in all; the best set is the best proposals first. Two
// decodes, acceptances 0.9 and 0.2, up to 4 proposals each. A flat price (memory-bound): every
// proposal of both (within each one's room). Each proposal costing a decode's token: none (even
// at 0.99 each: 9.80 tokens in the time of 10). A quarter of a decode each: the
// 0.9 request's 4 (5.10 tokens in 3.0: 1.70 a unit, the best; its 4th adds 0.66 for 0.25) and
// none of the 0.2 one's (its first would add 0.2 for 0.25).
TEST(Speculation, AdaptiveLengthsGiveEachRequestTheProposalsThatPay) {
  const std::vector<double> acceptance{0.9, 0.2};
  const std::vector<std::int64_t> room{4, 4}, short_room{2, 4};
  const auto total = [](std::span<const std::int64_t> proposing) {
    return static_cast<double>(std::accumulate(proposing.begin(), proposing.end(), 0L));
  };
  const auto flat = [](std::span<const std::int64_t>) { return 2.0; };
  EXPECT_EQ(adaptive_proposal_lengths(flat, acceptance, room), (std::vector<std::int64_t>{4, 4}));
  EXPECT_EQ(adaptive_proposal_lengths(flat, acceptance, short_room),
            (std::vector<std::int64_t>{2, 4}));
  const auto linear = [&](std::span<const std::int64_t> p) { return 2.0 + total(p); };
  EXPECT_EQ(adaptive_proposal_lengths(linear, acceptance, room), (std::vector<std::int64_t>{0, 0}));
  const std::vector<double> sure{0.99, 0.99};
  EXPECT_EQ(adaptive_proposal_lengths(linear, sure, room), (std::vector<std::int64_t>{0, 0}));
  const auto quarter = [&](std::span<const std::int64_t> p) { return 2.0 + 0.25 * total(p); };
  EXPECT_EQ(adaptive_proposal_lengths(quarter, acceptance, room),
            (std::vector<std::int64_t>{4, 0}));
  // A drafter's step (0.5) per depth anyone proposes at, and 0.1 a verified proposal: the 0.9
  // request's 4 pay for 4 draft steps (5.10 tokens in 4.4), and the 0.2 request's first rides on
  // the first of them (5.30 in 4.5: 1.18 a unit against 1.16); its second would not (5.34 in 4.6).
  const auto drafted = [&](std::span<const std::int64_t> p) {
    const auto depths = std::count_if(p.begin(), p.end(), [](std::int64_t n) { return n > 0; });
    return 2.0 + 0.1 * total(p) + 0.5 * static_cast<double>(depths);
  };
  EXPECT_EQ(adaptive_proposal_lengths(drafted, acceptance, room),
            (std::vector<std::int64_t>{4, 1}));
}

// The simulated proposer: each proposal is the simulated target's own token at its position
// with probability acceptance_rate, so the accepted prefix of 4 averages 0.75 + 0.75^2 + ...
// + 0.75^4 = 2.05 tokens (within 3% over 20,000 verifies), and a wrong proposal is never the
// target's token.
TEST(Speculation, TheSimulatedProposerIsRightAtItsAcceptanceRate) {
  SpeculationOptions options;
  options.proposer = "simulated";
  options.acceptance_rate = 0.75;
  options.tokens = 4;
  options.seed = 11;
  const std::vector<std::int32_t> eos{2};
  const std::unique_ptr<Proposer> proposer = make_proposer(options, 1000, eos);
  const SimulatedBackend target(1000, eos);
  double accepted = 0;
  const int verifies = 20000;
  for (int v = 0; v < verifies; ++v) {
    RequestState r;
    r.id = v % 97;
    r.tokens.assign(static_cast<std::size_t>(5 + v / 97), 7);
    r.tokens.back() = v % 1000;
    const std::vector<std::int32_t> proposed = proposer->propose_one(r, 4);
    ASSERT_EQ(proposed.size(), 4u);
    std::int32_t last = r.tokens.back();
    for (std::size_t j = 0; j < proposed.size(); ++j) {
      const std::int32_t want =
          target.token_after(last, r.length() - 1 + static_cast<std::int64_t>(j));
      if (proposed[j] != want) break;
      ++accepted;
      last = proposed[j];
    }
  }
  EXPECT_NEAR(accepted / verifies, expected_tokens_per_verify(0.75, 4) - 1, 0.03 * 2.05);
  EXPECT_DOUBLE_EQ(expected_tokens_per_verify(0.5, 2), 1.75);
}

// The paced clock (kvlab serve on the simulated backend) starts a step that an arrival starts at
// that arrival, not when the engine thread woke to it: the simulated hardware has no wake-up.
// Woken more than 50 ms late, the lateness counts (the host really fell behind).
TEST(Engine, ThePacedClockStartsAnIdleEnginesStepAtTheArrivalThatWokeIt) {
  using namespace std::chrono;
  const auto before = steady_clock::now();  // the clock starts after it: its time reads less
  const std::unique_ptr<Clock> clock = make_clock(EngineClock::paced);
  std::this_thread::sleep_for(milliseconds(20));
  const double now_here = duration<double>(steady_clock::now() - before).count();
  // Arrived 10 ms ago, the engine thread woke now (a live engine's catch_up before the step).
  clock->catch_up(now_here - 0.01, false);
  EXPECT_DOUBLE_EQ(clock->now(), now_here - 0.01);
  // Nothing to receive (an idle wait that timed out, a cancel): the present.
  std::this_thread::sleep_for(milliseconds(10));
  clock->catch_up(std::nullopt, false);
  EXPECT_GE(clock->now(), now_here + 0.01);
  // An arrival 80 ms before the wake-up: woken that late, the lateness is real.
  std::this_thread::sleep_for(milliseconds(90));
  const double later = duration<double>(steady_clock::now() - before).count();
  clock->catch_up(later - 0.08, false);
  EXPECT_GT(clock->now(), later - 0.08 + 0.05);
  // The idle wait until a known arrival (the wall clock sleeps until it): the arrival, unless the
  // sleep overshot by more than 50 ms.
  const double arrival = clock->now() + 0.01;
  clock->idle_until(arrival);
  EXPECT_TRUE(clock->now() == arrival || clock->now() > arrival + 0.05) << clock->now();
}

// A paced step that the host finishes after its price: late by up to 50 ms (a hiccup: another
// thread had the core) it still ends on schedule, and the steps after it run without sleeping
// until the schedule is caught up (a busy engine's catch_up keeps the schedule too); later than
// that, it ends when it really did.
TEST(Engine, ThePacedClockKeepsItsScheduleThroughAHostHiccup) {
  using namespace std::chrono;
  const std::unique_ptr<Clock> clock = make_clock(EngineClock::paced);
  StepTiming step;
  step.predicted_s = 0.001;
  clock->catch_up(std::nullopt, false);
  const double start = clock->now();
  const auto host_start = steady_clock::now();
  std::this_thread::sleep_for(milliseconds(11));  // the host: 10 ms past the step's price
  EXPECT_DOUBLE_EQ(clock->advance(step), 0.001);
  EXPECT_DOUBLE_EQ(clock->now(), start + 0.001);
  clock->catch_up(std::nullopt, true);  // the next step, straight after: still on schedule
  EXPECT_DOUBLE_EQ(clock->now(), start + 0.001);
  for (int i = 0; i < 20; ++i) EXPECT_DOUBLE_EQ(clock->advance(step), 0.001);
  // 21 steps of 1 ms in the clock, and at least as long on the host (it slept once caught up).
  EXPECT_DOUBLE_EQ(clock->now(), start + 0.021);
  EXPECT_GE(duration<double>(steady_clock::now() - host_start).count(), 0.02);
  // 80 ms past the schedule: the host cannot keep the pace; the step ends when it really did.
  const double late_start = clock->now();
  std::this_thread::sleep_for(milliseconds(81));
  EXPECT_GT(clock->advance(step), 0.05);
  EXPECT_GT(clock->now(), late_start + 0.05);
}

// Static batching as the literature runs it: a finished request stays in its batch as padding.
// Same batches and tokens as without padding (the pool is ample), but each step is priced with
// the padding rows, their KV stays held until the batch ends, and nothing is left at the end.
TEST(Engine, PaddedStaticBatchHoldsFinishedRowsUntilTheBatchEnds) {
  std::vector<WorkloadRequest> requests = small_workload(5, 12);
  for (std::size_t i = 0; i < requests.size(); ++i) {  // the spread static batching pays for
    requests[i].arrival_s = 0;
    requests[i].output_tokens = requests[i].sampling.max_tokens = i % 3 == 0 ? 24 : 2;
    requests[i].sampling.ignore_eos = true;
  }
  EngineSetup padded, unpadded;
  padded.scheduler = unpadded.scheduler = "static";
  padded.scheduler_params = {{"max_batch", std::int64_t{4}}, {"padding", true}};
  unpadded.scheduler_params = {{"max_batch", std::int64_t{4}}, {"padding", false}};
  padded.slots = unpadded.slots = 512;
  // No shared prefix blocks, so that a padding row's slots are its own (exact accounting).
  padded.allocator_params =
      unpadded.allocator_params = {{"block_size", std::int64_t{4}}, {"prefix_caching", false}};
  const EngineResult a = run_engine(padded, requests), b = run_engine(unpadded, requests);
  EXPECT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.steps.size(), b.steps.size());  // the same batches, step for step
  std::int64_t padded_rows = 0;
  for (std::size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_EQ(b.steps[i].padding, 0);
    EXPECT_GE(a.steps[i].predicted_s, b.steps[i].predicted_s) << "step " << i;
    if (a.steps[i].padding > 0) {
      EXPECT_GT(a.steps[i].predicted_s, b.steps[i].predicted_s);
    }
    EXPECT_EQ(a.steps[i].kv.used, b.steps[i].kv.used + a.steps[i].padding_slots) << "step " << i;
    padded_rows += a.steps[i].padding;
  }
  EXPECT_GT(padded_rows, 0);
  EXPECT_GT(a.duration_s, b.duration_s);
  EXPECT_EQ(a.steps.back().kv.used, 0) << "the last batch's padding is freed";
  EXPECT_EQ(a.steps.back().padding_slots, 0);
}

// Counts what each forward received (entries, and each entry's tokens, start position and
// whether it writes K/V).
class RecordingBackend final : public Backend {
 public:
  struct Entry {
    std::int64_t start = 0, tokens = 0;
    KvView view;
    bool writes_kv = true;
  };
  explicit RecordingBackend(cpu::CpuBackend& inner) : inner_(inner) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    auto& forward = forwards.emplace_back();
    for (const BatchEntry& e : batch)
      forward.push_back(
          {e.start_position, static_cast<std::int64_t>(e.tokens.size()), e.view, e.writes_kv});
    return inner_.forward(batch, choices);
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  std::vector<std::vector<Entry>> forwards;

 private:
  cpu::CpuBackend& inner_;
};

// A padded static batch of 4 on the tiny model's CPU backend, every forward recorded.
struct PaddedStaticRun {
  PaddedStaticRun(EngineClock clock, const std::vector<WorkloadRequest>& requests)
      : pool({weights().config.num_hidden_layers, weights().config.num_key_value_heads,
              weights().config.head_dim, 512}),
        inner(weights(), pool, std::nullopt),
        recorder(inner) {
    const ModelConfig& c = weights().config;
    PluginContext context;
    context.pool = &pool;
    context.model = &c;
    context.max_seq_len = 64;
    auto allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
        "paged", {{"block_size", std::int64_t{4}}}, context);
    auto scheduler = test::plugin_registry().create<PluginKind::scheduler>(
        "static", {{"max_batch", std::int64_t{4}}, {"padding", true}}, context);
    const CostModel cost(c, load_hardware_profile("cpu"));
    EngineOptions options;
    options.clock = clock;
    options.cost_model = &cost;
    options.rules.context = 64;
    options.pool = &pool;
    result = Engine(recorder, *allocator, *scheduler, options).run(requests);
  }
  KvPool pool;
  cpu::CpuBackend inner;
  RecordingBackend recorder;
  EngineResult result;
};

// What a recorded forward is to the cost model: its entries as BatchEntries (placeholder
// tokens: the cost model counts them).
StepWork work_of(const CostModel& cost, const std::vector<RecordingBackend::Entry>& forward) {
  std::vector<std::vector<std::int32_t>> tokens;
  std::vector<BatchEntry> batch;
  for (const auto& e : forward) {
    tokens.emplace_back(static_cast<std::size_t>(e.tokens), 0);
    batch.push_back({tokens.back(), e.start, e.view, e.writes_kv});
  }
  return cost.work(batch);
}

// On a clock that times the backend (measured), a padded static batch's finished rows are
// computed too, as the cost model prices them on every clock: each step's forward gets the batch
// and then one 1-token row per padding request, a pad token one position further each step
// (attending to one more key each step, as Hugging Face generate()'s pad tokens), writing no
// K/V. Its forwards hold exactly the work the cost model priced for the batch and its padding.
// The requests' own tokens are those of a virtual-clock run, where the backend gets the batch
// alone.
TEST(Engine, MeasuredClockComputesThePaddingRows) {
  std::vector<WorkloadRequest> requests = small_workload(5, 12);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].arrival_s = 0;
    requests[i].output_tokens = requests[i].sampling.max_tokens = i % 3 == 0 ? 20 : 2;
    requests[i].sampling.ignore_eos = true;
  }
  // Request 1's pad tokens reach the model's last position (63) while request 0 runs on: they
  // stay there, in the price and in the forward.
  requests[0].output_tokens = requests[0].sampling.max_tokens = 40;
  requests[1].prompt.resize(50, requests[1].prompt.back());
  PaddedStaticRun measured_run(EngineClock::measured, requests);
  PaddedStaticRun priced_run(EngineClock::virtual_clock, requests);
  const EngineResult &measured = measured_run.result, &priced = priced_run.result;
  const RecordingBackend *measured_backend = &measured_run.recorder,
                         *virtual_backend = &priced_run.recorder;
  EXPECT_EQ(measured.tokens, priced.tokens);
  ASSERT_EQ(measured_backend->forwards.size(), measured.steps.size());
  const CostModel cost(weights().config, load_hardware_profile("cpu"));
  std::int64_t padding_rows = 0, rows_at_the_last_position = 0;
  for (std::size_t i = 0; i < measured.steps.size(); ++i) {
    const StepRecord& step = measured.steps[i];
    const auto& forward = measured_backend->forwards[i];
    ASSERT_EQ(static_cast<std::int64_t>(forward.size()), step.batch + step.padding) << i;
    for (std::size_t e = 0; e < forward.size(); ++e) {
      const bool padding = e >= static_cast<std::size_t>(step.batch);
      EXPECT_EQ(forward[e].writes_kv, !padding) << "step " << i << " entry " << e;
      EXPECT_GT(forward[e].view.end_position(), forward[e].start + forward[e].tokens - 1)
          << "step " << i << " entry " << e << ": the view maps the row's positions";
      if (padding) {
        EXPECT_EQ(forward[e].tokens, 1) << "step " << i << ": a padding row decodes one";
        EXPECT_LE(forward[e].start, 63) << "step " << i << ": within the model's context";
        rows_at_the_last_position += forward[e].start == 63;
      }
    }
    const StepWork computed = work_of(cost, forward);
    EXPECT_EQ(computed.attention_decode.bytes, step.work.attention_decode.bytes) << "step " << i;
    EXPECT_EQ(computed.attention_decode.flops, step.work.attention_decode.flops) << "step " << i;
    EXPECT_EQ(computed.tokens, step.work.tokens) << "step " << i;
    padding_rows += step.padding;
  }
  EXPECT_GT(padding_rows, 0);
  EXPECT_GT(rows_at_the_last_position, 1);
  for (std::size_t i = 0; i < priced.steps.size(); ++i)
    EXPECT_EQ(static_cast<std::int64_t>(virtual_backend->forwards[i].size()),
              priced.steps[i].batch);
  EXPECT_EQ(measured.steps.back().kv.used, 0);
}

// Padding holds KV, so a padded static batch in a tight pool preempts; when preemption empties
// the batch, its padding is freed and the batch forms again: nothing is rejected (it once was:
// "not admitted even with nothing running" while padding still held the pool).
TEST(Engine, PaddedStaticBatchThatPreemptsLosesNothing) {
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    std::vector<WorkloadRequest> requests = small_workload(40 + seed, 16);
    for (std::size_t i = 0; i < requests.size(); ++i) {
      requests[i].arrival_s = 0;
      requests[i].output_tokens = requests[i].sampling.max_tokens = i % 2 ? 3 : 30;
      requests[i].sampling.ignore_eos = true;
    }
    EngineSetup setup;
    setup.scheduler = "static";
    setup.scheduler_params = {{"max_batch", std::int64_t{8}}, {"padding", true}};
    setup.slots = 96;
    const EngineResult result = run_engine(setup, requests);
    std::int64_t preemptions = 0;
    for (const auto& t : result.requests) {
      EXPECT_FALSE(t.rejected) << "seed " << seed << ": " << t.reject_reason;
      preemptions += t.preemptions;
    }
    EXPECT_EQ(result.steps.back().kv.used, 0) << "seed " << seed;
    if (seed == 0) {
      EXPECT_GT(preemptions, 0) << "the pool is tight enough to preempt";
    }
  }
}

// A step extension of the test's own (EngineOptions::extensions; engine.cpp untouched): each
// hook it is called at, with the step and what it saw there.
class RecordingExtension final : public StepExtension {
 public:
  struct Call {
    std::string hook;
    std::int64_t step = -1;
    std::int64_t seen = -1;  // the batch's entries, the finished requests held, the request
  };
  std::vector<Call> calls;
  std::int64_t extra_row_position = -1;  // >= 0: each step also costs a decode row there

  void on_leave(StepState& step, RequestId id) override {
    calls.push_back({"leave", step.step, id});
  }
  void before_plan(StepState& step) override { calls.push_back({"before_plan", step.step}); }
  void shape_batch(StepState& step, std::vector<BatchEntry>& batch) override {
    EXPECT_EQ(batch.size(), step.applied->batch.size()) << "no extension before it adds rows";
    calls.push_back({"shape_batch", step.step, static_cast<std::int64_t>(batch.size())});
  }
  void price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) override {
    (void)timing;
    if (extra_row_position >= 0) rows.push_back({1, extra_row_position, 0, 1});
    calls.push_back({"price", step.step});
  }
  void after_forward(StepState& step, std::span<const BatchEntry> requests,
                     const ForwardResult& result) override {
    (void)result;
    EXPECT_GT(step.record.duration_s, 0) << "the step is priced before after_forward";
    calls.push_back({"after_forward", step.step, static_cast<std::int64_t>(requests.size())});
  }
  void after_update(StepState& step, std::span<const RequestId> held) override {
    calls.push_back({"after_update", step.step, static_cast<std::int64_t>(held.size())});
  }
  void finish(EngineResult& result) override {
    calls.push_back({"finish", static_cast<std::int64_t>(result.steps.size())});
  }
};

// The socket's documented order, step after step: before_plan, shape_batch (one entry a request
// of the batch), price, after_forward, after_update; finish once at the end. An extension that
// only watches changes nothing: the same tokens and times as without it.
TEST(StepExtension, HooksRunInTheDocumentedOrderEachStep) {
  const auto requests = small_workload(5, 8);
  EngineSetup setup;
  const EngineResult plain = run_engine(setup, requests);
  RecordingExtension recorder;
  setup.extensions = {&recorder};
  const EngineResult watched = run_engine(setup, requests);
  EXPECT_EQ(watched.tokens, plain.tokens);
  EXPECT_EQ(watched.duration_s, plain.duration_s);
  ASSERT_FALSE(recorder.calls.empty());
  EXPECT_EQ(recorder.calls.back().hook, "finish");
  EXPECT_EQ(recorder.calls.back().step, static_cast<std::int64_t>(watched.steps.size()));
  const std::vector<std::string> order = {"shape_batch", "price", "after_forward", "after_update"};
  std::size_t ran = 0;
  for (std::size_t i = 0; i + 1 < recorder.calls.size(); ++i) {
    if (recorder.calls[i].hook != "before_plan" || recorder.calls[i + 1].hook == "before_plan")
      continue;  // (a step that idled: no batch)
    const std::int64_t step = recorder.calls[i].step;
    const auto record = std::find_if(watched.steps.begin(), watched.steps.end(),
                                     [&](const StepRecord& r) { return r.step == step; });
    ASSERT_NE(record, watched.steps.end()) << "step " << step;
    for (std::size_t h = 0; h < order.size(); ++h) {
      ASSERT_LT(i + 1 + h, recorder.calls.size());
      const RecordingExtension::Call& call = recorder.calls[i + 1 + h];
      EXPECT_EQ(call.hook, order[h]) << "step " << step;
      EXPECT_EQ(call.step, step);
      if (call.hook == "shape_batch" || call.hook == "after_forward") {
        EXPECT_EQ(call.seen, record->batch) << call.hook << " at step " << step;
      }
    }
    ++ran;
  }
  EXPECT_EQ(ran, watched.steps.size()) << "every recorded step ran through the hooks";
}

// What an extension prices, the virtual clock charges: a decode row more a step makes each step
// cost more, and the tokens stay the same.
TEST(StepExtension, RowsAnExtensionPricesLengthenTheSteps) {
  const auto requests = small_workload(6, 6);
  EngineSetup setup;
  const EngineResult plain = run_engine(setup, requests);
  RecordingExtension pricier;
  pricier.extra_row_position = 40;
  setup.extensions = {&pricier};
  const EngineResult priced = run_engine(setup, requests);
  EXPECT_EQ(priced.tokens, plain.tokens);
  ASSERT_EQ(priced.steps.size(), plain.steps.size());
  for (std::size_t i = 0; i < plain.steps.size(); ++i)
    EXPECT_GT(priced.steps[i].predicted_s, plain.steps[i].predicted_s) << "step " << i;
  EXPECT_GT(priced.duration_s, plain.duration_s);
}

// A cancelled request leaves outside a batch: each extension hears of it (on_leave) at the start
// of the step that ends it.
TEST(StepExtension, ACancelledRequestLeavesThroughOnLeave) {
  const auto requests = small_workload(7, 4);
  RecordingExtension recorder;
  EngineSetup setup;
  setup.extensions = {&recorder};
  std::int64_t cancelled_after = -1;
  setup.after_step = [&](Engine& engine, std::int64_t step) {
    if (cancelled_after < 0 && engine.cancel(2)) cancelled_after = step;
  };
  const EngineResult result = run_engine(setup, requests);
  ASSERT_GE(cancelled_after, 0);
  const auto leave = std::find_if(recorder.calls.begin(), recorder.calls.end(),
                                  [](const auto& c) { return c.hook == "leave"; });
  ASSERT_NE(leave, recorder.calls.end());
  EXPECT_EQ(leave->seen, 2);
  EXPECT_EQ(std::count_if(recorder.calls.begin(), recorder.calls.end(),
                          [](const auto& c) { return c.hook == "leave"; }),
            1);
  EXPECT_EQ(result.requests[2].finish_reason, "cancelled");
}

TEST(Engine, SameInputSameBytes) {
  const auto requests = small_workload(21, 10);
  EngineSetup setup;
  setup.slots = 60;
  const EngineResult a = run_engine(setup, requests), b = run_engine(setup, requests);
  EXPECT_EQ(a.events, b.events);
  EXPECT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (std::size_t i = 0; i < a.requests.size(); ++i)
    EXPECT_EQ(a.requests[i].token_times_s, b.requests[i].token_times_s);
  EXPECT_EQ(a.duration_s, b.duration_s);
}

TEST(Engine, PrefixCachingServesSharedPrompts) {
  SyntheticWorkload spec;
  spec.requests = 6;
  spec.vocab_size = weights().config.vocab_size;
  spec.arrival = {ArrivalKind::poisson, 50.0, 1.0, 1};
  spec.prefix_groups = 1;
  spec.prefix_tokens = 16;
  spec.prompt_tokens = {LengthKind::fixed, 20};
  spec.output_tokens = {LengthKind::fixed, 3};
  const EngineResult result = run_engine(EngineSetup{}, generate_workload(spec));
  EXPECT_GT(result.steps.back().kv.prefix_hit_tokens, 0);
  bool hit_event = false;
  for (const auto& event : result.events)
    hit_event |= event.kind == EventKind::event_admit && event.reason == "prefix_hit_tokens=16";
  EXPECT_TRUE(hit_event);
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// The simulated backend drives the same plugins on a pool with no storage: Llama-2-7B on an
// H200, tight enough to preempt (with swap), deterministic, every request to its length.
EngineResult run_simulated(std::int64_t slots, const std::vector<WorkloadRequest>& requests) {
  const ModelConfig model = model_preset("llama2-7b");
  const CostModel cost(model, load_hardware_profile("h200"));
  KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, slots},
              KvStorage::none);
  PluginContext context;
  context.pool = &pool;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  auto allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
      "paged", {{"block_size", std::int64_t{16}}}, context);
  auto scheduler = test::plugin_registry().create<PluginKind::scheduler>(
      "fcfs", {{"preemption", std::string("swap")}}, context);
  SimulatedBackend backend(model.vocab_size, model.eos_token_ids);
  EngineOptions options;
  options.rules.context = model.max_position_embeddings;
  options.rules.eos_token_ids = model.eos_token_ids;
  options.pool = &pool;
  options.swap_slots = 1 << 20;
  options.cost_model = &cost;
  Engine engine(backend, *allocator, *scheduler, options);
  return engine.run(requests);
}

TEST(SimulatedEngine, DeterministicCompleteAndTimedByTheCostModel) {
  SyntheticWorkload spec;
  spec.requests = 60;
  spec.seed = 3;
  spec.arrival = {ArrivalKind::poisson, 50.0, 1.0, 1};
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, 16, 512};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, 8, 256};
  const auto requests = generate_workload(spec);
  const EngineResult a = run_simulated(1024, requests);  // ~2 requests' worth: preemptions
  const EngineResult b = run_simulated(1024, requests);
  EXPECT_EQ(a.events, b.events);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.duration_s, b.duration_s);
  std::int64_t preemptions = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    ASSERT_FALSE(a.requests[i].rejected) << a.requests[i].reject_reason;
    EXPECT_EQ(static_cast<std::int64_t>(a.tokens[i].size()), requests[i].output_tokens) << i;
    preemptions += a.requests[i].preemptions;
  }
  EXPECT_GT(preemptions, 0);
  double predicted = 0;
  std::int64_t swapped = 0, timeline_swapped = 0;
  const CostModel cost(model_preset("llama2-7b"), load_hardware_profile("h200"));
  for (const auto& s : a.steps) {
    EXPECT_GT(s.predicted_s, 0);
    // The work the cost model priced is recorded with the step (kvlab calibrate fits to it):
    // every token the step ran, one sequence per batch row.
    EXPECT_EQ(s.work.tokens, s.prefill_tokens + s.decode_tokens);
    EXPECT_EQ(s.work.sequences, s.batch);
    EXPECT_DOUBLE_EQ(cost.cost(s.work).total(), s.predicted_s);
    // The step and its swap copies over the profile's link: latency per copy + bytes / bandwidth.
    EXPECT_NEAR(s.duration_s, s.predicted_s + cost.swap_seconds(s.swap_bytes, s.swap_transfers),
                1e-12 * s.duration_s);
    EXPECT_EQ(s.swap_bytes > 0, s.swap_transfers > 0);
    predicted += s.duration_s;
    swapped += s.swap_bytes;
  }
  for (const auto& t : a.requests) timeline_swapped += t.swapped_bytes;
  EXPECT_GT(swapped, 0);
  EXPECT_EQ(swapped, timeline_swapped);
  EXPECT_LE(predicted, a.duration_s * (1 + 1e-9));  // idle gaps between arrivals come on top
}

// KV tiers on the simulated backend: each step's tier copies (the allocator's counters moved
// since the step before) are priced over the profile's links, the host link for the device <->
// host copies and the disk blocks loaded back, the disk for its reads and writes; a profile that
// overlaps them with compute charges only their excess, one that does not charges them all.
EngineResult run_simulated_tiers(bool overlap, const std::vector<WorkloadRequest>& requests,
                                 CostModel& cost_out) {
  const ModelConfig model = model_preset("llama2-7b");
  HardwareProfile profile = load_hardware_profile("h200");
  profile.tier_copies_overlap = overlap;
  cost_out = CostModel(model, profile);
  KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, 2048},
              KvStorage::none);
  const std::int64_t block_bytes = pool.bytes_per_slot() * 16;
  auto policy = test::plugin_registry().create<PluginKind::tier_policy>("lru", {}, {});
  const KvTierSpec tiers{64 * block_bytes, 256 * block_bytes, nullptr, policy.get()};
  PluginContext context;
  context.pool = &pool;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  context.tiers = &tiers;
  auto allocator = test::plugin_registry().create<PluginKind::kv_allocator>(
      "paged", {{"block_size", std::int64_t{16}}}, context);
  auto scheduler = test::plugin_registry().create<PluginKind::scheduler>("fcfs", {}, context);
  SimulatedBackend backend(model.vocab_size, model.eos_token_ids);
  EngineOptions options;
  options.rules.context = model.max_position_embeddings;
  options.rules.eos_token_ids = model.eos_token_ids;
  options.pool = &pool;
  options.cost_model = &cost_out;
  options.kv_tiers = true;
  Engine engine(backend, *allocator, *scheduler, options);
  return engine.run(requests);
}

TEST(SimulatedEngine, KvTierCopiesArePricedOverTheProfilesLinks) {
  SyntheticWorkload spec;
  spec.requests = 80;
  spec.seed = 5;
  spec.arrival = {ArrivalKind::poisson, 20.0, 1.0, 1};
  spec.prefix_groups = 12;
  spec.prefix_tokens = 256;
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, 260, 400};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, 4, 16};
  const auto requests = generate_workload(spec);
  for (const bool overlap : {true, false}) {
    CostModel cost(model_preset("llama2-7b"), load_hardware_profile("h200"));
    const EngineResult run = run_simulated_tiers(overlap, requests, cost);
    KvAllocatorStats was;
    double charged = 0;
    for (const StepRecord& s : run.steps) {
      const KvAllocatorStats& now = s.kv;
      const double link = cost.swap_seconds((now.host_bytes_stored - was.host_bytes_stored) +
                                                (now.host_bytes_loaded - was.host_bytes_loaded) +
                                                (now.disk_bytes_loaded - was.disk_bytes_loaded),
                                            now.host_copies - was.host_copies);
      const double disk = cost.disk_seconds((now.disk_bytes_stored - was.disk_bytes_stored) +
                                                (now.disk_bytes_loaded - was.disk_bytes_loaded),
                                            now.disk_copies - was.disk_copies);
      const double expected =
          overlap ? std::max(s.predicted_s, link + disk) : s.predicted_s + link + disk;
      EXPECT_NEAR(s.duration_s, expected, 1e-12 + 1e-9 * expected) << "step " << s.step;
      EXPECT_NEAR(s.tier_s, s.duration_s - s.predicted_s, 1e-12 + 1e-9 * expected);
      charged += s.tier_s;
      was = now;
    }
    EXPECT_GT(was.host_hit_tokens, 0) << "overlap " << overlap;
    EXPECT_GT(was.disk_hit_tokens, 0) << "overlap " << overlap;
    EXPECT_GT(was.disk_bytes_stored, 0);
    EXPECT_GT(charged, 0);
    for (const auto& r : run.requests) EXPECT_FALSE(r.rejected) << r.reject_reason;
  }
}

}  // namespace
}  // namespace kvlab
