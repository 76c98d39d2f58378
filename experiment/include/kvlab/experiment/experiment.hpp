#pragma once
// Experiment files (TOML): parsing with strict validation, sweeps, and one run's execution.
// The schema is documented in docs/experiments.md.
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvlab/cpu_reference/weight_choices.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/engine.hpp"
#include "kvlab/engine/metrics.hpp"
#include "kvlab/experiment/logit_agreement.hpp"
#include "kvlab/experiment/logprob_agreement.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/plugin_params.hpp"
#include "kvlab/workload/formats.hpp"
#include "kvlab/workload/real_workloads.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab {

using ParamMap = std::map<std::string, ParamValue, std::less<>>;

// The profile the cpu backend's steps are priced on when backend.profile is not given:
// profiles/cpu.toml, measured by kvlab calibrate on the build machine (its header says which).
inline constexpr const char* kDefaultCpuProfile = "cpu";

// The kinds of backend a run can use: the two built in, or a backend plugin (cuda).
enum class BackendKind { cpu, simulated, plugin };  // plugin: any other backend plugin (cuda)
BackendKind backend_kind_of(std::string_view name);

// [eval]: a synthetic retrieval task (RULER's design) that kvlab eval builds from filler text
// and runs through the engine: each prompt hides a key at a depth of its filler and asks for it.
struct EvalSpec {
  std::string task;                   // "passkey" or "needle"; empty: no [eval]
  std::string filler;                 // a text file (WikiText-2), relative to the experiment file
  std::vector<std::int64_t> lengths;  // prompt lengths in tokens
  std::vector<double> depths;         // where the key sits in the filler: 0 first, 1 last
  std::int64_t samples = 1;           // prompts per (length, depth): other keys and filler
  std::int32_t answer_tokens = 12;    // each answer's cap
};

