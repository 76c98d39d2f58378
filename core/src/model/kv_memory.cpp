#include "kvlab/model/kv_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab {

namespace {

// K's and V's dtypes hold head rows of head_dim values, and KIVI's residual length is one it
// takes; else kvlab::Error.
void check_kv_dtypes(const ModelConfig& c, const KvMemoryQuery& q, std::int64_t head_dim) {
  if (!dtype_row_fits(q.kv_dtype, head_dim))
    throw Error(fmt::format("{} KV needs {} to be a multiple of 32 (its blocks); {} has {}",
                            dtype_short_name(q.kv_dtype),
                            c.is_mla() && !q.kv_heads ? "half the latent" : "head_dim", c.name,
                            head_dim));
  const DType value_dtype = q.kv_value_dtype.value_or(q.kv_dtype);
  if (!dtype_row_fits(value_dtype, head_dim))
    throw Error(fmt::format("{} V needs head_dim to be a multiple of 32 (its blocks); {} has {}",
                            dtype_short_name(value_dtype), c.name, head_dim));
  if (value_dtype != q.kv_dtype && (dtype_is_kivi(q.kv_dtype) || dtype_is_kivi(value_dtype)))
    throw Error("KIVI quantizes K per channel and V per token at one width: give it to both");
  if (!kivi_residual_valid(q.kivi_residual))
    throw Error(fmt::format("a KIVI residual of {} tokens: a multiple of {} in [0, {}] expected",
                            q.kivi_residual, kKiviGroup, kKiviResidualMost));
}

}  // namespace

KvMemoryReport kv_memory(const ModelConfig& c, const KvMemoryQuery& q) {
  if (q.seq_len <= 0) throw Error(fmt::format("seq-len must be positive, got {}", q.seq_len));
  if (q.batch <= 0) throw Error(fmt::format("batch must be positive, got {}", q.batch));
  KvMemoryReport r;
  r.kv_heads = q.kv_heads.value_or(c.cache_kv_heads());
  if (r.kv_heads <= 0 || c.num_attention_heads % r.kv_heads != 0)
    throw Error(fmt::format("kv-heads {} must be a positive divisor of the {} query heads of {}",
                            r.kv_heads, c.num_attention_heads, c.name));
  // MLA: half the latent (a K or a V row); with kv_heads given, what those heads would cache as
  // plain K and V of v_head_dim each (the DeepSeek-V2 paper's comparison, d_h = 128).
  const std::int64_t head_dim = c.is_mla() && q.kv_heads ? c.value_head_dim() : c.cache_head_dim();
  check_kv_dtypes(c, q, head_dim);
  // Bytes of one head's K row and V row of one token, scales included.
  const std::int64_t head_rows = dtype_row_bytes(q.kv_dtype, head_dim) +
                                 dtype_row_bytes(q.kv_value_dtype.value_or(q.kv_dtype), head_dim);
  const auto per_token =
      checked_product<std::int64_t>({c.num_hidden_layers, r.kv_heads, head_rows});
  if (!per_token) throw Error(fmt::format("{}: KV bytes per token overflow 64 bits", c.name));
  r.bytes_per_token = *per_token;
  if (dtype_is_kivi(q.kv_dtype))
    r.residual_bytes_per_request = kivi_open_groups(q.seq_len, q.kivi_residual) * kKiviGroup * 2 *
                                   c.num_hidden_layers * r.kv_heads *
                                   dtype_row_bytes(DType::dtype_f16, head_dim);
  const auto sealed = checked_mul(r.bytes_per_token, q.seq_len);
  const auto per_request =
      sealed ? checked_add(*sealed, r.residual_bytes_per_request) : std::nullopt;
  const auto total = per_request ? checked_mul(*per_request, q.batch) : std::nullopt;
  if (!total)
    throw Error(fmt::format(
        "seq-len {} x batch {} x {} bytes per token is more bytes than 64 bits can count",
        q.seq_len, q.batch, r.bytes_per_token));
  r.bytes_per_request = *per_request;
  r.bytes_total = *total;
  r.weight_bytes = c.parameter_count() * static_cast<std::int64_t>(dtype_size(q.weight_dtype));
  if (q.gpu_memory_gib) {
    if (!(*q.gpu_memory_gib > 0))
      throw Error(fmt::format("gpu-mem must be positive GiB, got {}", *q.gpu_memory_gib));
    const double free_bytes = *q.gpu_memory_gib * kGiB - static_cast<double>(r.weight_bytes);
    r.max_batch = free_bytes <= 0 ? 0
                                  : static_cast<std::int64_t>(std::floor(
                                        free_bytes / static_cast<double>(r.bytes_per_request)));
  }
  return r;
}

double kv_budget_bytes(const HardwareProfile& device, double weight_bytes) {
  return std::max(0.0, device.memory_gib * kGiB * device.memory_utilization - weight_bytes -
                           device.activation_reserve_gib * kGiB);
}

std::int64_t kv_heads_per_gpu(std::int64_t query_heads, std::int64_t kv_heads, std::int64_t tp) {
  if (tp < 1) throw Error(fmt::format("tensor parallelism must be >= 1 GPU, got {}", tp));
  if (query_heads % tp != 0)
    throw Error(
        fmt::format("tensor parallelism {} does not divide the {} query heads", tp, query_heads));
  if (kv_heads % tp != 0 && tp % kv_heads != 0)
    throw Error(fmt::format(
        "tensor parallelism {} and the {} K/V heads must divide one another (each GPU holds "
        "kv_heads / tp heads, or one replicated head when tp > kv_heads)",
        tp, kv_heads));
  return std::max<std::int64_t>(1, kv_heads / tp);
}

