// Stage 1: every sweep point is checked before anything runs: its plugins exist and accept
// their parameters, the model, profile and inputs resolve, the backend rules hold.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <variant>

#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv/kv_groups.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/speculation/speculation.hpp"
#include "kvlab/suggest.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

// The synthetic workload's [workload] keys that requests read from `real` would not use: a
// trace's times and lengths are its own; the Azure and Mooncake traces replay their lengths
// (EOS ignored); a prompt set's answers end at EOS within [workload.prompts] max_tokens, and
// it takes its arrivals (arrival, rate, cv, burst_size) from [workload].
std::vector<std::string> synthetic_keys_ignored(const ExperimentConfig& c) {
  std::vector<std::string> ignored{"requests", "prompt_tokens", "output_tokens", "prefix_groups",
                                   "prefix_tokens"};
  if (c.prompt_set.empty()) ignored.insert(ignored.end(), {"arrival", "rate", "cv", "burst_size"});
  const bool mooncake =
      !c.trace.empty() && std::filesystem::is_regular_file(c.trace) && is_mooncake_trace(c.trace);
  if (!c.azure_trace.empty() || !c.prompt_set.empty() || mooncake)
    ignored.emplace_back("ignore_eos");
  std::vector<std::string> given;
  for (const std::string& key : c.workload_keys_given)
    if (std::find(ignored.begin(), ignored.end(), key) != ignored.end())
      given.push_back("workload." + key);
  return given;
}

// Synthetic settings beside the requests of `real` (a file) are errors that say what to do.
void check_no_synthetic_settings(const ExperimentConfig& c, const std::string& real) {
  const std::vector<std::string> ignored = synthetic_keys_ignored(c);
  if (ignored.empty()) return;
  const bool one = ignored.size() == 1;
  throw Error(fmt::format(
      "{} {} the synthetic workload's, and the requests of {} would not use {}: delete {} from "
      "[workload], or replace the whole table from the command line (--set 'workload={{{}}}')",
      fmt::join(ignored, ", "), one ? "is" : "are", real, one ? "it" : "them", one ? "it" : "them",
      !c.trace.empty()         ? "trace=\"FILE\""
      : !c.azure_trace.empty() ? "azure_trace={file=\"FILE\"}"
                               : "prompts={file=\"FILE\"}, arrival=\"poisson\", rate=R"));
}

// Repeats of a replay that would be one run N times are refused. On a priced clock a replay's
// times come from its lengths alone: fixed by the Azure and Mooncake traces (EOS ignored), by a
// kvlab trace with ignore_eos, and by the simulated backend's tokens whatever the seed.
void check_repeats_differ(const ExperimentConfig& c, const std::string& real) {
  const bool timed_by_the_machine =
      c.clock == EngineClock::measured || c.clock == EngineClock::wall;
  const bool mooncake =
      !c.trace.empty() && std::filesystem::is_regular_file(c.trace) && is_mooncake_trace(c.trace);
  const bool lengths_fixed = c.backend_kind == BackendKind::simulated || !c.azure_trace.empty() ||
                             (!c.trace.empty() && (c.workload.ignore_eos || mooncake));
  if (c.repeats > 1 && (!c.trace.empty() || !c.azure_trace.empty()) && lengths_fixed &&
      !timed_by_the_machine)
    throw Error(fmt::format(
        "experiment.repeats = {} on {}: the run replays the trace's requests at their times "
        "with their lengths on a priced clock, and the seed changes only token ids, so every "
        "repeat is the same run (a \"± 0.000\" that is no confidence): set repeats = 1, and sweep "
        "time windows of the trace for independent samples (workload.azure_trace.start_s, "
        "[workload.replay] start_s)",
        c.repeats, real));
}