struct ExperimentConfig {
  std::string name = "experiment";
  std::uint64_t seed = 0;
  std::int64_t repeats = 1;
  EngineClock clock = EngineClock::virtual_clock;  // virtual | offline | measured | wall
  std::vector<std::string> plugin_paths;
  std::string model;  // preset name or model folder
  std::uint64_t weights_seed = 0;
  std::string backend = "cpu";                  // cpu | simulated | a backend plugin (cuda)
  BackendKind backend_kind = BackendKind::cpu;  // what `backend` names, parsed with it
  ParamMap backend_params;                      // a plugin backend's parameters
  // Hardware profile (name or file) whose roofline cost model prices every step on the virtual
  // and offline clocks (and sits next to the measured clock's times): the simulated backend's
  // device; kDefaultCpuProfile for the cpu backend when not given.
  std::string profile;
  // [hardware]: keys of that profile changed for this run, as TOML text in the profile's own
  // sections ("[link]\nswap_gb_per_s = 10"); --set hardware.link.swap_gb_per_s=10 writes it.
  std::string hardware_changes;
  // The simulated backend: GPUs of `profile` that share each layer (tensor parallelism; the
  // profile's [interconnect] prices the all-reduces). 1 for every other backend.
  std::int64_t tensor_parallel = 1;
  // The simulated backend: groups of tensor_parallel GPUs that split each sequence's KV by
  // positions (context parallelism: ring attention for prefill, partial outputs all-gathered in
  // decode; CostModel). 1 for every other backend.
  std::int64_t context_parallel = 1;
  std::int64_t threads = 0;
  // backend.weights, the cpu backend's weight format: nullopt for "stored" (a GGUF file's own
  // types; f32 for presets and folders), else f32, f16, bf16, q8_0, q4_0, q4_1
  // (cpu::select_compute_weights). Given to the cpu plugin as its parameter `weights`.
  std::optional<cpu::WeightFormat> cpu_weights;
  // backend.activations: q8 / bf16, the cpu backend's Q4/Q8 (bf16) products take activations
  // rounded to 8-bit blocks (bf16); f32 (default) keeps the reference's function.
  cpu::ActivationFormat cpu_activations = cpu::ActivationFormat::f32;
  // kvlab check --tolerance: a token passes when the reference's logit for it is within this of
  // the reference's largest (0: it must be the reference's argmax). Not read from the file.
  double check_tolerance = 0;
  std::string allocator = "paged";
  ParamMap allocator_params;
  std::optional<std::int64_t> kv_slots;  // default: 4096 (cpu), the profile's capacity (simulated)
  std::optional<double> kv_memory_mib;   // instead of slots: a byte budget
  DType kv_dtype = DType::dtype_f32;  // the cpu backend's KV pool (kv_pool_holds: also quantized)
  // kv_cache.value_dtype: V's rows in a dtype of their own (llama.cpp's -ctv); nullopt: kv_dtype.
  std::optional<DType> kv_value_dtype;
  DType kv_dtype_of(bool value) const {
    return value && kv_value_dtype ? *kv_value_dtype : kv_dtype;
  }
  // Bytes of one head's K row and V row of one token in the cpu backend's pool.
  std::int64_t kv_head_bytes(std::int64_t head_dim) const {
    return dtype_row_bytes(kv_dtype_of(false), head_dim) +
           dtype_row_bytes(kv_dtype_of(true), head_dim);
  }
  bool kv_hadamard = false;  // kv_cache.rotation = "hadamard" (KvPoolShape)
  // kv_cache.residual_length: a KIVI pool's newest tokens a sequence keeps in fp16 (a multiple
  // of 32; KvPoolShape::kivi_residual), charged beside the pool's slots (pool_slots).
  std::int64_t kivi_residual = kKiviResidualDefault;
  // kv_cache.groups = "per_kind": one block table per group of layers of one attention kind
  // (kvlab/kv/kv_groups.hpp; the pool's slots then hold kv_slots x layers / group layers slots
  // of a group's layers: the same bytes); "uniform" (default): one table for every layer.
  bool kv_groups = false;
  std::int64_t swap_slots = 0;  // host swap pool for swap preemption, in tokens
  // [kv_tiers]: KV tiers below each replica's pool (the paged allocator's evicted prefix blocks,
  // docs/concepts/kv-tiers.md): host memory and disk in GiB (0: none), the tier_policy plugin
  // and its params, and the folder of the disk tier's file ("": the system's temporary folder).
  double host_tier_gib = 0, disk_tier_gib = 0;
  std::string tier_policy = "lru";
  ParamMap tier_policy_params;
  std::string disk_tier_directory;
  bool has_kv_tiers() const { return host_tier_gib > 0 || disk_tier_gib > 0; }
  // [kv_policy]: which cached positions each sequence keeps (docs/concepts/kv-eviction.md): a
  // kv_policy plugin and its params; "" keeps every position.
  std::string kv_policy;
  ParamMap kv_policy_params;
  // [speculation]: speculative decoding (kvlab/speculation/speculation.hpp): proposals per decode
  // and the proposer plugin (speculation.proposer) with its params; tokens = 0 (no table): off.
  SpeculationOptions speculation;
  ParamMap proposer_params;
  // The draft model: a preset or model path (draft_model), or the target's first draft_layers
  // layers; the draft proposer runs it, and on the simulated backend its steps are priced.
  std::string draft_model;
  std::int64_t draft_layers = 0;
  std::string attention = "gqa";
  ParamMap attention_params;
  std::string scheduler = "fcfs";
  ParamMap scheduler_params;
  SyntheticWorkload workload;
  std::string trace;  // replaces the synthetic workload when set
  // [workload.azure_trace]: the Azure LLM inference trace 2023 replayed (replaces synthetic).
  std::string azure_trace;  // its CSV file
  ReplayWindow azure;       // window, rate scale (context, vocab and seed come from the run)
  // [workload.replay]: the window, rate and length scales of a Mooncake `trace` (context, vocab
  // and seed come from the run); replay_given: the table was there (any other trace refuses it).
  ReplayWindow replay;
  bool replay_given = false;
  // [workload.prompts]: a prompt-set JSONL file (replaces synthetic); answers end at EOS.
  std::string prompt_set;   // its file
  bool prompt_chat = true;  // through the model's chat template (else the raw text, with BOS)
  std::int32_t prompt_max_tokens = 256;
  std::int64_t prompt_requests = 0;  // 0 = one per prompt
  // [eval]: kvlab eval's retrieval task (kvlab/experiment/eval_task.hpp); kvlab run ignores it.
  EvalSpec eval;
  ServiceLevelObjectives slo;
  // [[workload.tenants]]: who sends the requests (drawn by share, or the trace's tenant column)
  // and each tenant's own SLOs over [slo] (docs/concepts/fairness-and-deadlines.md).
  std::vector<TenantSpec> tenants;
  // The [workload] keys the file (or a --set) gave, for the check that a real workload (a
  // trace, the Azure trace, a prompt set) is not handed synthetic settings it would ignore.
  std::vector<std::string> workload_keys_given;
  // [cluster]: `replicas` copies of the serving stack (allocator, scheduler, backend, KV pool
  // each), every request routed at its arrival by the `router` plugin.
  std::int64_t replicas = 1;
  std::string router = "round_robin";
  ParamMap router_params;
  // Disaggregated prefill and decode: the first `prefill_replicas` replicas prefill (routed by
  // `router`), the others decode (routed by `decode_router`, default the same plugin, with
  // `decode_params`); 0: every replica does both (docs/concepts/disaggregation.md).
  std::int64_t prefill_replicas = 0;
  std::string decode_router;
  ParamMap decode_router_params;
  // Each side's GPUs per replica (tensor parallel; the simulated backend): DistServe's best
  // OPT-13B shape is prefill TP 2 beside decode TP 1. Unset: backend.tensor_parallel.
  std::optional<std::int64_t> prefill_tensor_parallel, decode_tensor_parallel;
  bool disaggregated() const { return prefill_replicas > 0; }
  // The tensor-parallel GPUs of replica `replica` (its side's in a disaggregated cluster).
  std::int64_t tensor_parallel_of(std::int64_t replica) const {
    if (!disaggregated()) return tensor_parallel;
    return (replica < prefill_replicas ? prefill_tensor_parallel : decode_tensor_parallel)
        .value_or(tensor_parallel);
  }
  // Every GPU of the run: each replica's tensor x context parallel GPUs.
  std::int64_t gpus() const {
    std::int64_t all = 0;
    for (std::int64_t r = 0; r < replicas; ++r) all += tensor_parallel_of(r) * context_parallel;
    return all;
  }
  std::string output_dir;  // empty: results/<name>
  // [output] frames: step frames for kvlab view (frames.jsonl), about this many batch entries
  // and slot runs at most per run (past it every 2nd, 4th, ... step); 0: none.
  std::int64_t frame_budget = 500'000;
  // [output] columns: what the summary table adds for this experiment (metric_column_options,
  // kvlab/experiment/metric_registry.hpp).
  std::vector<std::string> table_columns;
  std::string label;  // "key=value, ..." of the sweep point
  // The point's swept keys in axis order, each with its value as JSON text: typed values for
  // summary.json, runs.json and results.csv ("8", "\"fcfs\"", "{\"max_batch\":4}").
  std::vector<std::pair<std::string, std::string>> swept;
  std::string resolved_toml;  // this point's whole table after --set and the sweep (TOML text)
};

