// Running one experiment config: model, pool, plugins, backend, engine; outputs to files.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "engine_logit_log.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/engine/cluster.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/suggest.hpp"
#include "run_memo.hpp"
#include "timed_backend.hpp"

namespace kvlab {

namespace {

// Rules across [backend] and the command: parameters only for plugin backends, no check of a
// backend that computes nothing.
void check_backend_rules(const ExperimentConfig& c, bool check) {
  const bool simulated = c.backend == "simulated";
  const bool plugin_backend = c.backend != "cpu" && !simulated;
  if (!plugin_backend && !c.backend_params.empty())
    throw Error(fmt::format(
        "backend.params are for backend plugins (such as cuda); the built-in \"{}\" backend "
        "takes none",
        c.backend));
  if (simulated && check)
    throw Error(
        "kvlab check compares computed tokens with the reference: it needs backend \"cpu\", not "
        "\"simulated\" (which computes nothing)");
  if (c.replicas > 1 && c.clock == "wall")
    throw Error(
        "[cluster]: the replicas step one at a time on one timeline, so real time would add "
        "every replica's steps together: use the virtual, offline or measured clock");
  if (c.kv_dtype != DType::dtype_f32 && c.backend != "cpu")
    throw Error(
        fmt::format("kv_cache.dtype = \"{}\" is the cpu backend's KV pool; backend \"{}\" "
                    "keeps K/V its own way",
                    dtype_short_name(c.kv_dtype), c.backend));
  // A check with a tolerance accepts tokens chosen from nearly tied logits: the rounded settings.
  check = check && c.check_tolerance == 0;
  if (c.cpu_weights != "stored" && c.cpu_weights != "f32" && check)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the reference over the checkpoint's own values; "
        "backend.weights = \"{}\" rounds them first: check with \"stored\" (the default), or "
        "with --tolerance TAU to accept tokens whose reference logit is within TAU of the best",
        c.cpu_weights));
  if (c.cpu_activations != "f32" && check)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the reference's fp32 products; backend.activations = "
        "\"{}\" rounds the activations of the products it applies to: check with \"f32\" (the "
        "default), or with --tolerance TAU",
        c.cpu_activations));
  if (c.kv_dtype != DType::dtype_f32 && check)
    throw Error(fmt::format(
        "kvlab check holds tokens equal to the fp32 reference; a {} KV pool rounds every K and V, "
        "so near-tied logits can pick other tokens: check with kv_cache.dtype = \"f32\", or with "
        "--tolerance TAU",
        dtype_short_name(c.kv_dtype)));
}

// One point's plugins exist and accept their parameters; the model, profile and trace resolve.
void validate_point(const ExperimentConfig& c, bool check, const PluginRegistry& registry) {
  const bool simulated = c.backend == "simulated";
  const bool plugin_backend = c.backend != "cpu" && !simulated;
  check_backend_rules(c, check);
  auto check_plugin = [&](PluginKind kind, const std::string& name, const ParamMap& params) {
    const PluginInfo& info = registry.find(kind, name);
    (void)validate_plugin_params(info.name, info.params, params);
  };
  check_plugin(PluginKind::attention_variant, c.attention, c.attention_params);
  check_plugin(PluginKind::kv_allocator, c.allocator, c.allocator_params);
  check_plugin(PluginKind::scheduler, c.scheduler, c.scheduler_params);
  if (plugin_backend) check_plugin(PluginKind::backend, c.backend, c.backend_params);
  if (c.profile.empty() && (c.clock == "virtual" || c.clock == "offline"))
    throw Error(fmt::format(
        "backend \"{}\" on the {} clock needs backend.profile, the device its steps are priced "
        "on: a name ({}) or a .toml file; or experiment.clock = \"measured\"",
        c.backend, c.clock, join_names(hardware_profile_names())));
  const ModelSource source = resolve_model(c.model);
  if (source.config.size_only && !simulated)
    throw Error(
        fmt::format("model \"{}\" is a size-only preset: it runs only on backend "
                    "\"simulated\" (no weights exist for it)",
                    c.model));
  if (c.replicas > 1) check_plugin(PluginKind::router, c.router, c.router_params);
  if (!c.profile.empty()) {
    const HardwareProfile profile = load_hardware_profile(c.profile);
    // Tensor parallelism: the GPUs divide the heads, the profile prices their all-reduces.
    if (c.tensor_parallel > 1) (void)CostModel(source.config, profile, c.tensor_parallel);
  }
  if (!c.trace.empty() && !std::filesystem::is_regular_file(c.trace))
    throw Error(fmt::format("workload.trace {} is not a file", c.trace));
  if (!c.azure_trace.empty() && !std::filesystem::is_regular_file(c.azure_trace))
    throw Error(fmt::format("workload.azure_trace.file {} is not a file", c.azure_trace));
  if (!c.prompt_set.empty() && !std::filesystem::is_regular_file(c.prompt_set))
    throw Error(fmt::format("workload.prompts.file {} is not a file", c.prompt_set));
  if (!c.prompt_set.empty() && source.is_preset())
    throw Error(
        fmt::format("workload.prompts needs a real model with a tokenizer; \"{}\" is a "
                    "preset (random weights, no tokenizer)",
                    c.model));
}

}  // namespace

