#pragma once
// The CUDA backend's kernels: one parameter struct per kernel family, host launchers that
// return the launch status (cudaSuccess or the error; never throw), fp32 or bf16 storage with
// fp32 accumulation. Shapes are row-major; "rows" are the batch's tokens.
// Compiled by nvcc (C++17) and included by C++20 code: plain C++17, no CUDA types but cudaError_t.
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvlab::cuda {

enum class Dtype : std::uint8_t { f32, bf16 };
inline std::size_t dtype_bytes(Dtype d) {
  return d == Dtype::f32 ? 4 : 2;
}

// How the device KV pool stores a K or V head row of head_dim values, in the byte layout of the
// host pool's formats of the same names (kvlab::DType), so swapped rows are interchangeable:
//   compute  head_dim values in the activations' dtype (fp32 or bf16)
//   fp8_e4m3 head_dim fp8 e4m3 bytes (nearest even, saturated at +-448; kvlab "fp8")
//   int8     an fp32 scale (absmax / 127), then head_dim int8 codes (kvlab "int8")
// The quantized rows are written from the fp32 rotated K and the V row, and read back as fp32
// by the CUDA-core attention kernels (tensor cores take compute rows only).
enum class KvFormat : std::uint8_t { compute, fp8_e4m3, int8 };
inline std::int64_t kv_row_bytes(KvFormat format, Dtype dtype, std::int64_t head_dim) {
  if (format == KvFormat::fp8_e4m3) return head_dim;
  if (format == KvFormat::int8) return 4 + head_dim;
  return head_dim * static_cast<std::int64_t>(dtype_bytes(dtype));
}

// out (rows, dim) [fp32 residual stream] = table[tokens[r]] (vocab, dim) [dtype]
struct EmbeddingParams {
  const std::int32_t* tokens = nullptr;
  const void* table = nullptr;
  float* out = nullptr;
  std::int64_t rows = 0, dim = 0, vocab = 0;
  Dtype dtype = Dtype::f32;
};
cudaError_t launch_embedding(const EmbeddingParams& p, cudaStream_t stream);

// out (rows, dim) [dtype] = x / rms(x) * weight; x (rows, dim) fp32, weight (dim) fp32.
struct RmsNormParams {
  const float* x = nullptr;
  std::int64_t x_row_stride = 0;  // elements between rows of x (>= dim)
  const float* weight = nullptr;
  void* out = nullptr;
  std::int64_t rows = 0, dim = 0;
  float eps = 1e-5f;
  Dtype dtype = Dtype::f32;
};
cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream);

// The residual add and the next RMSNorm in one launch: x (rows, dim) fp32 += y (rows, dim)
// [dtype], then out (rows, dim) [dtype] = x / rms(x) * weight, with the arithmetic of
// launch_residual_add followed by launch_rms_norm (the same values, bit for bit).
struct AddRmsNormParams {
  float* x = nullptr;
  const void* y = nullptr;
  const float* weight = nullptr;
  void* out = nullptr;
  std::int64_t rows = 0, dim = 0;
  float eps = 1e-5f;
  Dtype dtype = Dtype::f32;
};
cudaError_t launch_add_rms_norm(const AddRmsNormParams& p, cudaStream_t stream);

// out (rows, ffn) [dtype] = silu(gate_up[:, :ffn]) * gate_up[:, ffn:]; gate_up (rows, 2 ffn).
struct SwiGluParams {
  const void* gate_up = nullptr;
  void* out = nullptr;
  std::int64_t rows = 0, ffn = 0;
  Dtype dtype = Dtype::f32;
};
cudaError_t launch_swiglu(const SwiGluParams& p, cudaStream_t stream);

// x (rows, dim) fp32 += y (rows, dim) [dtype]
struct ResidualAddParams {
  float* x = nullptr;
  const void* y = nullptr;
  std::int64_t rows = 0, dim = 0;
  Dtype dtype = Dtype::f32;
};
cudaError_t launch_residual_add(const ResidualAddParams& p, cudaStream_t stream);