double parameters_per_gpu(const ModelConfig& c, std::int64_t tp) {
  const auto layers = static_cast<double>(c.num_hidden_layers);
  const double norms = static_cast<double>(c.num_hidden_layers) *
                           static_cast<double>(2 * c.hidden_size + c.kv_lora_rank + c.q_lora_rank) +
                       static_cast<double>(c.hidden_size);
  if (c.is_mla()) {  // W_kv_a (and W_q_a) replicated, as vLLM's ReplicatedLinear; the rest split
    kv_heads_per_gpu(c.num_attention_heads, 1, tp);  // checks tp against the heads
    const double replicated = layers * static_cast<double>(c.hidden_size) *
                              static_cast<double>(c.latent_dim() + c.q_lora_rank);
    const double split = static_cast<double>(c.parameter_count()) - norms - replicated;
    return split / static_cast<double>(tp) + norms + replicated;
  }
  const std::int64_t per_gpu_kv =
      kv_heads_per_gpu(c.num_attention_heads, c.num_key_value_heads, tp);
  const double kv_projections =
      layers * static_cast<double>(c.hidden_size) * 2.0 * static_cast<double>(c.head_dim);
  const double split = static_cast<double>(c.parameter_count()) - norms -
                       kv_projections * static_cast<double>(c.num_key_value_heads);
  return split / static_cast<double>(tp) + norms + kv_projections * static_cast<double>(per_gpu_kv);
}

MemoryPlan plan_memory(const ModelConfig& c, const HardwareProfile& device,
                       const MemoryPlanQuery& q) {
  if (q.prompt_tokens <= 0 || q.output_tokens < 0)
    throw Error(fmt::format("expected lengths must be positive: prompt {}, output {}",
                            q.prompt_tokens, q.output_tokens));
  if (q.block_size < 1) throw Error(fmt::format("block size must be >= 1, got {}", q.block_size));
  MemoryPlan p;
  const auto expected_sum = checked_add(q.prompt_tokens, q.output_tokens);
  if (!expected_sum)
    throw Error(fmt::format("prompt {} + output {} tokens overflow 64 bits", q.prompt_tokens,
                            q.output_tokens));
  const std::int64_t expected = *expected_sum;
  p.static_tokens_per_request = q.max_seq_len > 0 ? q.max_seq_len : c.max_position_embeddings;
  if (expected > p.static_tokens_per_request)
    throw Error(fmt::format("prompt {} + output {} exceed the {}-token context", q.prompt_tokens,
                            q.output_tokens, p.static_tokens_per_request));
  const KvMemoryReport kv = kv_memory(c, {expected, 1, q.kv_dtype, q.weight_dtype, q.kv_heads,
                                          std::nullopt, q.kivi_residual, std::nullopt});
  p.kv_heads = kv.kv_heads;
  p.tensor_parallel = q.tensor_parallel;
  p.kv_heads_per_gpu = kv_heads_per_gpu(c.num_attention_heads, kv.kv_heads, q.tensor_parallel);
  p.kv_bytes_per_token = kv.bytes_per_token / kv.kv_heads * p.kv_heads_per_gpu;
  p.usable_bytes = device.memory_gib * kGiB * device.memory_utilization;
  // The checkpoint's weights (whatever K/V heads the cache keeps), one GPU's share.
  p.weight_bytes =
      parameters_per_gpu(c, q.tensor_parallel) * static_cast<double>(dtype_size(q.weight_dtype));
  p.reserve_bytes = device.activation_reserve_gib * kGiB;
  p.kv_budget_bytes = kv_budget_bytes(device, p.weight_bytes);
  if (q.context_parallel < 1)
    throw Error(fmt::format("context parallelism must be >= 1, got {}", q.context_parallel));
  p.context_parallel = q.context_parallel;
  p.kv_capacity_tokens = static_cast<std::int64_t>(std::floor(
                             p.kv_budget_bytes / static_cast<double>(p.kv_bytes_per_token))) *
                         q.context_parallel;
  p.paged_tokens_per_request = (expected + q.block_size - 1) / q.block_size * q.block_size;
  p.max_static_requests = p.kv_capacity_tokens / p.static_tokens_per_request;
  // Paged: whole blocks of the pool, each request holding its own.
  p.max_paged_requests =
      p.kv_capacity_tokens / q.block_size * q.block_size / p.paged_tokens_per_request;
  p.kv_residual_bytes_per_request =
      kv.residual_bytes_per_request / kv.kv_heads * p.kv_heads_per_gpu / q.context_parallel;
  if (p.kv_residual_bytes_per_request > 0)  // each request's open group beside its blocks
    p.max_paged_requests = static_cast<std::int64_t>(
        std::floor(p.kv_budget_bytes * static_cast<double>(q.context_parallel) /
                   static_cast<double>(p.paged_tokens_per_request * p.kv_bytes_per_token +
                                       p.kv_residual_bytes_per_request * q.context_parallel)));
  return p;
}

}  // namespace kvlab