// Settings the workload cannot honour are errors: synthetic settings beside a file's requests,
// priorities drawn for requests a file gives, repeats of a replay that would be one run N times.
void check_workload_honoured(const ExperimentConfig& c) {
  const std::string real = !c.trace.empty()         ? c.trace
                           : !c.azure_trace.empty() ? c.azure_trace
                           : !c.prompt_set.empty()  ? c.prompt_set
                                                    : std::string();
  if (real.empty()) return;
  check_no_synthetic_settings(c, real);
  if (c.workload.priority_weights != std::vector<double>{1.0})
    throw Error(fmt::format(
        "workload.priority_weights draws a priority for each synthetic request; the requests "
        "of {} are not drawn (a kvlab trace carries its own priority column, the others have "
        "none): delete priority_weights, or give the trace a priority column",
        real));
  check_repeats_differ(c, real);
}

// The workload's files exist and suit it (a Mooncake replay, a prompt set's tokenizer).
void check_workload_files(const ExperimentConfig& c, const ModelSource& source) {
  if (!c.trace.empty() && !std::filesystem::is_regular_file(c.trace))
    throw Error(fmt::format("workload.trace {} is not a file{}", c.trace, data_set_hint(c.trace)));
  if (c.replay_given && !is_mooncake_trace(c.trace))
    throw Error(
        fmt::format("[workload.replay] is for a Mooncake trace (rows with hash_ids); {} "
                    "is not one",
                    c.trace));
  if (!c.azure_trace.empty() && !std::filesystem::is_regular_file(c.azure_trace))
    throw Error(fmt::format("workload.azure_trace.file {} is not a file{}", c.azure_trace,
                            data_set_hint(c.azure_trace)));
  if (!c.prompt_set.empty() && !std::filesystem::is_regular_file(c.prompt_set))
    throw Error(fmt::format("workload.prompts.file {} is not a file{}", c.prompt_set,
                            data_set_hint(c.prompt_set)));
  if (!c.prompt_set.empty() && source.is_preset())
    throw Error(
        fmt::format("workload.prompts needs a real model with a tokenizer; \"{}\" is a "
                    "preset (random weights, no tokenizer)",
                    c.model));
}

// [kv_tiers] on a point whose allocator, backend and disk folder can hold them.
void check_kv_tiers(const ExperimentConfig& c) {
  const auto caching = c.allocator_params.find("prefix_caching");
  if (caching != c.allocator_params.end() && caching->second == ParamValue{false})
    throw Error(
        "[kv_tiers] keeps the blocks the prefix cache evicts: it needs "
        "kv_cache.params.prefix_caching = true");
  if (c.backend_kind == BackendKind::plugin)
    throw Error(fmt::format(
        "[kv_tiers] runs on the cpu backend (real copies) and the simulated one (priced "
        "copies), not \"{}\": a GPU pool's blocks the tiers cannot copy yet",
        c.backend));
  if (!c.disk_tier_directory.empty() && c.disk_tier_gib > 0 &&
      !std::filesystem::is_directory(c.disk_tier_directory))
    throw Error(fmt::format("kv_tiers.disk_directory {} is not a folder", c.disk_tier_directory));
}

// [kv_policy] on a point that can drop positions: the paged allocator without prefix caching, a
// backend that reads views with holes (and reports attention scores when the policy reads them).
void check_kv_policy(const ExperimentConfig& c, const PluginRegistry& registry) {
  const auto caching = c.allocator_params.find("prefix_caching");
  if (c.allocator != "paged" || caching == c.allocator_params.end() ||
      caching->second != ParamValue{false})
    throw Error(
        "[kv_policy] drops positions from sequences' blocks: it needs kv_cache.allocator = "
        "\"paged\" with kv_cache.params.prefix_caching = false");
  if (c.backend_kind == BackendKind::plugin)
    throw Error(fmt::format(
        "[kv_policy] runs on the cpu backend (and the simulated one, for policies that read no "
        "attention scores), not \"{}\", whose attention reads whole block tables",
        c.backend));
  if (c.attention == "recompute" || c.disaggregated())
    throw Error(
        "[kv_policy] thins cached KV: it needs an attention variant that caches it (not "
        "\"recompute\") and no prefill/decode disaggregation (thinned KV is not handed off)");
  PluginContext context;  // its parameters' own rules (sinks below the budget, ...)
  const auto policy =
      registry.create<PluginKind::kv_policy>(c.kv_policy, c.kv_policy_params, context);
  if (policy->scored_queries() > 0 && c.backend_kind != BackendKind::cpu)
    throw Error(fmt::format(
        "KV policy \"{}\" reads attention scores, which only backend \"cpu\" reports (not "
        "\"{}\")",
        c.kv_policy, c.backend));
}

