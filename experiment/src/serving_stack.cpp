// Stage 2: the serving stack of a run: the served model (checkpoint converted for the
// attention variant), the cost model, the KV pool's size, and each replica's pool, allocator,
// scheduler, backend and engine.
#include <fmt/format.h>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/weight_choices.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/scheduler.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "run_memo.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

EngineOptions engine_options(const ExperimentConfig& c, const SequenceRules& rules,
                             const std::optional<CostModel>& cost_model, KvPool& pool) {
  EngineOptions options;
  options.clock = c.clock;
  if (cost_model) options.cost_model = &*cost_model;
  options.rules = rules;
  options.pool = &pool;
  options.swap_slots = c.swap_slots;
  options.kv_tiers = c.has_kv_tiers();
  options.speculation = c.speculation;
  options.frame_budget = c.frame_budget;
  return options;
}

// `scheduler plugin "fcfs" (/path/kvlab_plugin_fcfs.so)`: how engine errors name a plugin.
std::string plugin_label(const PluginRegistry& registry, PluginKind kind, const std::string& name) {
  return fmt::format("{} plugin \"{}\" ({})", plugin_kind_name(kind), name,
                     registry.find(kind, name).file.string());
}

std::int64_t gib_bytes(double gib) {
  return static_cast<std::int64_t>(gib * (1 << 30));
}

// The draft's weights: draft_model's checkpoint, or the target's first draft_layers layers (the
// target's final norm and LM head after them: an early exit).
ModelWeightsView draft_weights_view(const ServedModel& served, const ModelWeightsView& target) {
  if (served.draft_weights) return cpu::weights_view(*served.draft_weights, served.draft_source);
  ModelWeightsView draft = target;
  draft.config = served.draft_config;
  draft.layers.resize(static_cast<std::size_t>(served.draft_config.num_hidden_layers));
  return draft;
}

// The replica's proposer plugin and, for one that runs the draft on the cpu (a draft proposer on
// the cpu backend), the draft's backend over a pool of its own with the target pool's slots.
void add_proposer(const ExperimentConfig& c, const PluginRegistry& registry,
                  const ServedModel& served, const ReplicaSizing& sizing, ReplicaStack& r,
                  PluginContext context, EngineOptions& options) {
  const ModelConfig& draft = served.draft_config;
  if (draft.num_hidden_layers > 0 && served.weights) {
    r.draft_pool = std::make_unique<KvPool>(
        KvPoolShape{draft.num_hidden_layers, draft.cache_kv_heads(), draft.cache_head_dim(),
                    sizing.slots, DType::dtype_f32, false},
        KvStorage::none);
    const ModelWeightsView weights =
        draft_weights_view(served, cpu::weights_view(*served.weights, served.source.string()));
    PluginContext draft_context;
    draft_context.model = &draft;
    draft_context.max_seq_len = draft.max_position_embeddings;
    draft_context.pool = r.draft_pool.get();
    draft_context.weights = &weights;
    r.draft_backend =
        registry.create<PluginKind::backend>(c.backend, backend_params(c), draft_context);
    context.model = &draft;
    context.pool = r.draft_pool.get();
    context.draft = r.draft_backend.get();
  }
  r.proposer =
      registry.create<PluginKind::proposer>(c.speculation.proposer, proposer_params(c), context);
  options.proposer = r.proposer.get();
  options.names.proposer = plugin_label(registry, PluginKind::proposer, c.speculation.proposer);
  if (sizing.draft_cost_model) options.draft_cost_model = &*sizing.draft_cost_model;
}