void validate_experiment(const std::vector<ExperimentRun>& runs, bool check) {
  std::map<std::vector<std::string>, std::unique_ptr<PluginRegistry>> registries;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ExperimentConfig& c = runs[i].config;
    auto& registry = registries[c.plugin_paths];
    if (!registry) {
      auto search = PluginRegistry::default_search_path();
      search.insert(search.end(), c.plugin_paths.begin(), c.plugin_paths.end());
      registry = std::make_unique<PluginRegistry>(search);
    }
    try {
      validate_point(c, check, *registry);
    } catch (const Error& e) {
      if (c.label.empty()) throw;
      throw Error(fmt::format("sweep point {} ({}): {}", i + 1, c.label, e.what()));
    }
  }
}

namespace {

// The model as served: the checkpoint (none for the simulated backend), its config after the
// attention variant converted its K/V heads, and the variant.
struct ServedModel {
  std::optional<cpu::LlamaWeights> weights;  // as converted for the attention variant
  std::filesystem::path source;              // the checkpoint's folder or .gguf; empty: preset
  std::string weights_key;                   // names them exactly (checkpoint, K/V heads)
  ModelConfig config;
  PluginObject<AttentionVariant> attention;
};

ServedModel load_served_model(const ExperimentConfig& c, const PluginRegistry& registry,
                              bool simulated) {
  const ModelSource source = resolve_model(c.model);
  ServedModel served;
  served.config = source.config;
  served.source = source.directory;
  LoadedCheckpoint checkpoint;
  if (!simulated) {  // the simulated backend needs only the config
    checkpoint = load_checkpoint(source, c.weights_seed);
    served.config = checkpoint.weights->config;
  }
  PluginContext context;
  context.model = &served.config;
  context.max_seq_len = served.config.max_position_embeddings;
  served.attention =
      registry.create<PluginKind::attention_variant>(c.attention, c.attention_params, context);
  if (const std::string problem = served.attention->check(served.config); !problem.empty())
    throw Error(fmt::format("attention \"{}\" cannot run {}: {}", c.attention, served.config.name,
                            problem));
  const std::int64_t kv_heads = served.attention->kv_heads(served.config);
  if (checkpoint.weights) {
    served.weights = cpu::convert_kv_heads(*checkpoint.weights, kv_heads);
    served.weights_key = fmt::format("{}, {} K/V heads", checkpoint.key, kv_heads);
    served.config = served.weights->config;
  } else {
    served.config.num_key_value_heads = kv_heads;
  }
  return served;
}

// The cost model that prices the run's steps: the profile's device; the cpu backend's run is
// priced with its own KV dtype (kv_cache.dtype).
std::optional<CostModel> run_cost_model(const ExperimentConfig& c, const ModelConfig& model) {
  if (c.profile.empty()) return std::nullopt;
  HardwareProfile profile = load_hardware_profile(c.profile);
  if (c.backend == "cpu") profile.kv_dtype = c.kv_dtype;
  return CostModel(model, profile, c.tensor_parallel);
}

// The pool's capacity in tokens: [kv_cache] slots, a byte budget (whole blocks of 64; simulated
// KV in the profile's dtype, real KV in kv_cache.dtype), or what the simulated device holds next to
// the weights.
std::int64_t pool_slots(const ExperimentConfig& c, const ModelConfig& model, bool simulated,
                        const std::optional<CostModel>& cost_model) {
  if (c.kv_memory_mib) {
    const double bytes_per_slot =
        simulated ? static_cast<double>(cost_model->kv_bytes_per_token_per_gpu())
                  : 2.0 * static_cast<double>(model.num_hidden_layers * model.kv_dim()) *
                        static_cast<double>(dtype_size(c.kv_dtype));
    const double budget_slots = *c.kv_memory_mib * 1024 * 1024 / bytes_per_slot;
    if (!(budget_slots < 0x1p62))
      throw Error(fmt::format("kv_cache.memory_mib {} is more memory than kvlab can address",
                              *c.kv_memory_mib));
    const std::int64_t slots = static_cast<std::int64_t>(budget_slots) / 64 * 64;
    if (slots < 1)
      throw Error(
          fmt::format("kv_cache.memory_mib {} holds no token of {}", *c.kv_memory_mib, model.name));
    return slots;
  }
  if (!simulated || c.kv_slots) return c.kv_slots.value_or(4096);
  const std::int64_t slots = cost_model->kv_capacity_tokens() / 256 * 256;  // whole blocks
  if (slots < 1)
    throw Error(
        fmt::format("{} does not fit on {}: {:.1f} GiB of weights, {:.1f} GiB usable (memory_gib x "
                    "utilization - activation reserve)",
                    model.name, cost_model->profile().name, cost_model->weight_bytes() / kGiB,
                    cost_model->profile().memory_gib * cost_model->profile().memory_utilization -
                        cost_model->profile().activation_reserve_gib));
  return slots;
}

// A prompt set's requests: each text through the model's tokenizer, and its chat template
// when the experiment asks for one (workload.prompts.chat).
RealWorkload prompt_requests(const ExperimentConfig& c, const ModelConfig& model,
                             std::unique_ptr<Tokenizer>& tokenizer_out) {
  const ModelSource source = resolve_model(c.model);
  if (source.is_preset())
    throw Error(
        fmt::format("workload.prompts needs a real model with a tokenizer; \"{}\" is a "
                    "preset (random weights, no tokenizer)",
                    c.model));
  TokenizerLookup lookup = find_tokenizer(source.directory, model.vocab_size);
  if (!lookup.tokenizer) throw Error(fmt::format("workload.prompts: {}", lookup.why_not));
  const Tokenizer& tokenizer = *lookup.tokenizer;
  std::optional<ChatTemplate> chat;
  if (c.prompt_chat) chat = ChatTemplate::detect(lookup.chat_template, source.directory.string());
  PromptSetOptions options;
  options.requests = c.prompt_requests;
  options.max_tokens = c.prompt_max_tokens;
  options.context = model.max_position_embeddings;
  options.arrival = c.workload.arrival;
  options.seed = c.seed;
  options.sampling = workload_sampling(c.workload);
  auto encode = [&](const std::string& text) {
    if (!chat) return tokenizer.encode_prompt(text);
    const std::vector<ChatMessage> messages = {{"user", text}};
    return chat->render(messages, tokenizer);
  };
  RealWorkload workload = prompt_set_workload(load_prompt_texts(c.prompt_set), encode, options);
  tokenizer_out = std::move(lookup.tokenizer);
  return workload;
}

// The trace, the Azure trace, the prompt set, or the synthetic workload; greedy everywhere for
// `check`.
RealWorkload make_requests(const ExperimentConfig& c, const ModelConfig& model, bool check,
                           std::unique_ptr<Tokenizer>& tokenizer) {
  RealWorkload w;
  if (!c.trace.empty()) {
    TraceOptions options;
    options.vocab_size = model.vocab_size;
    options.seed = c.seed;
    options.sampling = workload_sampling(c.workload);
    options.sampling.ignore_eos = c.workload.ignore_eos;
    w.requests = load_trace(c.trace, options);
  } else if (!c.azure_trace.empty()) {
    AzureTraceOptions options = c.azure;
    options.context = model.max_position_embeddings;
    options.vocab_size = model.vocab_size;
    options.seed = c.seed;
    options.sampling = workload_sampling(c.workload);
    w = load_azure_trace(c.azure_trace, options);
  } else if (!c.prompt_set.empty()) {
    w = prompt_requests(c, model, tokenizer);
  } else {
    SyntheticWorkload spec = c.workload;
    spec.vocab_size = model.vocab_size;
    w.requests = generate_workload(spec);
  }
  check_arrival_times(w.requests, !c.trace.empty()         ? c.trace
                                  : !c.azure_trace.empty() ? c.azure_trace
                                  : !c.prompt_set.empty()  ? std::string("workload.prompts")
                                                           : "the workload's arrival process");
  if (check)
    for (auto& r : w.requests) r.sampling.temperature = 0;  // check compares greedy tokens
  return w;
}

EngineOptions engine_options(const ExperimentConfig& c, const SequenceRules& rules,
                             const std::optional<CostModel>& cost_model, KvPool& pool) {
  EngineOptions options;
  options.clock = c.clock == "offline"    ? EngineClock::offline
                  : c.clock == "wall"     ? EngineClock::wall
                  : c.clock == "measured" ? EngineClock::measured
                                          : EngineClock::virtual_clock;
  if (cost_model) options.cost_model = &*cost_model;
  options.rules = rules;
  options.pool = &pool;
  options.swap_slots = c.swap_slots;
  return options;
}

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
    out.mean_kv_waste += wasted_slots(s) / capacity;
    held += static_cast<double>(s.kv.used + s.kv.reserved_unused + s.kv.last_block_slack);
    held_waste +=
        static_cast<double>(s.kv.reserved_unused + s.kv.last_block_slack + s.padding_slots);
  }
  if (!out.engine.steps.empty()) {
    out.mean_kv_used /= static_cast<double>(out.engine.steps.size());
    out.mean_kv_waste /= static_cast<double>(out.engine.steps.size());
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

// Where each request of a run was served: its replica and its id in that replica's engine.
using EngineSlots = std::vector<std::pair<std::size_t, RequestId>>;

// Rows of engine logits kvlab check --tolerance keeps to compare with the reference's over the
// whole vocabulary (beyond it, each token's top 5 only): 512 MiB, ~4,000 rows of a 32k vocabulary.
constexpr std::size_t kComparedLogitBytes = std::size_t{512} << 20;

// The reference's choices for the generated tokens of `sequence` (from position `first`), and,
// with the engine's logits `log` (the request's, at `slot`), how close those were to the
// reference's: whole rows where kept (one reference forward, not memoized), the top 5 of every
// token.
std::vector<ReferenceChoice> compared_choices(
    const std::function<const cpu::ReferenceModel&()>& reference, const std::string& weights_key,
    std::optional<std::int64_t> window, std::span<const std::int32_t> sequence, std::size_t first,
    const EngineLogitLog* log, const std::pair<std::size_t, RequestId>& slot,
    LogitAgreement& agreement) {
  if (log == nullptr) return reference_choices(reference, weights_key, window, sequence, first);
  const EngineLogitLog::Request* logged = &log->request(slot.first, slot.second);
  const std::size_t generated = sequence.size() - 1 - first;
  if (logged->top.size() != generated)
    throw Error(
        fmt::format("the engine sampled {} rows of logits for a request that generated {} "
                    "tokens",
                    logged->top.size(), generated));
  const std::size_t kept = logged->kept_rows(log->vocab());
  std::vector<ReferenceChoice> choices;
  if (kept == 0) {
    choices = reference_choices(reference, weights_key, window, sequence, first);
  } else {
    const cpu::RowMatrix logits = reference_logits(reference(), window, sequence);  // (pos, vocab)
    choices = choices_from_logits(logits, sequence, first);
    const auto vocab = static_cast<std::size_t>(log->vocab());
    for (std::size_t t = 0; t < kept; ++t)
      agreement.add_row(std::span(logged->rows).subspan(t * vocab, vocab),
                        std::span(logits.row(static_cast<Eigen::Index>(first + t)).data(), vocab));
  }
  for (std::size_t t = 0; t < generated; ++t) agreement.add_top(logged->top[t], choices[t].top);
  return choices;
}

// One generated token against the reference's choice at its position: "" when it passes (the
// argmax, or within `tolerance` of it), else why not. Counts it in `check`.
std::string check_token(std::int32_t token, const ReferenceChoice& expected, double tolerance,
                        RunOutput::Check& check) {
  ++check.tokens;
  if (token == expected.argmax) return {};
  if (tolerance > 0 && expected.gap <= tolerance) {  // 0: even exact ties must be argmax
    ++check.off_argmax;
    check.max_gap = std::max(check.max_gap, static_cast<double>(expected.gap));
    return {};
  }
  return tolerance > 0 ? fmt::format(
                             "is {}, whose reference logit is {:.4g} below the best ({}), "
                             "beyond the tolerance {}",
                             token, expected.gap, expected.argmax, tolerance)
                       : fmt::format("is {}, the reference gives {}", token, expected.argmax);
}

// Teacher forcing: one reference forward over prompt + output checks every generated token
// (memoized per sequence: other sweep points asking for the same sequence share it). A token
// passes when it is the reference's argmax, or its logit is within `tolerance` of the argmax's;
// a request that asked for log-probabilities also needs them within logprob_tolerance of the
// reference's. With the engine's logits `log` (kvlab check --tolerance), out.check.logits
// measures them.
void check_against_reference(const ServedModel& served, std::optional<std::int64_t> window,
                             const std::vector<WorkloadRequest>& requests, double tolerance,
                             const EngineLogitLog* log, const EngineSlots& slots, RunOutput& out,
                             std::vector<std::string>& mismatches) {
  std::optional<cpu::ReferenceModel> model;  // built on the first sequence not seen before
  auto reference = [&]() -> const cpu::ReferenceModel& {
    if (!model) model.emplace(*served.weights);
    return *model;
  };
  const double logprob_tol = logprob_tolerance(tolerance);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::vector<std::int32_t>& tokens = out.engine.tokens[i];
    if (out.engine.requests[i].rejected || tokens.empty()) continue;
    const std::vector<GeneratedLogprobs>& logprobs = out.engine.logprobs[i];  // empty: not asked
    std::vector<std::int32_t> sequence = requests[i].prompt;
    sequence.insert(sequence.end(), tokens.begin(), tokens.end());
    const auto choices =
        compared_choices(reference, served.weights_key, window, sequence,
                         requests[i].prompt.size() - 1, log, slots[i], out.check.logits);
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      if (const std::string problem = check_token(tokens[t], choices[t], tolerance, out.check);
          !problem.empty()) {
        mismatches.push_back(fmt::format("request {}: token {} {}", i, t, problem));
        break;
      }
      if (t >= logprobs.size()) continue;
      if (const std::string problem =
              out.check.logprobs.add(logprobs[t], choices[t].logprobs, logprob_tol);
          !problem.empty()) {
        mismatches.push_back(fmt::format("request {}: token {} ({}): {} (beyond {})", i, t,
                                         tokens[t], problem, logprob_tol));
        break;
      }
    }
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace {

// One serving stack: its KV pool, allocator, scheduler, backend and engine (a cluster has one per
// replica). Members are destroyed in reverse: the device backend detaches before its pool goes.
struct ReplicaStack {
  std::unique_ptr<KvPool> pool;
  PluginObject<KvAllocator> allocator;
  PluginObject<Scheduler> scheduler;
  std::unique_ptr<Backend> inner;
  PluginObject<Backend> device_backend;
  std::unique_ptr<TimedBackend> backend;
  std::unique_ptr<Engine> engine;
  std::string weights_description;  // cpu backend: the formats its products read
};

// `scheduler plugin "fcfs" (/path/kvlab_plugin_fcfs.so)`: how engine errors name a plugin.
std::string plugin_label(const PluginRegistry& registry, PluginKind kind, const std::string& name) {
  return fmt::format("{} plugin \"{}\" ({})", plugin_kind_name(kind), name,
                     registry.find(kind, name).file.string());
}

std::unique_ptr<ReplicaStack> make_replica(const ExperimentConfig& c,
                                           const PluginRegistry& registry,
                                           const ServedModel& served,
                                           const std::optional<CostModel>& cost_model,
                                           std::int64_t slots, const SequenceRules& rules,
                                           EngineLogitLog* log, std::size_t replica) {
  const bool simulated = c.backend == "simulated";
  const bool plugin_backend = c.backend != "cpu" && !simulated;  // e.g. cuda
  const ModelConfig& model = served.config;
  auto r = std::make_unique<ReplicaStack>();
  // A plugin backend keeps K/V in its own (device) memory and attaches it to this pool; the
  // simulated device's pool has no storage, its dtype (the profile's) sizes swaps.
  r->pool = std::make_unique<KvPool>(
      KvPoolShape{model.num_hidden_layers, model.num_key_value_heads, model.head_dim, slots,
                  simulated ? cost_model->profile().kv_dtype : c.kv_dtype},
      simulated || plugin_backend ? KvStorage::none : KvStorage::host);
  PluginContext context;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  context.pool = r->pool.get();
  r->allocator =
      registry.create<PluginKind::kv_allocator>(c.allocator, c.allocator_params, context);
  r->scheduler = registry.create<PluginKind::scheduler>(c.scheduler, c.scheduler_params, context);
  if (simulated) {
    r->inner = std::make_unique<SimulatedBackend>(model.vocab_size, model.eos_token_ids);
  } else if (plugin_backend) {
    context.weights = &*served.weights;
    context.window = rules.window.value_or(0);
    r->device_backend = registry.create<PluginKind::backend>(c.backend, c.backend_params, context);
  } else {
    auto cpu_backend = std::make_unique<cpu::CpuBackend>(
        *served.weights, *r->pool, rules.window,
        cpu::select_compute_weights(*served.weights, served.source, c.cpu_weights,
                                    c.cpu_activations));
    r->weights_description = cpu_backend->matrices().description;
    r->inner = std::move(cpu_backend);
  }
  r->backend = std::make_unique<TimedBackend>(plugin_backend ? *r->device_backend : *r->inner);
  EngineOptions options = engine_options(c, rules, cost_model, *r->pool);
  options.names = {plugin_label(registry, PluginKind::scheduler, c.scheduler),
                   plugin_label(registry, PluginKind::kv_allocator, c.allocator),
                   plugin_backend ? plugin_label(registry, PluginKind::backend, c.backend)
                                  : c.backend + " backend"};
  if (log != nullptr)
    options.observers.on_logits = [log, replica](RequestId id, std::span<const float> row) {
      log->record(replica, id, row);
    };
  r->engine = std::make_unique<Engine>(*r->backend, *r->allocator, *r->scheduler, options);
  return r;
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
void run_replicas(const ExperimentConfig& c, const PluginRegistry& registry,
                  std::vector<std::unique_ptr<ReplicaStack>>& stacks,
                  const std::vector<WorkloadRequest>& requests, RunOutput& out,
                  EngineSlots& slots) {
  auto router = registry.create<PluginKind::router>(c.router, c.router_params, PluginContext{});
  std::vector<Engine*> engines;
  for (auto& stack : stacks) engines.push_back(stack->engine.get());
  ClusterResult cluster = run_cluster(engines, *router, requests);
  double hit_tokens = 0, query_tokens = 0;
  for (const EngineResult& replica : cluster.replicas) {
    RunOutput::Replica r;
    r.summary = summarize_run(replica.requests, cluster.duration_s, c.slo);
    r.requests = static_cast<std::int64_t>(replica.requests.size());
    std::tie(r.mean_kv_used, r.prefix_hit_rate) = kv_use_and_prefix_hits(replica.steps);
    if (!replica.steps.empty()) {
      hit_tokens += static_cast<double>(replica.steps.back().kv.prefix_hit_tokens);
      query_tokens += static_cast<double>(replica.steps.back().kv.prefix_query_tokens);
    }
    out.replicas.push_back(r);
  }
  out.engine = merged_result(cluster);
  for (const RouteRecord& route : cluster.routes)
    slots.emplace_back(route.replica, route.id_in_replica);
  out.prefix_hit_rate = query_tokens > 0 ? hit_tokens / query_tokens : 0.0;
}

}  // namespace

// Every replica's stack. Each holds its own KV pool: their sum is checked against the machine
// first, and running out of memory while building them names [cluster] replicas and the pool.
std::vector<std::unique_ptr<ReplicaStack>> make_replicas(
    const ExperimentConfig& c, const PluginRegistry& registry, const ServedModel& served,
    const std::optional<CostModel>& cost_model, std::int64_t slots, const SequenceRules& rules,
    EngineLogitLog* log) {
  const ModelConfig& m = served.config;
  const double pool_bytes = 2.0 * static_cast<double>(slots) *
                            static_cast<double>(m.num_hidden_layers) *
                            static_cast<double>(m.num_key_value_heads * m.head_dim) *
                            static_cast<double>(dtype_size(c.kv_dtype));
  const std::string what = fmt::format(
      "{} replica{} ([cluster] replicas), each with its own KV pool of {} slots ({:.2f} GiB) and "
      "backend",
      c.replicas, c.replicas > 1 ? "s" : "", slots, pool_bytes / (1 << 30));
  if (c.backend != "simulated" && c.replicas > 1)
    check_allocation(static_cast<std::uint64_t>(pool_bytes * static_cast<double>(c.replicas)),
                     what);
  std::vector<std::unique_ptr<ReplicaStack>> stacks;
  try {
    for (std::int64_t r = 0; r < c.replicas; ++r)
      stacks.push_back(make_replica(c, registry, served, cost_model, slots, rules, log,
                                    static_cast<std::size_t>(r)));
  } catch (const std::bad_alloc&) {
    throw Error(
        fmt::format("out of memory building replica {} of {}: lower cluster.replicas or "
                    "kv_cache.slots",
                    stacks.size() + 1, what));
  }
  return stacks;
}

// make_requests, with running out of memory reported as the workload's: which input, how big.
RealWorkload make_requests_or_say_why(const ExperimentConfig& c, const ModelConfig& model,
                                      bool check, std::unique_ptr<Tokenizer>& tokenizer) {
  try {
    return make_requests(c, model, check, tokenizer);
  } catch (const std::bad_alloc&) {
    const std::string file = !c.trace.empty() ? c.trace : c.azure_trace;
    std::error_code ec;
    throw Error(
        file.empty()
            ? fmt::format("out of memory making the workload: workload.requests {} (prompts of "
                          "up to {} tokens); lower them",
                          c.workload.requests, c.workload.prompt_tokens.max)
            : fmt::format("out of memory reading the trace {} ({:.1f} MiB): replay a part of it "
                          "(workload.requests, or the Azure trace's duration_s)",
                          file,
                          static_cast<double>(std::filesystem::file_size(file, ec)) / (1 << 20)));
  }
}

RunOutput run_experiment(const ExperimentConfig& c, bool check,
                         std::vector<std::string>* mismatches) {
  const auto wall_start = std::chrono::steady_clock::now();
  if (c.threads > 0) cpu::set_num_threads(static_cast<int>(c.threads));
  auto search = PluginRegistry::default_search_path();
  search.insert(search.end(), c.plugin_paths.begin(), c.plugin_paths.end());
  const PluginRegistry registry(search);
  const bool simulated = c.backend == "simulated";
  const bool plugin_backend = c.backend != "cpu" && !simulated;             // e.g. cuda
  if (plugin_backend) (void)registry.find(PluginKind::backend, c.backend);  // unknown: say so now
  check_backend_rules(c, check);

  ServedModel served = load_served_model(c, registry, simulated);
  const ModelConfig& model = served.config;
  std::optional<CostModel> cost_model = run_cost_model(c, model);
  const std::int64_t slots = pool_slots(c, model, simulated, cost_model);
  // Context, EOS and window from one place: the backend, the engine's KV release and the
  // reference check all use these, so `check` compares one model.
  const SequenceRules rules = sequence_rules(model, *served.attention);
  // kvlab check --tolerance measures the engine's logits against the reference's.
  std::optional<EngineLogitLog> log;
  if (check && c.check_tolerance > 0) log.emplace(model.vocab_size, kComparedLogitBytes);
  std::vector<std::unique_ptr<ReplicaStack>> stacks =
      make_replicas(c, registry, served, cost_model, slots, rules, log ? &*log : nullptr);
  std::unique_ptr<Tokenizer> tokenizer;  // a prompt set's, to decode the answers
  const RealWorkload workload = make_requests_or_say_why(c, model, check, tokenizer);
  const std::vector<WorkloadRequest>& requests = workload.requests;

  RunOutput out;
  out.model_name = model.name;
  out.kv_slots = slots;
  out.workload_description = workload.description;
  out.weights_description = stacks.front()->weights_description;
  out.prompt_texts = workload.prompt_texts;
  const auto engine_start = std::chrono::steady_clock::now();
  EngineSlots served_by;  // request i: (replica, id in its engine)
  if (c.replicas == 1) {
    out.engine = stacks.front()->engine->run(requests);
    for (std::size_t i = 0; i < requests.size(); ++i)
      served_by.emplace_back(0, static_cast<RequestId>(i));
  } else {
    run_replicas(c, registry, stacks, requests, out, served_by);
  }
  out.engine_wall_s = seconds_since(engine_start);
  out.summary = summarize_run(out.engine.requests, out.engine.duration_s, c.slo);
  for (const auto& r : requests) out.prompts.push_back(r.prompt);
  for (std::size_t i = 0; tokenizer && i < out.engine.tokens.size(); ++i) {
    std::span<const std::int32_t> answer = out.engine.tokens[i];
    if (out.engine.requests[i].finish_reason == "eos") answer = answer.first(answer.size() - 1);
    out.answer_texts.push_back(tokenizer->decode(answer));  // without the stop token
  }
  for (const auto& stack : stacks) {
    out.forward_wall_s += stack->backend->seconds();
    out.forwards += stack->backend->forwards();
    out.forwards_with_chosen_tokens += stack->backend->forwards_with_chosen_tokens();
    const BackendCounters counters = stack->backend->counters();
    out.graph_replays += counters.graph_replays;
    out.graph_captures += counters.graph_captures;
  }
  const double cluster_hit_rate = out.prefix_hit_rate;
  summarize_memory_and_predictions(out, cost_model && c.clock == "measured");
  if (c.replicas > 1) out.prefix_hit_rate = cluster_hit_rate;  // every replica's, not the last
  if (check)
    check_against_reference(served, rules.window, requests, c.check_tolerance,
                            log ? &*log : nullptr, served_by, out, *mismatches);
  out.wall_s = seconds_since(wall_start);
  return out;
}

namespace {

std::string csv_number(const std::optional<double>& v) {
  return v ? fmt::format("{:.6f}", *v) : std::string();
}

void write_requests_csv(std::ostream& f, const RunOutput& out) {
  f << "id,priority,arrival_s,first_scheduled_s,first_token_s,finish_s,prompt_tokens,output_"
       "tokens,";
  for (const RequestMetric& m : request_metrics()) f << m.name << ",";  // the registry's
  f << "preemptions,recomputed_tokens,swapped_bytes,rejected,reject_reason,token_times_s\n";
  for (const auto& r : out.engine.requests) {
    std::string token_times;  // every output token's time, space-separated
    for (double t : r.token_times_s)
      token_times += fmt::format("{}{:.6f}", token_times.empty() ? "" : " ", t);
    f << fmt::format(
        "{},{},{:.6f},{},{},{},{},{},", r.id, r.priority, r.arrival_s,
        csv_number(r.first_scheduled_s),
        csv_number(r.token_times_s.empty() ? std::nullopt
                                           : std::optional<double>(r.token_times_s.front())),
        csv_number(r.finish_s), r.prompt_tokens, r.output_tokens());
    for (const RequestMetric& m : request_metrics()) f << csv_number(m.extract(r)) << ",";
    f << fmt::format("{},{},{},{},\"{}\",{}\n", r.preemptions, r.recomputed_tokens, r.swapped_bytes,
                     r.rejected ? 1 : 0, r.reject_reason, token_times);
  }
}

// Measured times only where they are the clock's (measured, wall): virtual runs stay
// byte-identical and carry no columns of zeros.
void write_steps_csv(std::ostream& f, const RunOutput& out, bool measured) {
  const bool cluster = !out.replicas.empty();  // each step is one replica's
  f << (cluster ? "replica," : "") << "step,start_s,duration_s,"
    << (measured ? "measured_forward_s,measured_step_s," : "")
    << "predicted_s,batch,prefill_tokens,decode_tokens,preempted,waiting,running,padding,"
       "padding_slots,swap_bytes,kv_capacity,kv_used,kv_reserved_unused,kv_last_block_slack,"
       "kv_free,kv_unusable_free,kv_blocking_unusable_free,kv_cached_free,prefix_hit_tokens,"
       "prefix_query_tokens\n";
  for (const auto& s : out.engine.steps) {
    if (cluster) f << s.replica << ",";
    f << fmt::format("{},{:.6f},{:.6f},", s.step, s.start_s, s.duration_s);
    if (measured) f << fmt::format("{:.6f},{:.6f},", s.measured_forward_s, s.measured_step_s);
    f << fmt::format("{:.6f},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                     s.predicted_s, s.batch, s.prefill_tokens, s.decode_tokens, s.preempted,
                     s.waiting, s.running, s.padding, s.padding_slots, s.swap_bytes, s.kv.capacity,
                     s.kv.used, s.kv.reserved_unused, s.kv.last_block_slack, s.kv.free,
                     s.kv.unusable_free, s.blocking_unusable_free, s.kv.cached_free,
                     s.kv.prefix_hit_tokens, s.kv.prefix_query_tokens);
  }
}

// A prompt set's run: each request's question and the model's answer, as text.
void write_outputs_jsonl(std::ostream& f, const RunOutput& out) {
  for (std::size_t i = 0; i < out.answer_texts.size(); ++i) {
    const auto& r = out.engine.requests[i];
    f << nlohmann::json{{"id", r.id},
                        {"finish_reason", r.rejected ? "rejected" : r.finish_reason},
                        {"output_tokens", out.engine.tokens[i].size()},
                        {"prompt", out.prompt_texts[i]},
                        {"answer", out.answer_texts[i]}}
             // An answer cut at max_tokens may end inside a UTF-8 character: shown as U+FFFD.
             .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
      << "\n";
  }
}

// Each request that asked for log-probabilities (workload.logprobs): its generated tokens, each
// one's log-probability, and the k most likely tokens at each position as [token, logprob].
void write_logprobs_jsonl(std::ostream& f, const RunOutput& out) {
  const auto& all = out.engine.logprobs;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].empty()) continue;
    nlohmann::json token_logprobs = nlohmann::json::array(), top = nlohmann::json::array();
    for (const GeneratedLogprobs& token : all[i]) {
      token_logprobs.push_back(token.logprob);
      auto& alternatives = top.emplace_back(nlohmann::json::array());
      for (const TokenLogprob& t : token.top) alternatives.push_back({t.token, t.logprob});
    }
    f << nlohmann::json{{"id", out.engine.requests[i].id},
                        {"tokens", out.engine.tokens[i]},
                        {"token_logprobs", std::move(token_logprobs)},
                        {"top_logprobs", std::move(top)}}
      << "\n";
  }
}