// KIVI's key groups are 32 consecutive slots, written in order and copied whole (KvPool): a
// paged allocator's blocks of a multiple of 32 slots, and no window releasing part of them (a KV
// policy's drops move rows between groups through KvPool::move_slot).
void check_kivi(const ExperimentConfig& c, const PluginParams& allocator) {
  const auto block = allocator.values().find("block_size");
  const std::int64_t* size =
      block == allocator.values().end() ? nullptr : std::get_if<std::int64_t>(&block->second);
  if (c.allocator != "paged" || size == nullptr || *size % kKiviGroup != 0)
    throw Error(fmt::format(
        "kv_cache.dtype = \"{}\" quantizes keys per channel over groups of {} consecutive slots: "
        "it needs allocator \"paged\" with block_size a multiple of {}, not allocator \"{}\"{}",
        dtype_short_name(c.kv_dtype), kKiviGroup, kKiviGroup, c.allocator,
        size != nullptr ? fmt::format(" with block_size {}", *size) : std::string()));
  if (c.attention == "sliding_window")
    throw Error(fmt::format(
        "kv_cache.dtype = \"{}\" keeps each group of {} keys whole; attention "
        "\"sliding_window\" drops positions from inside them: use another kv_cache.dtype (int2, "
        "q4_1) with it",
        dtype_short_name(c.kv_dtype), kKiviGroup));
}

// A block format's rows: a head's values (MLA: half the latent) in whole blocks of 32. K and V
// in dtypes apart: the cpu backend's pool, KIVI's both or neither, not a latent's halves.
void check_kv_dtype_rows(const ExperimentConfig& c, const ModelConfig& model) {
  for (const bool value : {false, true}) {
    if (dtype_row_fits(c.kv_dtype_of(value), model.cache_head_dim())) continue;
    throw Error(
        fmt::format("kv_cache.{} = \"{}\" stores blocks of 32 values: it needs {} to be a multiple "
                    "of 32, and {} has {} (int8 and fp8 fit any head_dim)",
                    value ? "value_dtype" : "dtype", dtype_short_name(c.kv_dtype_of(value)),
                    model.is_mla() ? "half the latent (a slot's K or V row)" : "head_dim",
                    model.name, model.cache_head_dim()));
  }
  if (c.kv_dtype_of(true) == c.kv_dtype) return;
  std::string refused;
  if (c.backend_kind != BackendKind::cpu)
    refused = fmt::format("backend \"{}\" keeps K and V in one dtype", c.backend);
  else if (dtype_is_kivi(c.kv_dtype) || dtype_is_kivi(c.kv_dtype_of(true)))
    refused = "KIVI quantizes K per channel and V per token at one width: give it to both";
  else if (model.is_mla())
    refused = fmt::format("{} caches one latent a token, not K and V", model.name);
  if (!refused.empty())
    throw Error(fmt::format("kv_cache.dtype = \"{}\" with value_dtype = \"{}\": {}",
                            dtype_short_name(c.kv_dtype), dtype_short_name(c.kv_dtype_of(true)),
                            refused));
}

// Latent attention (MLA) caches one latent a token a layer: what needs K and V per head does not
// apply, and no attention variant may regroup K/V heads it does not cache.
void check_latent_attention(const ExperimentConfig& c, const PluginRegistry& registry,
                            const ModelConfig& model) {
  if (!model.is_mla()) return;
  if (c.kv_hadamard || !c.kv_policy.empty() || dtype_is_kivi(c.kv_dtype))
    throw Error(fmt::format(
        "{} has latent attention: a token's cache is one latent, not K and V per head, so "
        "kv_cache.rotation = \"hadamard\", a [kv_policy] and KIVI pools do not apply",
        model.name));
  PluginContext context;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  const auto attention =
      registry.create<PluginKind::attention_variant>(c.attention, c.attention_params, context);
  refuse_kv_regrouping_of_latent(model, c.attention, attention->kv_heads(model));
}