std::unique_ptr<ReplicaStack> make_replica(const ExperimentConfig& c,
                                           const PluginRegistry& registry,
                                           const ServedModel& served, const ReplicaSizing& sizing,
                                           const SequenceRules& rules, EngineLogitLog* log,
                                           std::size_t replica) {
  const ModelConfig& model = served.config;
  const std::optional<CostModel>& cost_model = sizing.cost_model;
  // KV groups: a slot holds one group's layers, as many slots as hold the same bytes.
  const KvLayerGroups groups = kv_layer_groups(model, c.kv_groups);
  const std::int64_t slots = groups.slots_for_bytes_of(sizing.slots, model.num_hidden_layers);
  auto r = std::make_unique<ReplicaStack>();
  // Bookkeeping only: the backend brings where K/V live (cpu: this pool's host storage; cuda:
  // its device pool, attached). The simulated device's dtype (the profile's) sizes swaps.
  const bool simulated = c.backend_kind == BackendKind::simulated;
  r->pool = std::make_unique<KvPool>(
      KvPoolShape{groups.group_layers, model.cache_kv_heads(), model.cache_head_dim(), slots,
                  simulated ? cost_model->profile().kv_dtype : c.kv_dtype, c.kv_hadamard,
                  c.kivi_residual, simulated ? std::nullopt : c.kv_value_dtype},
      KvStorage::none);
  PluginContext context;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  context.pool = r->pool.get();
  if (c.has_kv_tiers()) {
    r->tier_policy =
        registry.create<PluginKind::tier_policy>(c.tier_policy, c.tier_policy_params, context);
    r->tiers = {gib_bytes(c.host_tier_gib), gib_bytes(c.disk_tier_gib),
                c.disk_tier_directory.c_str(), r->tier_policy.get()};
    context.tiers = &r->tiers;
  }
  r->allocator =
      registry.create<PluginKind::kv_allocator>(c.allocator, c.allocator_params, context);
  if (!groups.uniform()) r->grouped = std::make_unique<GroupedKvAllocator>(*r->allocator, groups);
  r->scheduler = registry.create<PluginKind::scheduler>(c.scheduler, c.scheduler_params, context);
  std::optional<ModelWeightsView> weights;  // the simulated backend reads none
  if (served.weights) weights = cpu::weights_view(*served.weights, served.source.string());
  context.weights = weights ? &*weights : nullptr;
  context.window = rules.window.value_or(0);
  r->plugin_backend = registry.create<PluginKind::backend>(c.backend, backend_params(c), context);
  r->backend = std::make_unique<TimedBackend>(*r->plugin_backend);
  EngineOptions options = engine_options(c, rules, cost_model, *r->pool);
  options.names = {plugin_label(registry, PluginKind::scheduler, c.scheduler),
                   plugin_label(registry, PluginKind::kv_allocator, c.allocator),
                   plugin_label(registry, PluginKind::backend, c.backend)};
  if (!c.kv_policy.empty()) {  // one a replica: it keeps its sequences' state
    r->kv_policy = registry.create<PluginKind::kv_policy>(c.kv_policy, c.kv_policy_params, context);
    options.kv_policy = r->kv_policy.get();
    options.names.kv_policy = plugin_label(registry, PluginKind::kv_policy, c.kv_policy);
  }
  if (c.speculation.enabled()) add_proposer(c, registry, served, sizing, *r, context, options);
  if (log != nullptr)
    options.observers.on_logits = [log, replica](RequestId id, std::span<const float> row) {
      log->record(replica, id, row);
    };
  r->options = options;
  r->engine = std::make_unique<Engine>(*r->backend, r->kv(), *r->scheduler, options);
  return r;
}

}  // namespace

std::vector<std::filesystem::path> plugin_search_path(const ExperimentConfig& c) {
  auto search = PluginRegistry::default_search_path();
  search.insert(search.end(), c.plugin_paths.begin(), c.plugin_paths.end());
  return search;
}

ParamMap proposer_params(const ExperimentConfig& c) {
  const SpeculationOptions& spec = c.speculation;
  if (spec.proposer == "prompt_lookup")
    return {{"min_ngram", spec.lookup.min_ngram}, {"max_ngram", spec.lookup.max_ngram}};
  if (spec.proposer == "simulated")
    return {{"acceptance_rate", spec.acceptance_rate},
            {"accept_trace", spec.accept_trace},
            {"seed", static_cast<std::int64_t>(spec.seed)}};
  return c.proposer_params;
}

ParamMap backend_params(const ExperimentConfig& c) {
  ParamMap params = c.backend_params;
  if (c.backend_kind == BackendKind::cpu) {
    params["weights"] = std::string(cpu::weight_choice_name(c.cpu_weights));
    params["activations"] = std::string(cpu::activation_format_name(c.cpu_activations));
  }
  return params;
}

// [speculation]'s draft: draft_model's config (and checkpoint, beside the target's), or the
// target's config cut to its first draft_layers layers.
void load_draft(const ExperimentConfig& c, ServedModel& served) {
  if (!c.speculation.enabled()) return;
  if (c.draft_layers > 0) {
    served.draft_config = served.config;
    served.draft_config.num_hidden_layers = c.draft_layers;
    served.draft_config.name =
        fmt::format("{} (first {} layers)", served.config.name, c.draft_layers);
    return;
  }
  if (c.draft_model.empty()) return;
  const ModelSource source = resolve_model(c.draft_model);
  served.draft_config = source.config;
  if (!served.weights) return;  // the simulated backend prices the draft's steps only
  served.draft_weights = load_checkpoint(source, c.weights_seed).weights;
  served.draft_source = source.directory;
  served.draft_config = served.draft_weights->config;
}

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
  refuse_kv_regrouping_of_latent(served.config, c.attention, kv_heads);
  if (checkpoint.weights) {
    served.weights = cpu::convert_kv_heads(*checkpoint.weights, kv_heads);
    served.weights_key = fmt::format("{}, {} K/V heads", checkpoint.key, kv_heads);
    served.config = served.weights->config;
  } else {
    served.config.num_key_value_heads = kv_heads;
  }
  load_draft(c, served);
  return served;
}

