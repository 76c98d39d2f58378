// kvlab memory: KV-cache bytes per token / request / batch, MHA vs GQA vs MQA, and the largest
// batch that fits next to the weights.
#include <fmt/format.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv/kv_groups.hpp"
#include "kvlab/kv_pool.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab::cli {
namespace {

struct MemoryOptions {
  std::string model;
  std::int64_t seq_len = 0;
  std::int64_t batch = 1;
  std::string dtype;        // default: f16, or the GPU profile's KV dtype
  std::string value_dtype;  // V's, when not --dtype's
  std::string weight_dtype;
  std::optional<std::int64_t> kv_heads;
  std::optional<double> gpu_mem;
  std::string gpu;  // hardware profile: the planner
  std::int64_t prompt_len = 0, output_len = 0, max_seq_len = 0, block_size = 16;
  std::int64_t tp = 1;  // planner: GPUs of --gpu sharing each layer
  std::int64_t cp = 1;  // planner: groups of those sharing each sequence's KV by positions
  std::int64_t kv_residual = kKiviResidualDefault;  // KIVI's fp16 tokens
  bool json = false;
};

// The weights' dtype when only --dtype is given: the same, unless it is a KV-only format
// (then `fallback`).
DType weights_like(DType kv, DType fallback) {
  return dtype_size(kv) > 0 ? kv : fallback;
}

DType parse_dtype(const std::string& name, const char* flag) {
  const auto dtype = dtype_from_short_name(name);
  if (!dtype || !(*dtype == DType::dtype_f32 || *dtype == DType::dtype_f16 ||
                  *dtype == DType::dtype_bf16 || *dtype == DType::dtype_f8_e4m3))
    throw Error(
        fmt::format("{} \"{}\" is not supported: choose f32, f16, bf16 or fp8", flag, name));
  return *dtype;
}

// The attention variants the model's head count allows, as (label, K/V heads): MHA, the
// checkpoint's own GQA, GQA-8, MQA.
std::vector<std::pair<std::string, std::int64_t>> attention_variants(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::int64_t>> variants{{"MHA", c.num_attention_heads}};
  if (c.is_mla()) {  // its own latent, then the plain K/V its heads would cache
    variants.insert(variants.begin(), {"MLA", 0});
    if (c.num_attention_heads % 8 == 0 && c.num_attention_heads > 8)
      variants.emplace_back("GQA-8", 8);
    variants.emplace_back("MQA", 1);
    return variants;
  }
  if (c.num_key_value_heads != c.num_attention_heads && c.num_key_value_heads != 1)
    variants.emplace_back(fmt::format("GQA-{}", c.num_key_value_heads), c.num_key_value_heads);
  if (c.num_key_value_heads != 8 && c.num_attention_heads % 8 == 0 && c.num_attention_heads > 8)
    variants.emplace_back("GQA-8", 8);
  variants.emplace_back("MQA", 1);
  return variants;
}

// A variant's K/V heads for the arithmetic: none (the model's own cache) for a latent row (0).
std::optional<std::int64_t> variant_heads(std::int64_t heads) {
  return heads > 0 ? std::optional(heads) : std::nullopt;
}

// A local:global model's KV groups (kv_cache.groups = "per_kind", kvlab/kv/kv_groups.hpp): what
// a request of `tokens` positions holds per group against one table of every layer, in bytes of
// `layer_token_bytes` per layer and token. Prints nothing for a model of one attention kind;
// returns the grouped bytes per request (0 then).
double print_kv_groups(const ModelConfig& c, std::int64_t tokens, std::int64_t block,
                       double layer_token_bytes) {
  const KvLayerGroups g = kv_layer_groups(c, true);
  if (g.uniform()) return 0;
  const double per_slot = static_cast<double>(g.group_layers) * layer_token_bytes;
  std::map<std::optional<std::int64_t>, std::int64_t> groups_of_kind;
  for (const KvLayerGroup& group : g.groups) ++groups_of_kind[group.window];
  fmt::print("KV groups (kv_cache.groups = \"per_kind\"): {} groups of {} layers{}\n", g.count(),
             g.group_layers,
             g.padding_layers() > 0
                 ? fmt::format(" ({} pool layers of padding)", g.padding_layers())
                 : std::string());
  for (const auto& [window, count] : groups_of_kind) {
    const std::int64_t held = window ? std::min(tokens, *window + block) : tokens;
    fmt::print("  {:<12} {} group{} x {} tokens x {} layers = {}\n",
               window ? fmt::format("window {}", *window) : std::string("global"), count,
               count > 1 ? "s" : "", held, g.group_layers,
               human_bytes(static_cast<double>(count * held) * per_slot));
  }
  const double grouped = static_cast<double>(g.slots_held(tokens, block)) * per_slot;
  const double uniform = static_cast<double>(tokens * c.num_hidden_layers) * layer_token_bytes;
  fmt::print("  per request  {:>12}  against {} in one table: {:.2f}x the requests\n",
             human_bytes(grouped), human_bytes(uniform), uniform / grouped);
  return grouped;
}

// The planner's figures as JSON: one device (one GPU's share under --tp) and every variant.
template <typename PlanFor>
void print_plan_json(const ModelConfig& c, const HardwareProfile& device, const MemoryPlanQuery& q,
                     const MemoryPlan& p,
                     const std::vector<std::pair<std::string, std::int64_t>>& variants,
                     PlanFor&& plan_for) {
  nlohmann::json out = {{"model", c.name},
                        {"gpu", device.name},
                        {"kv_dtype", dtype_short_name(q.kv_dtype)},
                        {"weight_dtype", dtype_short_name(q.weight_dtype)},
                        {"usable_bytes", p.usable_bytes},
                        {"weight_bytes", p.weight_bytes},
                        {"reserve_bytes", p.reserve_bytes},
                        {"kv_budget_bytes", p.kv_budget_bytes},
                        {"kv_heads", p.kv_heads},
                        {"tensor_parallel", p.tensor_parallel},
                        {"context_parallel", p.context_parallel},
                        {"kv_heads_per_gpu", p.kv_heads_per_gpu},
                        {"kv_bytes_per_token", p.kv_bytes_per_token},
                        {"kv_capacity_tokens", p.kv_capacity_tokens},
                        {"static_tokens_per_request", p.static_tokens_per_request},
                        {"paged_tokens_per_request", p.paged_tokens_per_request},
                        {"kv_residual_bytes_per_request", p.kv_residual_bytes_per_request},
                        {"max_static_requests", p.max_static_requests},
                        {"max_paged_requests", p.max_paged_requests}};
  for (const auto& [name, heads] : variants) {
    const MemoryPlan v = plan_for(heads);
    out["variants"].push_back({{"variant", name},
                               {"kv_heads", heads},
                               {"kv_bytes_per_token", v.kv_bytes_per_token},
                               {"kv_capacity_tokens", v.kv_capacity_tokens},
                               {"max_static_requests", v.max_static_requests},
                               {"max_paged_requests", v.max_paged_requests}});
  }
  fmt::print("{}\n", out.dump(2));
}

// The planner's device, its memory and the KV budget left beside the weights.
void print_plan_budget(const ModelConfig& c, const HardwareProfile& device,
                       const MemoryPlanQuery& q, const MemoryPlan& p) {
  const bool sharded = p.tensor_parallel > 1;
  const std::int64_t gpus = p.tensor_parallel * p.context_parallel;
  fmt::print("{} on {}{} ({}): {} weights, {} KV\n", c.name,
             gpus > 1 ? fmt::format("{} x ", gpus) : "", device.name, device.description,
             dtype_short_name(q.weight_dtype), dtype_short_name(q.kv_dtype));
  if (sharded)
    fmt::print("  tensor parallel over {} GPUs: every figure below is one GPU's\n",
               p.tensor_parallel);
  if (p.context_parallel > 1)
    fmt::print(
        "  context parallel over {} groups ({} GPUs): each GPU holds 1/{} of every request's KV, "
        "so the tokens below are the {} groups' together\n",
        p.context_parallel, p.tensor_parallel * p.context_parallel, p.context_parallel,
        p.context_parallel);
  fmt::print("  usable      {:>12}  = {} GiB x utilization {}\n", human_bytes(p.usable_bytes),
             device.memory_gib, device.memory_utilization);
  fmt::print(
      "  weights     {:>12}  = {:.2f}B parameters{} x {} B\n", human_bytes(p.weight_bytes),
      p.weight_bytes / static_cast<double>(dtype_size(q.weight_dtype)) / 1e9,
      sharded ? fmt::format(" (of {:.2f}B)", static_cast<double>(c.parameter_count()) / 1e9) : "",
      dtype_size(q.weight_dtype));
  fmt::print("  reserve     {:>12}  (activations, workspace)\n", human_bytes(p.reserve_bytes));
  fmt::print(
      "  KV budget   {:>12}  = {} tokens of {} ({} KV heads{}){}\n", human_bytes(p.kv_budget_bytes),
      p.kv_capacity_tokens, human_bytes(static_cast<double>(p.kv_bytes_per_token)), p.kv_heads,
      sharded ? fmt::format(", {} on each GPU", p.kv_heads_per_gpu) : "",
      p.context_parallel > 1 ? fmt::format(" x {} groups, each token on one", p.context_parallel)
                             : "");
  if (p.kv_capacity_tokens == 0)
    fmt::print(
        "  the weights and the reserve alone exceed the usable memory: shard the model "
        "(tensor parallel) or use a larger device or a smaller weight dtype\n");
}

// Static vs paged on one device, for each attention variant the model's heads allow.
void run_plan(const MemoryOptions& o, const ModelConfig& c) {
  if (!o.value_dtype.empty())
    throw Error(
        "--value-dtype is the KV arithmetic's (--seq-len); the planner (--gpu) takes one KV dtype "
        "(--dtype)");
  const HardwareProfile device = load_hardware_profile(o.gpu);
  MemoryPlanQuery q;
  q.prompt_tokens = o.prompt_len;
  q.output_tokens = o.output_len;
  q.max_seq_len = o.max_seq_len;
  q.block_size = o.block_size;
  q.kv_dtype = o.dtype.empty() ? device.kv_dtype : kv_pool_dtype(o.dtype, "--dtype");
  q.weight_dtype = !o.weight_dtype.empty() ? parse_dtype(o.weight_dtype, "--weight-dtype")
                   : o.dtype.empty()       ? device.compute_dtype
                                           : weights_like(q.kv_dtype, device.compute_dtype);
  q.kv_heads = o.kv_heads;
  q.tensor_parallel = o.tp;
  q.context_parallel = o.cp;
  q.kivi_residual = o.kv_residual;
  const MemoryPlan p = plan_memory(c, device, q);
  const auto variants = attention_variants(c);
  auto plan_for = [&](std::int64_t heads) {
    MemoryPlanQuery v = q;
    v.kv_heads = variant_heads(heads);
    return plan_memory(c, device, v);
  };
  if (o.json) {
    print_plan_json(c, device, q, p, variants, plan_for);
    return;
  }
  print_plan_budget(c, device, q, p);
  fmt::print("static: every request reserves {} tokens (max_seq_len)         -> {} concurrent\n",
             p.static_tokens_per_request, p.max_static_requests);
  fmt::print("paged:  every request holds {} tokens ({} + {}, blocks of {}) -> {} concurrent{}\n",
             p.paged_tokens_per_request, q.prompt_tokens, q.output_tokens, q.block_size,
             p.max_paged_requests,
             p.max_static_requests > 0
                 ? fmt::format(" ({:.1f}x)", static_cast<double>(p.max_paged_requests) /
                                                 static_cast<double>(p.max_static_requests))
                 : std::string());
  if (p.kv_residual_bytes_per_request > 0)
    fmt::print("        and {} of KIVI's fp16 residual each (its newest {} to {} tokens)\n",
               human_bytes(static_cast<double>(p.kv_residual_bytes_per_request)), q.kivi_residual,
               q.kivi_residual + kKiviGroup - 1);
  const double layer_token_bytes =
      static_cast<double>(p.kv_bytes_per_token) / static_cast<double>(c.num_hidden_layers);
  if (const double grouped =
          print_kv_groups(c, q.prompt_tokens + q.output_tokens, q.block_size, layer_token_bytes);
      grouped > 0 && p.context_parallel == 1)
    fmt::print("paged, KV groups: {} concurrent\n",
               static_cast<std::int64_t>(p.kv_budget_bytes / grouped));
  fmt::print("\n{:<8} {:>8} {:>12} {:>12} {:>8} {:>8}\n", "variant", "kv_heads", "per token",
             "KV tokens", "static", "paged");
  for (const auto& [name, heads] : variants) {
    const MemoryPlan v = plan_for(heads);
    fmt::print("{:<8} {:>8} {:>12} {:>12} {:>8} {:>8}\n", name,
               heads > 0 ? fmt::format("{}", heads) : "latent",
               human_bytes(static_cast<double>(v.kv_bytes_per_token)), v.kv_capacity_tokens,
               v.max_static_requests, v.max_paged_requests);
  }
}

// The query for another attention variant's K/V heads (nullopt: the model's own).
KvMemoryQuery with_kv_heads(KvMemoryQuery query, std::optional<std::int64_t> heads) {
  query.kv_heads = heads;
  return query;
}

// The KV arithmetic as JSON: the query's figures and every attention variant's.
void print_kv_json(const MemoryOptions& o, const ModelConfig& c, const KvMemoryQuery& query,
                   const KvMemoryReport& r,
                   const std::vector<std::pair<std::string, std::int64_t>>& variants,
                   const KvMemoryReport& mha) {
  nlohmann::json out = {
      {"model", c.name},
      {"seq_len", o.seq_len},
      {"batch", o.batch},
      {"kv_dtype", dtype_short_name(query.kv_dtype)},
      {"kv_value_dtype", dtype_short_name(query.kv_value_dtype.value_or(query.kv_dtype))},
      {"kivi_residual", query.kivi_residual},
      {"kv_heads", r.kv_heads},
      {"bytes_per_token", r.bytes_per_token},
      {"bytes_per_request", r.bytes_per_request},
      {"residual_bytes_per_request", r.residual_bytes_per_request},
      {"bytes_total", r.bytes_total},
      {"weight_bytes", r.weight_bytes}};
  if (r.max_batch) out["max_batch"] = *r.max_batch;
  for (const auto& [name, heads] : variants) {
    const auto v = kv_memory(c, with_kv_heads(query, variant_heads(heads)));
    nlohmann::json row = {{"variant", name},
                          {"kv_heads", heads},
                          {"bytes_per_request", v.bytes_per_request},
                          {"ratio_to_mha", static_cast<double>(v.bytes_per_token) /
                                               static_cast<double>(mha.bytes_per_token)}};
    if (v.max_batch) row["max_batch"] = *v.max_batch;
    out["variants"].push_back(row);
  }
  fmt::print("{}\n", out.dump(2));
}

// The model's line and a token's KV bytes, with the formula: K and V of its heads, or MLA's
// latent and RoPE key.
void print_model_and_token_bytes(const ModelConfig& c, const KvMemoryQuery& query,
                                 const KvMemoryReport& r) {
  // Bytes per value: the element's, or a quantized head row's over head_dim (scales included).
  auto element_of = [&](DType dtype) {
    return dtype_size(dtype) > 0
               ? fmt::format("{}", dtype_size(dtype))
               : fmt::format("{}/{}", dtype_row_bytes(dtype, c.head_dim), c.head_dim);
  };
  const std::string element = element_of(query.kv_dtype);
  const DType value_dtype = query.kv_value_dtype.value_or(query.kv_dtype);
  fmt::print(
      "model {}: {} layers, {} query heads, {} KV heads, head_dim {}, {:.2f}B parameters{}\n",
      c.name, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
      static_cast<double>(c.parameter_count()) / 1e9,
      c.has_experts()
          ? fmt::format(" ({:.2f}B a token)", static_cast<double>(c.matmul_parameter_count()) / 1e9)
          : std::string());
  if (c.is_mla() && !query.kv_heads) {
    fmt::print("KV cache, {} latent (latent attention):\n", dtype_short_name(query.kv_dtype));
    fmt::print("  per token    {:>12}  = {} layers x ({} kv_lora_rank + {} rope) x {} B = {} B\n",
               human_bytes(static_cast<double>(r.bytes_per_token)), c.num_hidden_layers,
               c.kv_lora_rank, c.qk_rope_head_dim, element, r.bytes_per_token);
  } else {
    const bool split = value_dtype != query.kv_dtype;
    fmt::print("KV cache, {}{} x {} KV heads:\n", dtype_short_name(query.kv_dtype),
               split ? fmt::format(" K, {} V", dtype_short_name(value_dtype)) : std::string(),
               r.kv_heads);
    fmt::print(
        "  per token    {:>12}  = {} x {} layers x {} KV heads x {} head_dim x {} B = {} B\n",
        human_bytes(static_cast<double>(r.bytes_per_token)), split ? "1" : "2", c.num_hidden_layers,
        r.kv_heads, c.is_mla() ? c.v_head_dim : c.head_dim,
        split ? fmt::format("({} + {})", element, element_of(value_dtype)) : element,
        r.bytes_per_token);
  }
}

void run_memory(const MemoryOptions& o) {
  const ModelSource source = resolve_model(o.model);
  const ModelConfig& c = source.config;
  if ((o.tp != 1 || o.cp != 1) && o.gpu.empty())
    throw Error(
        "--tp and --cp shard a model over the GPUs of --gpu: give --gpu (and --prompt-len)");
  if (!o.gpu.empty()) {
    if (o.prompt_len <= 0)
      throw Error("--gpu plans for expected lengths: give --prompt-len (and --output-len)");
    run_plan(o, c);
    return;
  }
  if (o.seq_len <= 0)
    throw Error("give --seq-len (KV arithmetic) or --gpu with --prompt-len (the planner)");
  KvMemoryQuery query;
  query.seq_len = o.seq_len;
  query.batch = o.batch;
  query.kv_dtype = kv_pool_dtype(o.dtype.empty() ? "f16" : o.dtype, "--dtype");
  query.weight_dtype = o.weight_dtype.empty() ? weights_like(query.kv_dtype, DType::dtype_f16)
                                              : parse_dtype(o.weight_dtype, "--weight-dtype");
  query.kv_heads = o.kv_heads;
  query.gpu_memory_gib = o.gpu_mem;
  query.kivi_residual = o.kv_residual;
  if (!o.value_dtype.empty()) query.kv_value_dtype = kv_pool_dtype(o.value_dtype, "--value-dtype");
  const KvMemoryReport r = kv_memory(c, query);

  const auto variants = attention_variants(c);
  const KvMemoryReport mha = kv_memory(c, with_kv_heads(query, c.num_attention_heads));

  if (o.json) {
    print_kv_json(o, c, query, r, variants, mha);
    return;
  }
  print_model_and_token_bytes(c, query, r);
  fmt::print("  per request  {:>12}  ({} tokens, {} B{})\n",
             human_bytes(static_cast<double>(r.bytes_per_request)), o.seq_len, r.bytes_per_request,
             r.residual_bytes_per_request > 0
                 ? fmt::format(", of them {} B for KIVI's fp16 residual: its newest {} to {} "
                               "tokens, in groups of {}",
                               r.residual_bytes_per_request, query.kivi_residual,
                               query.kivi_residual + kKiviGroup - 1, kKiviGroup)
                 : std::string());
  fmt::print("  total        {:>12}  (batch {}, {} B)\n",
             human_bytes(static_cast<double>(r.bytes_total)), o.batch, r.bytes_total);
  fmt::print("weights        {:>12}  ({} x {} parameters)\n",
             human_bytes(static_cast<double>(r.weight_bytes)), dtype_short_name(query.weight_dtype),
             c.parameter_count());
  if (r.max_batch)
    fmt::print("max batch      {:>12}  requests of {} tokens in {} GiB next to the weights\n",
               *r.max_batch, o.seq_len, *o.gpu_mem);
  print_kv_groups(
      c, o.seq_len, o.block_size,
      static_cast<double>(r.bytes_per_token) / static_cast<double>(c.num_hidden_layers));
  fmt::print("\n{:<8} {:>8} {:>12} {:>12} {:>8}{}\n", "variant", "kv_heads", "per token",
             "per request", "vs MHA", r.max_batch ? "  max batch" : "");
  for (const auto& [name, heads] : variants) {
    const auto v = kv_memory(c, with_kv_heads(query, variant_heads(heads)));
    const std::string ratio =
        heads == c.num_attention_heads ? "1x"
        : heads > 0                    ? fmt::format("1/{}x", c.num_attention_heads / heads)
                    : fmt::format("1/{:.1f}x", static_cast<double>(mha.bytes_per_token) /
                                                   static_cast<double>(v.bytes_per_token));
    fmt::print("{:<8} {:>8} {:>12} {:>12} {:>8}{}\n", name,
               heads > 0 ? fmt::format("{}", heads) : "latent",
               human_bytes(static_cast<double>(v.bytes_per_token)),
               human_bytes(static_cast<double>(v.bytes_per_request)), ratio,
               v.max_batch ? fmt::format("  {:>9}", *v.max_batch) : "");
  }
}

}  // namespace