// kv_cache.groups = "per_kind" (kvlab/kv/kv_groups.hpp) on a model of two attention kinds and a
// point that uses only what the grouped allocator does: each group's blocks are a sequence of
// their own to the allocator plugin, so no swapping or KV handed to another replica (they copy
// one view), no KIVI pool (its groups of 32 rows would differ between KV groups).
void check_kv_groups(const ExperimentConfig& c, const ModelConfig& model) {
  if (!c.kv_groups) return;
  if (kv_layer_groups(model, true).uniform())
    throw Error(fmt::format(
        "kv_cache.groups = \"per_kind\" groups layers by attention kind, and every layer of {} "
        "is of one kind: use \"uniform\"",
        model.name));
  const auto swap = c.scheduler_params.find("preemption");
  std::string refused;
  if (c.backend_kind == BackendKind::plugin)
    refused =
        fmt::format("backend \"{}\" (the cpu and simulated backends read KV groups)", c.backend);
  else if (swap != c.scheduler_params.end() && swap->second == ParamValue{std::string("swap")})
    refused = "swap preemption (use scheduler.params.preemption = \"recompute\")";
  else if (dtype_is_kivi(c.kv_dtype))
    refused = "a KIVI pool";
  else if (c.has_kv_tiers() || c.disaggregated())
    refused = "[kv_tiers] or prefill/decode disaggregation";
  if (!refused.empty())
    throw Error(fmt::format(
        "kv_cache.groups = \"per_kind\" does not run with {} yet: each group's blocks are a "
        "sequence of their own to the allocator (docs/concepts/hybrid-attention.md)",
        refused));
}

// One point's plugins exist and accept their parameters; the model, profile and trace resolve.
// A simulated drafter's measured acceptance (speculation.accept_trace): read now, so that its
// errors come before anything runs.
void check_accept_trace(const SpeculationOptions& speculation) {
  if (!speculation.accept_trace.empty()) (void)load_accept_trace(speculation.accept_trace);
}

// The draft ([speculation] draft_model or draft_layers) fits the target: the same vocabulary,
// fewer layers than the target when they are its own.
void check_draft(const ExperimentConfig& c, const ModelConfig& target) {
  if (c.draft_layers >= target.num_hidden_layers)
    throw Error(fmt::format(
        "speculation.draft_layers = {}: the draft is the target's first layers, so it needs "
        "fewer than {}'s {}",
        c.draft_layers, target.name, target.num_hidden_layers));
  if (c.draft_model.empty()) return;
  const ModelSource draft = resolve_model(c.draft_model);
  if (draft.config.vocab_size != target.vocab_size)
    throw Error(fmt::format(
        "speculation.draft_model \"{}\" has a vocabulary of {} tokens and the target {} has {}: "
        "a draft proposes the target's token ids, so the two need the same tokenizer",
        c.draft_model, draft.config.vocab_size, target.name, target.vocab_size));
  if (draft.config.size_only && c.backend_kind != BackendKind::simulated)
    throw Error(fmt::format(
        "speculation.draft_model \"{}\" is a size-only preset: a computed draft needs weights "
        "(it prices the draft's steps on backend \"simulated\" only)",
        c.draft_model));
}

// [speculation]: the proposer plugin takes its parameters, a simulated drafter's accept trace
// reads, the draft fits the target.
void check_speculation(const ExperimentConfig& c, const PluginRegistry& registry,
                       const ModelConfig& target) {
  check_accept_trace(c.speculation);
  if (!c.speculation.enabled()) return;
  const PluginInfo& info = registry.find(PluginKind::proposer, c.speculation.proposer);
  (void)validate_plugin_params(info.name, info.params, proposer_params(c));
  check_draft(c, target);
}