// The run's description (what ran, with what), then every metric of the registry
// (kvlab/experiment/metric_registry.hpp) that it reports.
nlohmann::json summary_json(const ExperimentConfig& c, const RunOutput& out) {
  nlohmann::json j = {{"name", c.name},           {"label", c.label},
                      {"model", out.model_name},  {"allocator", c.allocator},
                      {"attention", c.attention}, {"scheduler", c.scheduler},
                      {"seed", c.seed},           {"backend", c.backend},
                      {"profile", c.profile},     {"tensor_parallel", c.tensor_parallel},
                      {"clock", c.clock}};
  for (const RunMetric& m : run_metrics())
    if (m.in_summary_json)
      if (nlohmann::json value = m.extract(c, out); !value.is_null()) j[m.name] = std::move(value);
  if (!out.workload_description.empty()) j["workload"] = out.workload_description;
  if (!out.weights_description.empty()) j["weights"] = out.weights_description;
  j["kv_dtype"] = dtype_short_name(c.kv_dtype);
  if (!out.replicas.empty()) {  // a cluster: the router and every replica's own figures
    j["router"] = c.router;
    for (const RunOutput::Replica& r : out.replicas)
      j["replicas"].push_back({{"requests", r.requests},
                               {"finished", r.summary.finished},
                               {"rejected", r.summary.rejected},
                               {"output_tokens_per_s", r.summary.output_tokens_per_s},
                               {"ttft_s", latency_json(r.summary.ttft_s)},
                               {"tpot_s", latency_json(r.summary.tpot_s)},
                               {"mean_kv_used_fraction", r.mean_kv_used},
                               {"prefix_hit_rate", r.prefix_hit_rate}});
  }
  return j;
}

}  // namespace

void write_run_outputs(const std::filesystem::path& directory, const ExperimentConfig& c,
                       const RunOutput& out) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw WriteError(
        fmt::format("cannot create output folder {}: {}", directory.string(), ec.message()));
  // Each file is made in memory and written at once: write_file checks every byte reached it.
  auto write = [&](const char* name, const auto& fill) {
    std::ostringstream text;
    fill(text);
    write_file(directory / name, text.str());
  };
  write("requests.csv", [&](std::ostream& f) { write_requests_csv(f, out); });
  write("steps.csv", [&](std::ostream& f) {
    write_steps_csv(f, out, c.clock == "measured" || c.clock == "wall");
  });
  write("events.jsonl", [&](std::ostream& f) {
    for (const auto& event : out.engine.events) f << event_json(event) << "\n";
  });
  write("summary.json", [&](std::ostream& f) { f << summary_json(c, out).dump(2) << "\n"; });
  if (!out.answer_texts.empty())
    write("outputs.jsonl", [&](std::ostream& f) { write_outputs_jsonl(f, out); });
  if (c.workload.logprobs >= 0)
    write("logprobs.jsonl", [&](std::ostream& f) { write_logprobs_jsonl(f, out); });
}

}  // namespace kvlab
