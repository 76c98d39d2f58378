#pragma once
// The stages of one experiment run, in order, each in its own file of experiment/src:
//   1. validate_points.cpp    every sweep point's plugins, model, profile and inputs resolve
//   2. serving_stack.cpp      the served model, cost model, KV pool and each replica's stack
//      workload_requests.cpp  the requests (synthetic, a trace, the Azure trace, a prompt set)
//   3. run_experiment.cpp     the engine (or a cluster of them) over the requests; summaries
//   4. reference_check.cpp    kvlab check: every generated token against the reference
//   5. run_outputs.cpp        requests.csv, steps.csv, events.jsonl, summary.json, ...
// Internal to the experiment library; its interface is kvlab/experiment/experiment.hpp.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine_logit_log.hpp"
#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/engine/cluster.hpp"
#include "kvlab/engine/engine.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/kv/kv_groups.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/workload/workload.hpp"
#include "timed_backend.hpp"

namespace kvlab {

// Where a run's plugins are looked for: the default search path, then [experiment] plugin_paths.
std::vector<std::filesystem::path> plugin_search_path(const ExperimentConfig& c);

// 1. Rules across [backend] and the command (kvlab check).
void check_backend_rules(const ExperimentConfig& c, bool check);

// 2.
// The model as served: the checkpoint (none for the simulated backend), its config after the
// attention variant converted its K/V heads, and the variant.
struct ServedModel {
  std::optional<cpu::LlamaWeights> weights;  // as converted for the attention variant
  std::filesystem::path source;              // the checkpoint's folder or .gguf; empty: preset
  std::string weights_key;                   // names them exactly (checkpoint, K/V heads)
  ModelConfig config;
  PluginObject<AttentionVariant> attention;
  // [speculation] draft_model's checkpoint (none for draft_layers, whose draft is `weights`'
  // first layers, or on the simulated backend) and the draft's config (layers 0: no draft).
  std::shared_ptr<const cpu::LlamaWeights> draft_weights;
  std::filesystem::path draft_source;
  ModelConfig draft_config;
};

// A latent-attention model caches one latent a token a layer: an attention variant that would
// give it `kv_heads` other than its own has no K/V heads to regroup (kvlab::Error).
void refuse_kv_regrouping_of_latent(const ModelConfig& model, const std::string& attention,
                                    std::int64_t kv_heads);

ServedModel load_served_model(const ExperimentConfig& c, const PluginRegistry& registry,
                              bool simulated);
std::optional<CostModel> run_cost_model(const ExperimentConfig& c, const ModelConfig& model,
                                        std::int64_t tensor_parallel);
std::int64_t pool_slots(const ExperimentConfig& c, const ModelConfig& model, bool simulated,
                        const std::optional<CostModel>& cost_model);

// What prices and sizes a replica: the cost model of its GPUs and its pool's capacity.
struct ReplicaSizing {
  std::optional<CostModel> cost_model;
  std::optional<CostModel> draft_cost_model;  // the draft model's steps, with a draft and profile
  std::int64_t slots = 0;
};
// One sizing for every replica, or two for a disaggregated cluster whose sides have their own
// tensor parallelism: [0] the prefill side's, [1] the decode side's. Built once: engines keep
// pointers to the cost models.
std::vector<ReplicaSizing> replica_sizings(const ExperimentConfig& c, const ServedModel& served,
                                           bool simulated);
const ReplicaSizing& sizing_of(const ExperimentConfig& c, std::span<const ReplicaSizing> sizings,
                               std::int64_t replica);

// One serving stack: its KV pool, allocator, scheduler, backend and engine (a cluster has one per
// replica). Members are destroyed in reverse: the device backend detaches before its pool goes.
struct ReplicaStack {
  std::unique_ptr<KvPool> pool;
  PluginObject<KvTierPolicy> tier_policy;  // [kv_tiers], else empty
  KvTierSpec tiers;                        // what the allocator was given
  PluginObject<KvAllocator> allocator;
  std::unique_ptr<GroupedKvAllocator> grouped;  // kv_cache.groups = "per_kind": over `allocator`
  PluginObject<Scheduler> scheduler;
  PluginObject<Backend> plugin_backend;   // the backend plugin's object: cpu, simulated, cuda, ...
  std::unique_ptr<TimedBackend> backend;  // it, timed
  PluginObject<KvPolicy> kv_policy;       // [kv_policy], else empty
  // [speculation]: the draft model's pool and backend (a draft proposer's), then the proposer
  std::unique_ptr<KvPool> draft_pool;
  PluginObject<Backend> draft_backend;
  PluginObject<Proposer> proposer;
  EngineOptions options;  // what the engine was made with (kvlab serve's too)
  std::unique_ptr<Engine> engine;
  KvAllocator& kv() { return grouped ? *grouped : *allocator; }  // what the engine allocates with
};

// The backend plugin's parameters: backend.params, and for the cpu backend its formats
// (backend.weights, backend.activations) as its parameters `weights` and `activations`.
ParamMap backend_params(const ExperimentConfig& c);
// The proposer plugin's parameters: the built-in proposers' [speculation] keys (prompt_lookup's
// n-gram range; simulated's acceptance and seed), or speculation.params for any other.
ParamMap proposer_params(const ExperimentConfig& c);

std::vector<std::unique_ptr<ReplicaStack>> make_replicas(
    const ExperimentConfig& c, const PluginRegistry& registry, const ServedModel& served,
    std::span<const ReplicaSizing> sizings, const SequenceRules& rules, EngineLogitLog* log);

// The workload's requests; running out of memory is reported as the workload's.
RealWorkload make_requests_or_say_why(const ExperimentConfig& c, const ModelConfig& model,
                                      bool check, std::unique_ptr<Tokenizer>& tokenizer);

// 3.
// What a run reports beyond the engine's record (out.engine): its summaries, the backends'
// counters, KV tier totals, memory use and (measured clock) the cost model's prediction error.
void summarize_output(const ExperimentConfig& c,
                      const std::vector<std::unique_ptr<ReplicaStack>>& stacks, bool has_cost_model,
                      RunOutput& out);
// A cluster's run (run_cluster's, or a served cluster's): each replica's summary in
// out.replicas, the merged run in out.engine, the prefix hit rate over every replica.
void record_cluster(const ExperimentConfig& c, std::span<const ReplicaSizing> sizings,
                    ClusterResult&& cluster, RunOutput& out);
// A disaggregated cluster's KV handoff time, seconds for (bytes, copy_out_s): the profile's link
// on a clock it prices, the measured copy on the wall and measured clocks.
std::function<double(std::int64_t, double)> transfer_price(const ExperimentConfig& c,
                                                           std::span<const ReplicaSizing> sizings);
// The K/V dtype as the pool stores it (RunOutput::kv_dtype).
std::string stored_kv_dtype(const ExperimentConfig& c, const std::optional<CostModel>& cost_model);

// 4.
// Where each request of a run was served: its replica and its id in that replica's engine.
using EngineSlots = std::vector<std::pair<std::size_t, RequestId>>;

// Rows of engine logits kvlab check --tolerance keeps to compare with the reference's over the
// whole vocabulary (beyond it, each token's top 5 only): 512 MiB, ~4,000 rows of a 32k vocabulary.
constexpr std::size_t kComparedLogitBytes = std::size_t{512} << 20;

void check_against_reference(const ServedModel& served, std::optional<std::int64_t> window,
                             const std::vector<WorkloadRequest>& requests, double tolerance,
                             const EngineLogitLog* log, const EngineSlots& slots, RunOutput& out,
                             std::vector<std::string>& mismatches);

}  // namespace kvlab