void register_memory(CLI::App& app) {
  auto o = std::make_shared<MemoryOptions>();
  auto* sub = app.add_subcommand("memory", "KV-cache memory arithmetic for a model");
  sub->add_option("--model", o->model, "Preset name (e.g. llama-7b) or model folder")->required();
  sub->add_option("--seq-len", o->seq_len, "Tokens per request (prompt + output)");
  sub->add_option("--batch", o->batch, "Concurrent requests")->capture_default_str();
  sub->add_option(
      "--dtype", o->dtype,
      "KV dtype: f32, f16, bf16, fp8, or a quantized row format int8, q8_0, q4_0, q4_1, int2, "
      "kivi2, kivi4 (scales and KIVI's fp16 open group counted) (default: f16, or the GPU "
      "profile's)");
  sub->add_option("--weight-dtype", o->weight_dtype, "Weight element type (default: --dtype)");
  sub->add_option("--kv-heads", o->kv_heads, "KV heads (MHA = query heads, GQA = groups, MQA = 1)");
  sub->add_option("--gpu-mem", o->gpu_mem, "Device memory in GiB: report the max batch that fits")
      ->check(CLI::Range(1e-3, 1e6));  // 1e308 GiB made the max batch overflow int64
  sub->add_option("--gpu", o->gpu,
                  "Hardware profile (h200, a100-80gb, ... or a .toml): plan static vs paged");
  sub->add_option("--prompt-len", o->prompt_len, "Planner: expected prompt tokens per request");
  sub->add_option("--output-len", o->output_len, "Planner: expected output tokens per request");
  sub->add_option("--max-seq-len", o->max_seq_len,
                  "Planner: tokens a static reservation holds (default: the model's context)");
  sub->add_option("--block-size", o->block_size, "Planner: paged block size")
      ->capture_default_str();
  sub->add_option("--value-dtype", o->value_dtype,
                  "V's element type when it is not --dtype's (llama.cpp's -ctv; KV arithmetic)");
  sub->add_option("--kv-residual", o->kv_residual,
                  "A KIVI cache (--dtype kivi2, kivi4): the newest tokens each request keeps in "
                  "fp16 (KIVI's residual length R, a multiple of 32)")
      ->capture_default_str();
  sub->add_option("--tp", o->tp,
                  "Planner: tensor parallelism, GPUs of --gpu sharing each layer (weights and K/V "
                  "heads split)")
      ->capture_default_str();
  sub->add_option("--cp", o->cp,
                  "Planner: context parallelism, groups of --tp GPUs sharing each sequence's KV "
                  "by positions (weights replicated)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1024}))
      ->capture_default_str();
  sub->add_flag("--json", o->json, "Print JSON");
  sub->callback([o]() { run_memory(*o); });
}

}  // namespace kvlab::cli