void validate_point(const ExperimentConfig& c, bool check, const PluginRegistry& registry) {
  const bool simulated = c.backend_kind == BackendKind::simulated;
  check_backend_rules(c, check);
  auto check_plugin = [&](PluginKind kind, const std::string& name, const ParamMap& params) {
    const PluginInfo& info = registry.find(kind, name);
    return validate_plugin_params(info.name, info.params, params);
  };
  check_plugin(PluginKind::attention_variant, c.attention, c.attention_params);
  const PluginParams allocator =
      check_plugin(PluginKind::kv_allocator, c.allocator, c.allocator_params);
  if (dtype_is_kivi(c.kv_dtype)) check_kivi(c, allocator);
  check_plugin(PluginKind::scheduler, c.scheduler, c.scheduler_params);
  check_plugin(PluginKind::backend, c.backend, backend_params(c));
  if (c.profile.empty() &&
      (c.clock == EngineClock::virtual_clock || c.clock == EngineClock::offline))
    throw Error(fmt::format(
        "backend \"{}\" on the {} clock needs backend.profile, the device its steps are priced "
        "on: a name ({}) or a .toml file; or experiment.clock = \"measured\"",
        c.backend, clock_name(c.clock), join_names(hardware_profile_names())));
  const ModelSource source = resolve_model(c.model);
  if (source.config.size_only && !simulated)
    throw Error(
        fmt::format("model \"{}\" is a size-only preset: it runs only on backend "
                    "\"simulated\" (no weights exist for it)",
                    c.model));
  const std::int64_t hd = source.config.head_dim;
  check_latent_attention(c, registry, source.config);
  if (c.kv_hadamard && (c.backend_kind != BackendKind::cpu || hd <= 0 || (hd & (hd - 1)) != 0))
    throw Error(fmt::format(
        "kv_cache.rotation = \"hadamard\" rotates the cpu backend's K/V heads by a Walsh-Hadamard "
        "matrix: it needs backend \"cpu\" (not \"{}\") and head_dim a power of two ({} has {})",
        c.backend, source.config.name, hd));
  check_kv_dtype_rows(c, source.config);
  check_speculation(c, registry, source.config);
  check_kv_groups(c, source.config);
  if (c.replicas > 1) check_plugin(PluginKind::router, c.router, c.router_params);
  if (c.disaggregated()) check_plugin(PluginKind::router, c.decode_router, c.decode_router_params);
  if (!c.kv_policy.empty()) check_kv_policy(c, registry);
  if (c.has_kv_tiers()) {
    check_plugin(PluginKind::tier_policy, c.tier_policy, c.tier_policy_params);
    check_kv_tiers(c);
  }
  if (!c.profile.empty()) {
    const HardwareProfile profile = load_hardware_profile(c.profile, c.hardware_changes);
    // Tensor parallelism: the GPUs divide the heads, the profile prices their all-reduces.
    for (const std::int64_t tp :
         {c.tensor_parallel, c.tensor_parallel_of(0), c.tensor_parallel_of(c.replicas - 1)})
      if (tp > 1 || c.context_parallel > 1)
        (void)CostModel(source.config, profile, tp, c.context_parallel);
  }
  check_workload_files(c, source);
  check_workload_honoured(c);
}

}  // namespace

namespace {
void check_exact_settings(const ExperimentConfig& c);
}  // namespace