void refuse_kv_regrouping_of_latent(const ModelConfig& model, const std::string& attention,
                                    std::int64_t kv_heads) {
  if (model.is_mla() && kv_heads != model.num_key_value_heads)
    throw Error(fmt::format(
        "attention \"{}\" would give {} {} K/V heads, but it caches one latent a token a layer "
        "(latent attention): there are no K/V heads to group",
        attention, model.name, kv_heads));
}

// The cost model that prices the run's steps: the profile's device; a run whose pool has its own
// KV dtype (the cpu backend's kv_cache.dtype, the cuda backend's fp8 or int8) is priced with it.
std::optional<CostModel> run_cost_model(const ExperimentConfig& c, const ModelConfig& model,
                                        std::int64_t tensor_parallel) {
  if (c.profile.empty()) return std::nullopt;
  HardwareProfile profile = load_hardware_profile(c.profile, c.hardware_changes);
  if (c.backend_kind == BackendKind::cpu || c.kv_dtype != DType::dtype_f32)
    profile.kv_dtype = c.kv_dtype;
  return CostModel(model, profile, tensor_parallel, c.context_parallel);
}

namespace {

// A KIVI pool's fp16 residual, in the pool's bytes per slot: each request the scheduler may run
// at once (scheduler.params.max_batch) holds up to kivi_most_open_groups x 32 tokens of K and V
// in fp16 beside the pool's slots, reserved out of its budget as a server that preallocates
// per-request buffers for its batch cap must (the allocator plugins know nothing of it).
struct KiviResidualCharge {
  std::int64_t requests = 0;
  double bytes = 0;  // for all of them
};

KiviResidualCharge kivi_residual_charge(const ExperimentConfig& c, DType dtype,
                                        std::int64_t head_dim, double bytes_per_slot) {
  if (!dtype_is_kivi(dtype)) return {};
  const auto max_batch = c.scheduler_params.find("max_batch");
  const std::int64_t* given = max_batch == c.scheduler_params.end()
                                  ? nullptr
                                  : std::get_if<std::int64_t>(&max_batch->second);
  const std::int64_t requests = given != nullptr ? *given : ContinuousPolicy{}.max_batch;
  const double fp16_per_slot = bytes_per_slot *
                               static_cast<double>(dtype_row_bytes(DType::dtype_f16, head_dim)) /
                               static_cast<double>(dtype_row_bytes(dtype, head_dim));
  return {requests,
          static_cast<double>(requests * kivi_most_open_groups(c.kivi_residual) * kKiviGroup) *
              fp16_per_slot};
}

std::string kivi_residual_refusal(const ExperimentConfig& c, const KiviResidualCharge& charge,
                                  std::string_view budget) {
  return fmt::format(
      "{} does not hold KIVI's fp16 residual: {} tokens of K and V for each of {} requests "
      "(scheduler.params.max_batch) take {:.1f} MiB beside the pool's slots: lower max_batch "
      "or kv_cache.residual_length ({})",
      budget, kivi_most_open_groups(c.kivi_residual) * kKiviGroup, charge.requests,
      charge.bytes / (1024.0 * 1024.0), c.kivi_residual);
}

}  // namespace