// One expanded run of a file: the config and where it came from.
struct ExperimentRun {
  ExperimentConfig config;
  std::int64_t repeat = 0;
};

// What the command line changes in an experiment file.
struct CommandLineChanges {
  // --set "dotted.key=toml value" (a bare word is a string): applied to every sweep point on
  // top of its swept values, so a key inside a swept table reaches each point; a key the file
  // sweeps (or a table holding one) replaces that axis and the axes zipped with it.
  std::vector<std::string> set;
  // --sweep "dotted.key=v1,v2": one more axis, crossed with the file's (a file axis over the
  // same key is replaced as by --set). The values: a TOML array's items, else comma-separated
  // words each read as --set reads one.
  std::vector<std::string> sweep;
};

// Parses FILE, applies the command line's changes, expands the sweep axes and repeats. Every
// problem is a kvlab::Error "file:line:column: why" (with a suggestion for unknown keys)
// before anything runs. `notes` (if given) gets a line for each file axis the command line
// replaced.
std::vector<ExperimentRun> load_experiment(const std::filesystem::path& file,
                                           const CommandLineChanges& changes,
                                           std::vector<std::string>* notes);
// The same with --set only, no notes.
std::vector<ExperimentRun> load_experiment(const std::filesystem::path& file,
                                           const std::vector<std::string>& overrides);

// Everything that can be checked before a run, for every run: the plugins of each sweep point
// exist and accept their parameters, the model, profile and trace resolve, cross-section rules
// hold. Throws kvlab::Error naming the sweep point. `check`: for kvlab check.
void validate_experiment(const std::vector<ExperimentRun>& runs, bool check);

