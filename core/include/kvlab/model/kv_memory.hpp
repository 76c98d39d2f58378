#pragma once
// KV-cache memory arithmetic:
//   KV bytes = 2 (K and V) x batch x layers x kv_heads x seq_len x head_dim x bytes_per_element
// (latent attention: batch x layers x seq_len x (kv_lora_rank + qk_rope_head_dim) x bytes).
#include <cstdint>
#include <optional>

#include "kvlab/dtype.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

struct KvMemoryQuery {
  std::int64_t seq_len = 0;               // tokens per request (prompt + output)
  std::int64_t batch = 1;                 // concurrent requests
  DType kv_dtype = DType::dtype_f16;      // element type of the cache
  DType weight_dtype = DType::dtype_f16;  // element type of the weights
  // Override (MHA = heads, GQA = groups, MQA = 1). On a latent-attention (MLA) model: the same
  // heads caching plain K and V of v_head_dim each instead of the latent.
  std::optional<std::int64_t> kv_heads;
  std::optional<double> gpu_memory_gib;               // device memory, for the max batch
  std::int64_t kivi_residual = kKiviResidualDefault;  // a KIVI cache's fp16 tokens (R)
  std::optional<DType> kv_value_dtype =
      std::nullopt;  // V's element type when it is not kv_dtype (K's)
};

struct KvMemoryReport {
  std::int64_t kv_heads = 0;
  std::int64_t bytes_per_token = 0;    // one token, all layers, K and V (each in its dtype)
  std::int64_t bytes_per_request = 0;  // seq_len tokens (+ residual_bytes_per_request)
  // A KIVI cache's open groups (kvlab/kv/kivi_groups.hpp): a request's newest R to R + 31
  // tokens also held in fp16 until their group seals, kivi_open_groups(seq_len, R) x 32 x 2 x
  // layers x kv_heads x head_dim x 2 B; 0 for the other dtypes.
  std::int64_t residual_bytes_per_request = 0;
  std::int64_t bytes_total = 0;   // batch requests
  std::int64_t weight_bytes = 0;  // parameters x weight dtype size
  // Requests of seq_len tokens that fit next to the weights: floor((gpu - weights) / request).
  // Zero when the weights alone do not fit; nullopt without gpu_memory_gib.
  std::optional<std::int64_t> max_batch;
};

// Throws kvlab::Error for a non-positive length/batch, or kv_heads that do not divide the
// query heads.
KvMemoryReport kv_memory(const ModelConfig& config, const KvMemoryQuery& query);

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The memory planner: on one device, how many requests fit at once under a static KV
// reservation (every request holds max_seq_len tokens: the model's context unless given) versus
// a paged one (every request holds its expected prompt + output tokens, rounded up to blocks).
struct MemoryPlanQuery {
  std::int64_t prompt_tokens = 0;  // expected per request
  std::int64_t output_tokens = 0;  // expected per request
  std::int64_t max_seq_len = 0;    // static reservation; 0: the model's context
  std::int64_t block_size = 16;    // paged
  std::optional<std::int64_t> kv_heads;
  DType weight_dtype = DType::dtype_bf16;
  DType kv_dtype = DType::dtype_bf16;
  std::int64_t tensor_parallel = 1;  // GPUs sharing each layer: every byte below is one GPU's
  // Groups of those GPUs sharing each sequence's KV by positions (context parallelism): a GPU
  // holds 1/cp of every request's tokens, so the tokens that fit are cp times more.
  std::int64_t context_parallel = 1;
  std::int64_t kivi_residual = kKiviResidualDefault;  // a KIVI cache's fp16 tokens (R)
};

struct MemoryPlan {
  std::int64_t kv_heads = 0;  // of the model
  std::int64_t tensor_parallel = 1;
  std::int64_t context_parallel = 1;
  std::int64_t kv_heads_per_gpu = 0;    // kv_heads / tp, or 1 replicated when tp > kv_heads
  double usable_bytes = 0;              // memory_gib x utilization
  double weight_bytes = 0;              // parameters x weight dtype, one GPU's share
  double reserve_bytes = 0;             // activations
  double kv_budget_bytes = 0;           // usable - weights - reserve (0 when negative)
  std::int64_t kv_bytes_per_token = 0;  // 2 x layers x kv_heads_per_gpu x head_dim x kv dtype
  std::int64_t kv_capacity_tokens = 0;  // floor(budget / bytes per token) x context_parallel
  std::int64_t static_tokens_per_request = 0;
  std::int64_t paged_tokens_per_request = 0;  // ceil((prompt + output) / block) x block
  // A KIVI cache's fp16 open groups per request (KvMemoryReport), one GPU's share: paid beside
  // its paged tokens (max_paged_requests counts it).
  std::int64_t kv_residual_bytes_per_request = 0;
  std::int64_t max_static_requests = 0;
  std::int64_t max_paged_requests = 0;
};

// Tensor parallelism over `tp` GPUs splits the query heads evenly and the K/V heads too; with
// fewer K/V heads than GPUs each GPU keeps one K/V head (replicated, as vLLM does). Returns the
// K/V heads one GPU holds. Throws kvlab::Error unless tp >= 1 divides the query heads and tp and
// the K/V heads divide one another.
std::int64_t kv_heads_per_gpu(std::int64_t query_heads, std::int64_t kv_heads, std::int64_t tp);
// The parameters one GPU of a tensor-parallel group holds: every matrix split tp ways (the
// embedding and LM head by vocabulary), norms whole, replicated K/V heads' projections whole.
double parameters_per_gpu(const ModelConfig& model, std::int64_t tp);

struct HardwareProfile;
// Bytes left for KV on a device: memory_gib x utilization - weights - activation reserve (>= 0).
double kv_budget_bytes(const HardwareProfile& device, double weight_bytes);

// Throws kvlab::Error for non-positive lengths, a block size < 1, expected lengths beyond the
// static reservation, or kv_heads that do not divide the query heads.
MemoryPlan plan_memory(const ModelConfig& model, const HardwareProfile& device,
                       const MemoryPlanQuery& query);

}  // namespace kvlab