// Rules across [backend] and the command: no check of a backend that computes nothing, nor of
// rounded weights, activations or KV without a tolerance.
void check_backend_rules(const ExperimentConfig& c, bool check) {
  const bool simulated = c.backend_kind == BackendKind::simulated;
  if (simulated && check)
    throw Error(
        "kvlab check compares computed tokens with the reference: it needs backend \"cpu\", not "
        "\"simulated\" (which computes nothing)");
  if (c.replicas > 1 && c.clock == EngineClock::wall)
    throw Error(
        "[cluster]: the replicas step one at a time on one timeline, so real time would add "
        "every replica's steps together: use the virtual, offline or measured clock");
  // The cuda backend's device pool quantizes to fp8 and int8 ("f32": its compute dtype).
  const bool device_kv_format = c.backend == "cuda" && (c.kv_dtype == DType::dtype_f8_e4m3 ||
                                                        c.kv_dtype == DType::dtype_kv_int8);
  if (c.kv_dtype != DType::dtype_f32 && c.backend_kind != BackendKind::cpu && !device_kv_format)
    throw Error(fmt::format(
        "kv_cache.dtype = \"{}\" is the cpu backend's KV pool; backend \"{}\" keeps K/V its "
        "own way{}",
        dtype_short_name(c.kv_dtype), c.backend,
        c.backend == "cuda" ? " (in its dtype, or quantized: kv_cache.dtype \"fp8\" or \"int8\")"
                            : ""));
  if (c.disaggregated() && check && c.check_tolerance > 0)
    throw Error(
        "kvlab check --tolerance reads each token's logits from the replica that made it; a "
        "disaggregated cluster's first token comes from another replica than the rest: check it "
        "without --tolerance (tokens equal to the reference)");
  if (c.disaggregated() && c.attention == "recompute")
    throw Error(
        "[cluster] prefill_replicas hands each request's KV to a decode replica: attention "
        "\"recompute\" keeps no KV to hand over");
  // A check with a tolerance accepts tokens chosen from nearly tied logits: the rounded settings.
  if (check && c.check_tolerance == 0) check_exact_settings(c);
}

namespace {

// kvlab check without --tolerance: every setting that rounds what the reference computes in
// fp32 (weights, activations, KV) is refused, naming the setting and what to use instead.
void check_exact_settings(const ExperimentConfig& c) {
  if (c.cpu_weights && c.cpu_weights != cpu::WeightFormat::f32)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the reference over the checkpoint's own values; "
        "backend.weights = \"{}\" rounds them first: check with \"stored\" (the default), or "
        "with --tolerance TAU to accept tokens whose reference logit is within TAU of the best",
        cpu::weight_choice_name(c.cpu_weights)));
  if (c.cpu_activations != cpu::ActivationFormat::f32)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the reference's fp32 products; backend.activations = "
        "\"{}\" rounds the activations of the products it applies to: check with \"f32\" (the "
        "default), or with --tolerance TAU",
        cpu::activation_format_name(c.cpu_activations)));
  if (c.kv_dtype_of(false) != DType::dtype_f32 || c.kv_dtype_of(true) != DType::dtype_f32 ||
      c.kv_hadamard)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the fp32 reference; a {}{} KV pool rounds every K and "
        "V, so near-tied logits can pick other tokens: check with kv_cache.dtype = \"f32\" (no "
        "rotation), or with --tolerance TAU",
        c.kv_hadamard ? "Hadamard-rotated " : "",
        dtype_short_name(c.kv_dtype_of(c.kv_dtype == DType::dtype_f32))));
  if (!c.kv_policy.empty())
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the reference, which attends to every position; KV "
        "policy \"{}\" drops positions, which changes the logits by design: check without "
        "[kv_policy], or with --tolerance TAU (its price in quality: kvlab perplexity "
        "--kv-policy)",
        c.kv_policy));
}

}  // namespace

void validate_experiment(const std::vector<ExperimentRun>& runs, bool check) {
  std::map<std::vector<std::string>, std::unique_ptr<PluginRegistry>> registries;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ExperimentConfig& c = runs[i].config;
    auto& registry = registries[c.plugin_paths];
    if (!registry) registry = std::make_unique<PluginRegistry>(plugin_search_path(c));
    try {
      validate_point(c, check, *registry);
    } catch (const Error& e) {
      if (c.label.empty()) throw;
      throw Error(fmt::format("sweep point {} ({}): {}", i + 1, c.label, e.what()));
    }
  }
}

}  // namespace kvlab
