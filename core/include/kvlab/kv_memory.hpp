#pragma once
// KV-cache memory arithmetic:
//   KV bytes = 2 (K and V) x batch x layers x kv_heads x seq_len x head_dim x bytes_per_element
#include <cstdint>
#include <optional>

#include "kvlab/dtype.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

struct KvMemoryQuery {
  std::int64_t seq_len = 0;               // tokens per request (prompt + output)
  std::int64_t batch = 1;                 // concurrent requests
  DType kv_dtype = DType::dtype_f16;      // element type of the cache
  DType weight_dtype = DType::dtype_f16;  // element type of the weights
  std::optional<std::int64_t> kv_heads;   // override (MHA = heads, GQA = groups, MQA = 1)
  std::optional<double> gpu_memory_gib;   // device memory, for the max batch
};

struct KvMemoryReport {
  std::int64_t kv_heads = 0;
  std::int64_t bytes_per_token = 0;    // one token, all layers, K and V
  std::int64_t bytes_per_request = 0;  // seq_len tokens
  std::int64_t bytes_total = 0;        // batch requests
  std::int64_t weight_bytes = 0;       // parameters x weight dtype size
  // Requests of seq_len tokens that fit next to the weights: floor((gpu - weights) / request).
  // Zero when the weights alone do not fit; nullopt without gpu_memory_gib.
  std::optional<std::int64_t> max_batch;
};

// Throws kvlab::Error for a non-positive length/batch, or kv_heads that do not divide the
// query heads.
KvMemoryReport kv_memory(const ModelConfig& config, const KvMemoryQuery& query);

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

}  // namespace kvlab