struct RunOutput {
  EngineResult engine;
  RunSummary summary;
  // With tenants: each one's summary (in order of first arrival), and the VTC service gap
  // (max_service_gap_tokens); empty / nullopt for a run whose requests name none.
  std::vector<TenantSummary> tenants;
  std::optional<double> service_gap_tokens;
  double wall_s = 0;          // the whole run, model setup included
  double engine_wall_s = 0;   // Engine::run
  double forward_wall_s = 0;  // of which inside Backend::forward
  // Backend::forward calls, and those after which the backend returned the tokens it picked
  // (ForwardResult::tokens: a GPU samples where the logits are) instead of logits.
  std::int64_t forwards = 0, forwards_with_chosen_tokens = 0;
  std::int64_t graph_replays = 0, graph_captures = 0;  // Backend::counters, every replica's
  // Fractions of the pool averaged over steps: live KV (not a static batch's padding), and
  // waste (reserved ahead, unfilled last blocks, padding, holes that blocked an admission).
  double mean_kv_used = 0, mean_kv_waste = 0;
  double kv_waste_of_held = 0;  // waste among the slots sequences held, over all steps (vLLM's)
  double prefix_hit_rate = 0;   // prompt tokens found in the prefix cache / tokens looked up
  // A trace with prefix-sharing information (Mooncake): an infinite cache's hit rate at its block
  // granularity, the ceiling prefix_hit_rate is read against; nullopt for other workloads.
  std::optional<double> ideal_prefix_hit_rate;
  // [kv_tiers], over every replica: prompt tokens loaded back from host memory and from disk /
  // prompt tokens looked up; KV bytes stored into the tiers and loaded back (pool dtype); blocks
  // no tier kept; step time charged to the copies (StepRecord::tier_s). nullopt without tiers.
  struct KvTierTotals {
    double host_hit_rate = 0, disk_hit_rate = 0;
    std::int64_t bytes_stored = 0, bytes_loaded = 0, dropped_blocks = 0;
    double time_s = 0;
  };
  std::optional<KvTierTotals> kv_tiers;
  std::int64_t kv_slots = 0;  // the pool's capacity in tokens
  // Sequences a step computes (a static batch's padding rows not counted): mean over steps and
  // most at once, what a smaller KV dtype or attention variant lets run together.
  double mean_batch = 0;
  std::int64_t max_batch = 0;
  // A KIVI pool's fp16 open groups, the most any step held (StepRecord::kv_residual_bytes): KV
  // memory beyond the pool's slots.
  std::int64_t peak_kv_residual_bytes = 0;
  // With a cost model and the measured clock, per step: |predicted - measured| / measured, and
  // measured / predicted (signed: above 1, the steps ran slower than the profile prices them;
  // a whole run's median far from 1 means the machine or the profile, not the engine, is off).
  std::optional<LatencySummary> step_prediction_error, step_time_ratio;
  // The measured and wall clocks: the machine's 1-minute load average as the run started (a
  // busy machine stretches their steps); -1 on the other clocks or where unreadable.
  double machine_load_1m = -1;
  std::string model_name;
  std::string workload_description;  // a real workload's: what was read, what was clipped
  // The K/V dtype as the pool stores it: the cpu backend's kv_cache.dtype, the simulated
  // device's (its profile's kv_dtype), a plugin backend's "dtype" parameter when given; empty
  // when the plugin did not say.
  std::string kv_dtype;
  std::string weights_description;  // cpu backend: the formats its products read
  // A prompt set's texts and the answers decoded by the model's tokenizer (outputs.jsonl).
  std::vector<std::string> prompt_texts, answer_texts;
  // A cluster ([cluster] replicas > 1): each replica's own summary, requests and KV use.
  struct Replica {
    RunSummary summary;
    std::int64_t requests = 0;
    std::int64_t tensor_parallel = 1, kv_slots = 0;  // its GPUs and its pool (sides may differ)
    double mean_kv_used = 0;
    double prefix_hit_rate = 0;
  };
  std::vector<Replica> replicas;
  // kvlab check: generated tokens compared with the reference, how many were not its argmax
  // (passed within check_tolerance), and the largest logit gap among them; with a tolerance,
  // how close the engine's logits were to the reference's; for requests that asked for them,
  // how close its log-probabilities were.
  struct Check {
    std::int64_t tokens = 0, off_argmax = 0;
    double max_gap = 0;
    LogitAgreement logits;
    LogprobAgreement logprobs;
  };
  Check check;
};

// Runs one expanded config. `check`: compare every finished request's greedy tokens with the
// full-recompute reference; mismatches are appended to `mismatches`.
RunOutput run_experiment(const ExperimentConfig& config, bool check,
                         std::vector<std::string>* mismatches);

// Writes requests.csv, steps.csv, events.jsonl and summary.json of one run into `directory`.
void write_run_outputs(const std::filesystem::path& directory, const ExperimentConfig& config,
                       const RunOutput& output);

}  // namespace kvlab