// Per row r of the fused QKV projection qkv (rows, row_stride) [dtype] = [Q heads | K heads | V],
// at position positions[r]: rotates the Q heads in place and writes the rotated K heads and the V
// row into slot slots[r] of one layer of the device pool (slots, kv_heads x head_dim) [dtype]
// each; qkv's K columns are left as they were (attention reads K from the pool). RoPE is HF's
// rotate-half: for i < head_dim/2, (x_i, x_{i+hd/2}) <- (x_i cos - x_{i+hd/2} sin,
// x_{i+hd/2} cos + x_i sin), angle = position x theta^(-2i/hd), cos/sin from a table
// (max_positions, head_dim/2). One launch for what were RoPE on Q, RoPE on K and the K/V write.
// A quantized kv_format (head_dim <= 256) rounds each rotated K head and each V head from fp32
// into its row of kv_row_bytes (one warp per row: int8's scale needs the row's absmax).
struct RopeKvWriteParams {
  void* qkv = nullptr;
  std::int64_t row_stride = 0;  // elements between rows (>= (heads + 2 kv_heads) x head_dim)
  const std::int32_t* positions = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  const std::int64_t* slots = nullptr;
  void* k_pool = nullptr;
  void* v_pool = nullptr;
  std::int64_t rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  Dtype dtype = Dtype::f32;
  KvFormat kv_format = KvFormat::compute;  // the pools' rows (slots, kv_heads, kv_row_bytes)
};
cudaError_t launch_rope_kv_write(const RopeKvWriteParams& p, cudaStream_t stream);

// One sequence of an attention launch. Its queries are rows [first_row, + queries) at positions
// [start_position, + queries); its cached keys are positions [first_position, start_position +
// queries). Position p's slot: with v = p - first_position + lead,
// block_table[table_offset + (v >> block_shift)] + (v & (2^block_shift - 1)).
struct AttentionEntry {
  std::int32_t first_row = 0;
  std::int32_t queries = 0;
  std::int32_t start_position = 0;
  std::int32_t first_position = 0;
  std::int32_t block_shift = 0;   // its K/V in blocks of 2^block_shift slots (block_table.hpp)
  std::int32_t lead = 0;          // first_position's offset in its first block
  std::int64_t table_offset = 0;  // its first block in AttentionParams::block_table
};

// out (rows, heads x head_dim) [dtype] = softmax(q k^T / sqrt(hd), causal, window) v per head;
// query head h reads K/V head h / group. q rows of q_row_stride elements [dtype]; the pool is
// one layer: (slots, kv_heads, head_dim) [dtype] for K and for V.
// Decode entries (queries == 1) use split-K (flash-decoding): up to `max_splits` chunks of
// `split_keys` keys each in parallel, partial results in `workspace`, then a combine kernel.
// Prefill entries use a tiled kernel with an online softmax.
struct AttentionParams {
  const void* q = nullptr;
  std::int64_t q_row_stride = 0;
  const void* k_pool = nullptr;
  const void* v_pool = nullptr;
  const std::int64_t* block_table = nullptr;  // block start slots (block_table.hpp)
  const AttentionEntry* entries = nullptr;    // device array
  std::int32_t entry_count = 0;               // at most 65,535 sequences per launch
  std::int32_t max_keys = 0;     // the longest key range of any decode entry (split grid)
  std::int32_t max_queries = 0;  // the most queries of any entry (prefill grid)
  // The entries with more than one query (device array of prefill_count indices): the prefill
  // grid covers only these, so a mixed step's decodes cost it no empty blocks. nullptr: every
  // entry (each with one query or none returns at once).
  const std::int32_t* prefill_entries = nullptr;
  std::int32_t prefill_count = 0;
  void* out = nullptr;
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t window = 0;  // 0: none; else a query at p sees keys p - window + 1 .. p
  std::int32_t split_keys = 256;
  float* workspace = nullptr;  // attention_workspace_floats(...) floats
  Dtype dtype = Dtype::f32;
  // bf16 decode and prefill on tensor cores (mma.sync) where head_dim is a multiple of 16 up to
  // 128 and the pools are 16-byte aligned; false: the CUDA-core kernels (a comparison).
  bool tensor_cores = true;
  // fp8_e4m3 / int8 pools take the scalar decode and the CUDA-core prefill kernels.
  KvFormat kv_format = KvFormat::compute;
};
// Floats of workspace a launch with these sizes needs.
std::int64_t attention_workspace_floats(std::int64_t entries, std::int64_t heads,
                                        std::int64_t head_dim, std::int64_t max_keys,
                                        std::int64_t split_keys);