// The pool's capacity in tokens: [kv_cache] slots, a byte budget (whole blocks of 64; simulated
// KV in the profile's dtype, real KV in kv_cache.dtype), or what the simulated device holds next to
// the weights; a KIVI pool's fp16 residual charged out of the bytes (kivi_residual_charge).
std::int64_t pool_slots(const ExperimentConfig& c, const ModelConfig& model, bool simulated,
                        const std::optional<CostModel>& cost_model) {
  const DType dtype = simulated ? cost_model->profile().kv_dtype : c.kv_dtype;
  const std::int64_t head_dim = model.cache_head_dim();
  if (c.kv_memory_mib) {
    const double bytes_per_slot =
        simulated ? cost_model->kv_bytes_per_sequence_token_per_gpu()
                  : static_cast<double>(model.num_hidden_layers * model.cache_kv_heads() *
                                        c.kv_head_bytes(head_dim));
    const KiviResidualCharge residual = kivi_residual_charge(c, dtype, head_dim, bytes_per_slot);
    const double budget_bytes = *c.kv_memory_mib * 1024 * 1024 - residual.bytes;
    if (residual.bytes > 0 && budget_bytes < 64 * bytes_per_slot)
      throw Error(kivi_residual_refusal(c, residual,
                                        fmt::format("kv_cache.memory_mib {}", *c.kv_memory_mib)));
    const double budget_slots = budget_bytes / bytes_per_slot;
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
  const double bytes_per_slot = cost_model->kv_bytes_per_sequence_token_per_gpu();
  const KiviResidualCharge residual = kivi_residual_charge(c, dtype, head_dim, bytes_per_slot);
  const double capacity =
      static_cast<double>(cost_model->kv_capacity_tokens()) - residual.bytes / bytes_per_slot;
  if (residual.bytes > 0 && capacity < 256)
    throw Error(kivi_residual_refusal(c, residual,
                                      fmt::format("{}'s KV memory", cost_model->profile().name)));
  const std::int64_t slots = static_cast<std::int64_t>(capacity) / 256 * 256;  // whole blocks
  if (slots < 1)
    throw Error(
        fmt::format("{} does not fit on {}: {:.1f} GiB of weights, {:.1f} GiB usable (memory_gib x "
                    "utilization - activation reserve)",
                    model.name, cost_model->profile().name, cost_model->weight_bytes() / kGiB,
                    cost_model->profile().memory_gib * cost_model->profile().memory_utilization -
                        cost_model->profile().activation_reserve_gib));
  return slots;
}

std::vector<ReplicaSizing> replica_sizings(const ExperimentConfig& c, const ServedModel& served,
                                           bool simulated) {
  const ModelConfig& model = served.config;
  std::vector<ReplicaSizing> sizings;
  const std::int64_t sides =
      c.disaggregated() && c.tensor_parallel_of(0) != c.tensor_parallel_of(c.replicas - 1) ? 2 : 1;
  sizings.reserve(2);  // no reallocation: engines point at the cost models
  for (std::int64_t side = 0; side < sides; ++side) {
    ReplicaSizing& s = sizings.emplace_back();
    const std::int64_t tp = c.tensor_parallel_of(side == 0 ? 0 : c.replicas - 1);
    s.cost_model = run_cost_model(c, model, tp);
    if (served.draft_config.num_hidden_layers > 0)
      s.draft_cost_model = run_cost_model(c, served.draft_config, tp);
    s.slots = pool_slots(c, model, simulated, s.cost_model);
  }
  return sizings;
}

const ReplicaSizing& sizing_of(const ExperimentConfig& c, std::span<const ReplicaSizing> sizings,
                               std::int64_t replica) {
  return sizings.size() > 1 && replica >= c.prefill_replicas ? sizings[1] : sizings[0];
}

// Every replica's stack. Each holds its own KV pool: their sum is checked against the machine
// first, and running out of memory while building them names [cluster] replicas and the pool.
std::vector<std::unique_ptr<ReplicaStack>> make_replicas(
    const ExperimentConfig& c, const PluginRegistry& registry, const ServedModel& served,
    std::span<const ReplicaSizing> sizings, const SequenceRules& rules, EngineLogitLog* log) {
  const ModelConfig& m = served.config;
  const std::int64_t slots = sizings.front().slots;  // the host pools' (one sizing off simulated)
  const double pool_bytes =
      static_cast<double>(slots) * static_cast<double>(m.num_hidden_layers) *
      static_cast<double>(m.cache_kv_heads() * c.kv_head_bytes(m.cache_head_dim()));
  const std::string what = fmt::format(
      "{} replica{} ([cluster] replicas), each with its own KV pool of {} slots ({:.2f} GiB) and "
      "backend",
      c.replicas, c.replicas > 1 ? "s" : "", slots, pool_bytes / (1 << 30));
  // The cpu backend's pools and host tiers are host memory (the others': device memory, or none).
  const double host_tier_bytes =
      c.backend_kind == BackendKind::cpu ? c.host_tier_gib * (1 << 30) : 0;
  if (c.backend_kind == BackendKind::cpu ||
      (c.backend_kind != BackendKind::simulated && c.replicas > 1))
    check_allocation(static_cast<std::uint64_t>((pool_bytes + host_tier_bytes) *
                                                static_cast<double>(c.replicas)),
                     host_tier_bytes > 0 ? what + " and host KV tier ([kv_tiers] host_gib)" : what);
  std::vector<std::unique_ptr<ReplicaStack>> stacks;
  try {
    for (std::int64_t r = 0; r < c.replicas; ++r)
      stacks.push_back(make_replica(c, registry, served, sizing_of(c, sizings, r), rules, log,
                                    static_cast<std::size_t>(r)));
  } catch (const std::bad_alloc&) {
    throw Error(
        fmt::format("out of memory building replica {} of {}: lower cluster.replicas or "
                    "kv_cache.slots",
                    stacks.size() + 1, what));
  }
  return stacks;
}

}  // namespace kvlab
