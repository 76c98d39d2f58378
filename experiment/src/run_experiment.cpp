// Stage 3: one expanded config runs: the serving stack is built, the engine (or a cluster of
// them behind a router) serves the requests, and the run is summarised; kvlab check then
// compares its tokens with the reference (stage 4).
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/engine/cluster.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "kvlab/workload/workload.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

// KV slots that hold no live token's KV although a sequence holds them (or, for external
// fragmentation, although a refused request needed them): reservation ahead of use, unfilled
// last blocks, a static batch's padding rows, and free holes on steps they blocked an admission.
double wasted_slots(const StepRecord& s) {
  return static_cast<double>(s.kv.reserved_unused + s.kv.last_block_slack + s.padding_slots +
                             s.blocking_unusable_free);
}

// Mean KV use and waste over the steps, and (measured clock with a cost model) how far the
// model's step predictions were from the measured forwards. Waste among held slots is vLLM's
// definition: over all steps, the share of the slots sequences held (live + reserved + slack)
// that held no live KV.
void summarize_memory_and_predictions(RunOutput& out, bool predictions) {
  double held = 0, held_waste = 0;
  for (const auto& s : out.engine.steps) {
    const double capacity = static_cast<double>(s.kv.capacity);
    out.mean_kv_used += static_cast<double>(s.kv.used - s.padding_slots) / capacity;
    out.mean_batch += static_cast<double>(s.batch - s.padding);
    out.max_batch = std::max(out.max_batch, s.batch - s.padding);
    out.peak_kv_residual_bytes = std::max(out.peak_kv_residual_bytes, s.kv_residual_bytes);
    out.mean_kv_waste += wasted_slots(s) / capacity;
    held += static_cast<double>(s.kv.used + s.kv.reserved_unused + s.kv.last_block_slack);
    held_waste +=
        static_cast<double>(s.kv.reserved_unused + s.kv.last_block_slack + s.padding_slots);
  }
  if (!out.engine.steps.empty()) {
    out.mean_kv_used /= static_cast<double>(out.engine.steps.size());
    out.mean_kv_waste /= static_cast<double>(out.engine.steps.size());
    out.mean_batch /= static_cast<double>(out.engine.steps.size());
  }
  out.kv_waste_of_held = held > 0 ? held_waste / held : 0.0;
  if (!out.engine.steps.empty()) {
    const KvAllocatorStats& kv = out.engine.steps.back().kv;  // cumulative counters
    out.prefix_hit_rate = kv.prefix_query_tokens ? static_cast<double>(kv.prefix_hit_tokens) /
                                                       static_cast<double>(kv.prefix_query_tokens)
                                                 : 0.0;
  }
  if (!predictions) return;
  std::vector<double> errors, ratios;
  for (const auto& s : out.engine.steps) {
    errors.push_back(std::abs(s.predicted_s - s.measured_forward_s) / s.measured_forward_s);
    if (s.predicted_s > 0) ratios.push_back(s.measured_forward_s / s.predicted_s);
  }
  out.step_prediction_error = summarize_latencies(std::move(errors));
  out.step_time_ratio = summarize_latencies(std::move(ratios));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The mean share of the pool live KV held over `steps`, and the prefix cache's hit rate by the
// last step's cumulative counters.
std::pair<double, double> kv_use_and_prefix_hits(const std::vector<StepRecord>& steps) {
  if (steps.empty()) return {0.0, 0.0};
  double used = 0;
  for (const auto& s : steps)
    used += static_cast<double>(s.kv.used - s.padding_slots) / static_cast<double>(s.kv.capacity);
  const KvAllocatorStats& kv = steps.back().kv;
  return {used / static_cast<double>(steps.size()),
          kv.prefix_query_tokens ? static_cast<double>(kv.prefix_hit_tokens) /
                                       static_cast<double>(kv.prefix_query_tokens)
                                 : 0.0};
}

// [cluster]: every replica's stack behind the router; the merged run in out.engine, each
// replica's summary in out.replicas.
// Threads that step a cluster's replicas at once: the simulated backend's replicas under a
// clock that does not read the wall (backend.threads of them, 0: every core); one otherwise
// (the cpu backend's forward has the cores already, and a measured step must run alone).
int replica_threads(const ExperimentConfig& c) {
  const bool wall = c.clock == EngineClock::wall || c.clock == EngineClock::measured;
  if (c.backend_kind != BackendKind::simulated || wall) return 1;
  if (c.threads > 0) return static_cast<int>(c.threads);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

void run_replicas(const ExperimentConfig& c, const PluginRegistry& registry,
                  std::span<const ReplicaSizing> sizings,
                  std::vector<std::unique_ptr<ReplicaStack>>& stacks,
                  const std::vector<WorkloadRequest>& requests, RunOutput& out,
                  EngineSlots& slots) {
  auto router = registry.create<PluginKind::router>(c.router, c.router_params, PluginContext{});
  std::vector<Engine*> engines;
  for (auto& stack : stacks) engines.push_back(stack->engine.get());
  ClusterResult cluster;
  if (c.disaggregated()) {
    auto decode_router =
        registry.create<PluginKind::router>(c.decode_router, c.decode_router_params, {});
    const auto split = engines.begin() + c.prefill_replicas;
    Disaggregation d{std::span<Engine* const>(engines.begin(), split),
                     std::span<Engine* const>(split, engines.end()),
                     router.get(),
                     decode_router.get(),
                     transfer_price(c, sizings),
                     c.clock != EngineClock::measured && c.clock != EngineClock::wall};
    cluster = run_disaggregated(d, requests);
  } else {
    cluster = run_cluster(engines, *router, requests, replica_threads(c));
  }
  for (const RouteRecord& route : cluster.routes)
    slots.emplace_back(route.replica, route.id_in_replica);
  record_cluster(c, sizings, std::move(cluster), out);
}

// The KV tiers' counters summed over the replicas' allocators, and the step time they cost.
RunOutput::KvTierTotals kv_tier_totals(const std::vector<std::unique_ptr<ReplicaStack>>& stacks,
                                       const std::vector<StepRecord>& steps) {
  RunOutput::KvTierTotals t;
  double host_hits = 0, disk_hits = 0, queried = 0;
  for (const auto& stack : stacks) {
    const KvAllocatorStats kv = stack->kv().stats();
    host_hits += static_cast<double>(kv.host_hit_tokens);
    disk_hits += static_cast<double>(kv.disk_hit_tokens);
    queried += static_cast<double>(kv.prefix_query_tokens);
    t.bytes_stored += kv.host_bytes_stored + kv.disk_bytes_stored;
    t.bytes_loaded += kv.host_bytes_loaded + kv.disk_bytes_loaded;
    t.dropped_blocks += kv.tier_dropped_blocks;
  }
  t.host_hit_rate = queried > 0 ? host_hits / queried : 0.0;
  t.disk_hit_rate = queried > 0 ? disk_hits / queried : 0.0;
  for (const StepRecord& s : steps) t.time_s += s.tier_s;
  return t;
}

}  // namespace

// A KV handoff's time: on a clock the profile prices, its bytes over the profile's [network];
// on the measured clock, what copying the KV out really took (the copy in is the decode
// replica's step); on the steps clock, none.
// Sides of different tensor parallelism: each GPU sends (or receives) its heads' share at once,
// and the side with fewer GPUs moves the larger share.
std::function<double(std::int64_t, double)> transfer_price(const ExperimentConfig& c,
                                                           std::span<const ReplicaSizing> sizings) {
  if (c.clock == EngineClock::measured || c.clock == EngineClock::wall)
    return [](std::int64_t, double copy_out_s) { return copy_out_s; };
  if (!sizings.front().cost_model) return [](std::int64_t, double) { return 0.0; };
  const CostModel* prefill = &*sizings.front().cost_model;
  const CostModel* decode = &*sizings.back().cost_model;
  return [prefill, decode](std::int64_t bytes, double) {
    return std::max(prefill->kv_transfer_seconds(bytes), decode->kv_transfer_seconds(bytes));
  };
}

// A cluster's run: each replica's summary in out.replicas, the merged run in out.engine.
void record_cluster(const ExperimentConfig& c, std::span<const ReplicaSizing> sizings,
                    ClusterResult&& cluster, RunOutput& out) {
  double hit_tokens = 0, query_tokens = 0;
  for (std::size_t index = 0; index < cluster.replicas.size(); ++index) {
    const EngineResult& replica = cluster.replicas[index];
    RunOutput::Replica r;
    r.summary = summarize_run(replica.requests, cluster.duration_s);
    r.tensor_parallel = c.tensor_parallel_of(static_cast<std::int64_t>(index));
    r.kv_slots = sizing_of(c, sizings, static_cast<std::int64_t>(index)).slots;
    r.requests = static_cast<std::int64_t>(replica.requests.size());
    std::tie(r.mean_kv_used, r.prefix_hit_rate) = kv_use_and_prefix_hits(replica.steps);
    if (!replica.steps.empty()) {
      hit_tokens += static_cast<double>(replica.steps.back().kv.prefix_hit_tokens);
      query_tokens += static_cast<double>(replica.steps.back().kv.prefix_query_tokens);
    }
    out.replicas.push_back(r);
  }
  out.engine = merged_result(std::move(cluster));
  out.prefix_hit_rate = query_tokens > 0 ? hit_tokens / query_tokens : 0.0;
}

// RunOutput::kv_dtype.
std::string stored_kv_dtype(const ExperimentConfig& c, const std::optional<CostModel>& cost_model) {
  if (c.backend_kind == BackendKind::simulated)
    return std::string(dtype_short_name(cost_model->profile().kv_dtype));
  // The cpu backend's pool, or a plugin's quantized one (cuda: fp8, int8).
  if (c.backend_kind == BackendKind::cpu || c.kv_dtype != DType::dtype_f32)
    return c.kv_dtype_of(true) == c.kv_dtype  // K/V when they differ: "q8_0/q4_0"
               ? std::string(dtype_short_name(c.kv_dtype))
               : fmt::format("{}/{}", dtype_short_name(c.kv_dtype),
                             dtype_short_name(c.kv_dtype_of(true)));
  const auto dtype = c.backend_params.find("dtype");
  if (dtype != c.backend_params.end() && std::holds_alternative<std::string>(dtype->second))
    return std::get<std::string>(dtype->second);
  return {};
}

void summarize_output(const ExperimentConfig& c,
                      const std::vector<std::unique_ptr<ReplicaStack>>& stacks, bool has_cost_model,
                      RunOutput& out) {
  out.summary = summarize_run(out.engine.requests, out.engine.duration_s);
  out.tenants = summarize_tenants(out.engine.requests, out.engine.duration_s);
  if (!out.tenants.empty()) out.service_gap_tokens = max_service_gap_tokens(out.engine.requests);
  for (const auto& stack : stacks) {
    out.forward_wall_s += stack->backend->seconds();
    out.forwards += stack->backend->forwards();
    out.forwards_with_chosen_tokens += stack->backend->forwards_with_chosen_tokens();
    const BackendCounters counters = stack->backend->counters();
    out.graph_replays += counters.graph_replays;
    out.graph_captures += counters.graph_captures;
  }
  if (c.has_kv_tiers()) out.kv_tiers = kv_tier_totals(stacks, out.engine.steps);
  const double cluster_hit_rate = out.prefix_hit_rate;
  summarize_memory_and_predictions(out, has_cost_model && c.clock == EngineClock::measured);
  if (c.replicas > 1) out.prefix_hit_rate = cluster_hit_rate;  // every replica's, not the last
}

RunOutput run_experiment(const ExperimentConfig& c, bool check,
                         std::vector<std::string>* mismatches) {
  const auto wall_start = std::chrono::steady_clock::now();
  const bool machine_timed = c.clock == EngineClock::measured || c.clock == EngineClock::wall;
  const double load_at_start = machine_timed ? machine_load_1m() : -1;
  if (c.threads > 0) cpu::set_num_threads(static_cast<int>(c.threads));
  const PluginRegistry registry(plugin_search_path(c));
  const bool simulated = c.backend_kind == BackendKind::simulated;
  (void)registry.find(PluginKind::backend, c.backend);  // unknown: say so now
  check_backend_rules(c, check);

  ServedModel served = load_served_model(c, registry, simulated);
  const ModelConfig& model = served.config;
  const std::vector<ReplicaSizing> sizings = replica_sizings(c, served, simulated);
  const std::optional<CostModel>& cost_model = sizings.front().cost_model;  // the prefill side's
  const std::int64_t slots = sizings.front().slots;
  // Context, EOS and window from one place: the backend, the engine's KV release and the
  // reference check all use these, so `check` compares one model.
  const SequenceRules rules = sequence_rules(model, *served.attention);
  // kvlab check --tolerance measures the engine's logits against the reference's.
  std::optional<EngineLogitLog> log;
  if (check && c.check_tolerance > 0) log.emplace(model.vocab_size, kComparedLogitBytes);
  std::vector<std::unique_ptr<ReplicaStack>> stacks =
      make_replicas(c, registry, served, sizings, rules, log ? &*log : nullptr);
  std::unique_ptr<Tokenizer> tokenizer;  // a prompt set's, to decode the answers
  const RealWorkload workload = make_requests_or_say_why(c, model, check, tokenizer);
  const std::vector<WorkloadRequest>& requests = workload.requests;

  RunOutput out;
  out.model_name = model.name;
  out.kv_slots = slots;
  out.workload_description = workload.description;
  if (workload.ideal_prefix_hit_rate >= 0)
    out.ideal_prefix_hit_rate = workload.ideal_prefix_hit_rate;
  out.weights_description = stacks.front()->backend->description();
  out.kv_dtype = stored_kv_dtype(c, cost_model);
  out.machine_load_1m = load_at_start;
  out.prompt_texts = workload.prompt_texts;
  const auto engine_start = std::chrono::steady_clock::now();
  EngineSlots served_by;  // request i: (replica, id in its engine)
  if (c.replicas == 1) {
    out.engine = stacks.front()->engine->run(requests);
    for (std::size_t i = 0; i < requests.size(); ++i)
      served_by.emplace_back(0, static_cast<RequestId>(i));
  } else {
    run_replicas(c, registry, sizings, stacks, requests, out, served_by);
  }
  out.engine_wall_s = seconds_since(engine_start);
  summarize_output(c, stacks, cost_model.has_value(), out);
  for (std::size_t i = 0; tokenizer && i < out.engine.tokens.size(); ++i) {
    std::span<const std::int32_t> answer = out.engine.tokens[i];
    if (out.engine.requests[i].finish_reason == "eos") answer = answer.first(answer.size() - 1);
    out.answer_texts.push_back(tokenizer->decode(answer));  // without the stop token
  }
  if (check)
    check_against_reference(served, rules.window, requests, c.check_tolerance,
                            log ? &*log : nullptr, served_by, out, *mismatches);
  out.wall_s = seconds_since(wall_start);
  return out;
}

}  // namespace kvlab