// Head dims and group sizes the attention kernels are instantiated for (DISPATCH_*); others
// return cudaErrorInvalidValue.
bool attention_supports(std::int64_t head_dim);
cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream);

// Converts n fp32 values to dtype (a copy for f32) and back.
cudaError_t launch_convert_from_f32(const float* in, void* out, std::int64_t n, Dtype dtype,
                                    cudaStream_t stream);
cudaError_t launch_convert_to_f32(const void* in, float* out, std::int64_t n, Dtype dtype,
                                  cudaStream_t stream);
// Moves whole slots between the device pool and a packed buffer in one launch (swaps), as bytes
// whatever the pool's format:
//   packed (layers, 2 [K, V], count, row_bytes)  <->  K/V of every layer at slots[i].
// Gather (to_pool false): packed = pool rows; scatter (to_pool true): pool rows = packed. The
// slots must be distinct for a scatter. row_bytes and layer_bytes: multiples of 4.
struct SlotRowsParams {
  void* k_pool = nullptr;
  void* v_pool = nullptr;
  std::int64_t layer_bytes = 0;  // bytes between one layer and the next in each pool
  std::int64_t layers = 0;
  const std::int64_t* slots = nullptr;  // device array of count slots
  std::int64_t count = 0;
  std::int64_t row_bytes = 0;  // one slot's row in one layer: kv_heads x kv_row_bytes
  void* packed = nullptr;
  bool to_pool = false;
};
cudaError_t launch_copy_slot_rows(const SlotRowsParams& p, cudaStream_t stream);

// How one row's token is chosen (kvlab::TokenChoice, laid out for the device): temperature 0
// takes the argmax; otherwise softmax(logits / temperature) cut to the top_k (0: off), then to
// the top_p nucleus (1: off), renormalised, and the token whose cumulative probability first
// exceeds `uniform` (this step's draw from the request's RNG, in [0, 1)).
struct RowSampling {
  double temperature = 0;
  double top_p = 1;
  double uniform = 0;
  std::int32_t top_k = 0;
};

// Token choice on the device: out[r] = row r's token of logits (rows, vocab) fp32 as
// kvlab::pick_token chooses it from the same row and choices[r] (device memory; nullptr: every
// row greedy); the argmax takes the lowest index on ties. -1 for a row that holds NaN or +-inf (the
// engine reports it as it reports such logits on the host).
cudaError_t launch_sample_rows(const float* logits, std::int64_t rows, std::int64_t vocab,
                               const RowSampling* choices, std::int32_t* out, cudaStream_t stream);

// A token and its log-probability (kvlab::TokenLogprob's layout).
struct LogprobEntry {
  std::int32_t token = -1;
  float logprob = 0;
};

// Log-probabilities of rows of logits (rows, vocab) fp32 under softmax (temperature 1, before
// any filtering), as kvlab::token_logprob / kvlab::top_logprobs compute them: out row r (width,
// device memory) = {chosen[r], its logprob}, then the counts[r] (< width) most likely tokens,
// most likely first, the lower id first among equals, then {-1, NaN}. A row with counts[r] < 0,
// a chosen token of -1 or a non-finite logit is all {-1, NaN}.
cudaError_t launch_row_logprobs(const float* logits, std::int64_t rows, std::int64_t vocab,
                                const std::int32_t* chosen, const std::int32_t* counts, int width,
                                LogprobEntry* out, cudaStream_t stream);

// Gathers rows: out[i] (dim) = in[index[i]] (fp32).
cudaError_t launch_gather_rows(const float* in, const std::int32_t* index, float* out,
                               std::int64_t rows, std::int64_t dim, cudaStream_t stream);

}  // namespace kvlab::cuda
