#include "kvlab/kv_memory.hpp"

#include <fmt/format.h>

#include <cmath>

#include "kvlab/error.hpp"

namespace kvlab {

KvMemoryReport kv_memory(const ModelConfig& c, const KvMemoryQuery& q) {
  if (q.seq_len <= 0) throw Error(fmt::format("seq-len must be positive, got {}", q.seq_len));
  if (q.batch <= 0) throw Error(fmt::format("batch must be positive, got {}", q.batch));
  KvMemoryReport r;
  r.kv_heads = q.kv_heads.value_or(c.num_key_value_heads);
  if (r.kv_heads <= 0 || c.num_attention_heads % r.kv_heads != 0)
    throw Error(fmt::format("kv-heads {} must be a positive divisor of the {} query heads of {}",
                            r.kv_heads, c.num_attention_heads, c.name));
  const auto kv_element = static_cast<std::int64_t>(dtype_size(q.kv_dtype));
  r.bytes_per_token = 2 * c.num_hidden_layers * r.kv_heads * c.head_dim * kv_element;
  r.bytes_per_request = r.bytes_per_token * q.seq_len;
  r.bytes_total = r.bytes_per_request * q.batch;
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

}  // namespace kvlab
