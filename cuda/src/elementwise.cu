// Embedding gather, RMSNorm (with the residual add before it), RoPE with the K/V write, SwiGLU,
// residual add, slot-row copies, conversions.
#include "common.cuh"

namespace kvlab::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPairsPerLane = 4;  // a quantized K/V row's (i, i + head_dim/2) pairs per lane

// out (rows, dim) fp32 = table[tokens[r]]
template <typename T>
__global__ void embedding_kernel(EmbeddingParams p) {
  const std::int64_t row = blockIdx.x;
  const std::int32_t token = p.tokens[row];
  const T* source = static_cast<const T*>(p.table) + static_cast<std::int64_t>(token) * p.dim;
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x)
    p.out[row * p.dim + i] = to_float(source[i]);
}

// rsqrt(sum / dim + eps) of the block's per-thread sums of squares, to every thread.
__device__ float block_inverse_rms(float sum, std::int64_t dim, float eps) {
  __shared__ float partial[kThreads / 32];
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    sum = warp_sum(sum);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / static_cast<float>(dim) + eps);
  }
  __syncthreads();
  const float inverse_rms = partial[0];
  __syncthreads();  // read before another call writes partial
  return inverse_rms;
}

// One block per row: out = x * rsqrt(mean(x^2) + eps) * weight.
template <typename T>
__global__ void rms_norm_kernel(RmsNormParams p) {
  const float* x = p.x + static_cast<std::int64_t>(blockIdx.x) * p.x_row_stride;
  T* out = static_cast<T*>(p.out) + static_cast<std::int64_t>(blockIdx.x) * p.dim;
  float sum = 0.0f;
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) sum += x[i] * x[i];
  const float inverse_rms = block_inverse_rms(sum, p.dim, p.eps);
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x)
    out[i] = from_float<T>(x[i] * inverse_rms * p.weight[i]);
}

// One block per row: x += y, then out = x * rsqrt(mean(x^2) + eps) * weight. Each thread reads
// back only the elements it wrote.
template <typename T>
__global__ void add_rms_norm_kernel(AddRmsNormParams p) {
  const std::int64_t row = blockIdx.x;
  float* x = p.x + row * p.dim;
  const T* y = static_cast<const T*>(p.y) + row * p.dim;
  T* out = static_cast<T*>(p.out) + row * p.dim;
  float sum = 0.0f;
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
    x[i] += to_float(y[i]);
    sum += x[i] * x[i];
  }
  const float inverse_rms = block_inverse_rms(sum, p.dim, p.eps);
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x)
    out[i] = from_float<T>(x[i] * inverse_rms * p.weight[i]);
}

// One block per row: (head, i < head_dim / 2) pairs of the Q and K heads, then the V row.
template <typename T>
__global__ void rope_kv_write_kernel(RopeKvWriteParams p) {
  const std::int64_t row = blockIdx.x, half = p.head_dim / 2;
  const std::int64_t position = p.positions[row], slot = p.slots[row];
  const std::int64_t q_dim = p.heads * p.head_dim, kv_dim = p.kv_heads * p.head_dim;
  T* qkv = static_cast<T*>(p.qkv) + row * p.row_stride;
  T* k_out = static_cast<T*>(p.k_pool) + slot * kv_dim;
  for (std::int64_t pair = threadIdx.x; pair < (p.heads + p.kv_heads) * half; pair += blockDim.x) {
    const std::int64_t head = pair / half, i = pair % half;
    const float c = p.cos[position * half + i], s = p.sin[position * half + i];
    T* x = qkv + head * p.head_dim;  // a Q head, or (head >= heads) a K head
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const T r1 = from_float<T>(x1 * c - x2 * s), r2 = from_float<T>(x2 * c + x1 * s);
    if (head < p.heads) {
      x[i] = r1;
      x[i + half] = r2;
    } else {
      T* k = k_out + (head - p.heads) * p.head_dim;
      k[i] = r1;
      k[i + half] = r2;
    }
  }
  const T* v = qkv + q_dim + kv_dim;
  T* v_out = static_cast<T*>(p.v_pool) + slot * kv_dim;
  for (std::int64_t i = threadIdx.x; i < kv_dim; i += blockDim.x) v_out[i] = v[i];
}

// Writes one head row (head_dim = 2 half values; a lane holds elements i = lane + 32 j and
// i + half in lo[j] and hi[j]) into `row` in format F: the host pool's rounding, bit for bit
// (int8: scale = absmax / 127, codes nearest even, clamped to +-127, NaN to 0). Whole warps.
template <KvFormat F>
__device__ void store_quantized_row(const float (&lo)[kMaxPairsPerLane],
                                    const float (&hi)[kMaxPairsPerLane], std::int64_t half,
                                    int lane, char* row) {
  if constexpr (F == KvFormat::fp8_e4m3) {
    for (int j = 0; j < kMaxPairsPerLane; ++j) {
      const std::int64_t i = lane + 32 * j;
      if (i >= half) break;
      row[i] = static_cast<char>(fp8_e4m3_from_float(lo[j]));
      row[i + half] = static_cast<char>(fp8_e4m3_from_float(hi[j]));
    }
  } else {
    float amax = 0.0f;
    for (int j = 0; j < kMaxPairsPerLane; ++j)
      if (lane + 32 * j < half) amax = fmaxf(amax, fmaxf(fabsf(lo[j]), fabsf(hi[j])));
    const float scale = warp_max(amax) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    if (lane == 0) std::memcpy(row, &scale, sizeof scale);
    const auto code = [inverse](float x) {
      const float q = round_to_even(x * inverse);  // NaN for a NaN value or an infinite scale
      return static_cast<char>(
          static_cast<signed char>(q != q ? 0.0f : fminf(fmaxf(q, -127.0f), 127.0f)));
    };
    for (int j = 0; j < kMaxPairsPerLane; ++j) {
      const std::int64_t i = lane + 32 * j;
      if (i >= half) break;
      row[4 + i] = code(lo[j]);
      row[4 + i + half] = code(hi[j]);
    }
  }
}

// RoPE with the K/V write into a quantized pool (F fp8_e4m3 or int8): threads rotate the Q heads
// in place as rope_kv_write_kernel does; then each warp takes whole K and V head rows, rotates K
// in fp32 and rounds the row into its slot (store_quantized_row).
template <typename T, KvFormat F>
__global__ void rope_kv_quantize_kernel(RopeKvWriteParams p) {
  const std::int64_t row = blockIdx.x, half = p.head_dim / 2;
  const std::int64_t position = p.positions[row], slot = p.slots[row];
  T* qkv = static_cast<T*>(p.qkv) + row * p.row_stride;
  for (std::int64_t pair = threadIdx.x; pair < p.heads * half; pair += blockDim.x) {
    const std::int64_t head = pair / half, i = pair % half;
    const float c = p.cos[position * half + i], s = p.sin[position * half + i];
    T* x = qkv + head * p.head_dim;
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    x[i] = from_float<T>(x1 * c - x2 * s);
    x[i + half] = from_float<T>(x2 * c + x1 * s);
  }
  const std::int64_t row_bytes = F == KvFormat::int8 ? 4 + p.head_dim : p.head_dim;
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (std::int64_t h = threadIdx.x / 32; h < 2 * p.kv_heads; h += blockDim.x / 32) {
    const bool is_key = h < p.kv_heads;
    const std::int64_t kv_head = is_key ? h : h - p.kv_heads;
    const T* x = qkv + (p.heads + h) * p.head_dim;  // K heads, then V heads
    float lo[kMaxPairsPerLane], hi[kMaxPairsPerLane];
    for (int j = 0; j < kMaxPairsPerLane; ++j) {
      const std::int64_t i = lane + 32 * j;
      const float x1 = i < half ? to_float(x[i]) : 0.0f,
                  x2 = i < half ? to_float(x[i + half]) : 0.0f;
      lo[j] = x1;
      hi[j] = x2;
      if (is_key && i < half) {
        const float c = p.cos[position * half + i], s = p.sin[position * half + i];
        lo[j] = x1 * c - x2 * s;
        hi[j] = x2 * c + x1 * s;
      }
    }
    char* pool = static_cast<char*>(is_key ? p.k_pool : p.v_pool);
    store_quantized_row<F>(lo, hi, half, lane, pool + (slot * p.kv_heads + kv_head) * row_bytes);
  }
}

template <typename T>
__global__ void swiglu_kernel(SwiGluParams p) {
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= p.rows * p.ffn) return;
  const std::int64_t row = index / p.ffn, i = index % p.ffn;
  const T* gate_up = static_cast<const T*>(p.gate_up) + row * 2 * p.ffn;
  const float gate = to_float(gate_up[i]), up = to_float(gate_up[p.ffn + i]);
  static_cast<T*>(p.out)[index] = from_float<T>(gate / (1.0f + __expf(-gate)) * up);
}

template <typename T>
__global__ void residual_add_kernel(ResidualAddParams p) {
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= p.rows * p.dim) return;
  p.x[index] += to_float(static_cast<const T*>(p.y)[index]);
}

// One block per (slot i, layer x K/V), 4-byte words.
__global__ void slot_rows_kernel(SlotRowsParams p) {
  const std::int64_t i = blockIdx.x, layer_kv = blockIdx.y, words = p.row_bytes / 4;
  char* pool_bytes = static_cast<char*>(layer_kv % 2 == 0 ? p.k_pool : p.v_pool) +
                     (layer_kv / 2) * p.layer_bytes + p.slots[i] * p.row_bytes;
  auto* pool = reinterpret_cast<std::uint32_t*>(pool_bytes);
  auto* packed = static_cast<std::uint32_t*>(p.packed) + (layer_kv * p.count + i) * words;
  for (std::int64_t d = threadIdx.x; d < words; d += blockDim.x) {
    if (p.to_pool)
      pool[d] = packed[d];
    else
      packed[d] = pool[d];
  }
}

template <typename T>
__global__ void from_f32_kernel(const float* in, T* out, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_float<T>(in[i]);
}
template <typename T>
__global__ void to_f32_kernel(const T* in, float* out, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = to_float(in[i]);
}
__global__ void gather_rows_kernel(const float* in, const std::int32_t* index, float* out,
                                   std::int64_t dim) {
  const float* source = in + static_cast<std::int64_t>(index[blockIdx.x]) * dim;
  for (std::int64_t i = threadIdx.x; i < dim; i += blockDim.x)
    out[static_cast<std::int64_t>(blockIdx.x) * dim + i] = source[i];
}

}  // namespace

cudaError_t launch_embedding(const EmbeddingParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(embedding_kernel<T>, static_cast<unsigned>(p.rows), kThreads, stream, p);
  });
}

cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(rms_norm_kernel<T>, static_cast<unsigned>(p.rows), kThreads, stream, p);
  });
}

cudaError_t launch_add_rms_norm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(add_rms_norm_kernel<T>, static_cast<unsigned>(p.rows), kThreads, stream,
                         p);
  });
}

cudaError_t launch_rope_kv_write(const RopeKvWriteParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.head_dim % 2 != 0 || p.rows > 0x7fffffff ||
      p.row_stride < (p.heads + 2 * p.kv_heads) * p.head_dim)
    return cudaErrorInvalidValue;
  if (p.kv_format != KvFormat::compute && p.head_dim > 2 * 32 * kMaxPairsPerLane)
    return cudaErrorInvalidValue;
  const unsigned rows = static_cast<unsigned>(p.rows);
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    if (p.kv_format == KvFormat::fp8_e4m3)
      return launch_kernel(rope_kv_quantize_kernel<T, KvFormat::fp8_e4m3>, rows, kThreads, stream,
                           p);
    if (p.kv_format == KvFormat::int8)
      return launch_kernel(rope_kv_quantize_kernel<T, KvFormat::int8>, rows, kThreads, stream, p);
    return launch_kernel(rope_kv_write_kernel<T>, rows, kThreads, stream, p);
  });
}

cudaError_t launch_swiglu(const SwiGluParams& p, cudaStream_t stream) {
  const std::int64_t n = p.rows * p.ffn;
  if (n <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(swiglu_kernel<T>, blocks_for(n, kThreads), kThreads, stream, p);
  });
}

cudaError_t launch_residual_add(const ResidualAddParams& p, cudaStream_t stream) {
  const std::int64_t n = p.rows * p.dim;
  if (n <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(residual_add_kernel<T>, blocks_for(n, kThreads), kThreads, stream, p);
  });
}

cudaError_t launch_copy_slot_rows(const SlotRowsParams& p, cudaStream_t stream) {
  if (p.count <= 0 || p.layers <= 0) return cudaSuccess;
  if (p.layers * 2 > 65535 || p.row_bytes <= 0 || p.row_bytes % 4 != 0 || p.layer_bytes % 4 != 0)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.count), static_cast<unsigned>(p.layers * 2));
  return launch_kernel(slot_rows_kernel, grid, 128, stream, p);
}

cudaError_t launch_convert_from_f32(const float* in, void* out, std::int64_t n, Dtype dtype,
                                    cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(dtype, T, {
    return launch_kernel(from_f32_kernel<T>, blocks_for(n, kThreads), kThreads, stream, in,
                         static_cast<T*>(out), n);
  });
}

cudaError_t launch_convert_to_f32(const void* in, float* out, std::int64_t n, Dtype dtype,
                                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(dtype, T, {
    return launch_kernel(to_f32_kernel<T>, blocks_for(n, kThreads), kThreads, stream,
                         static_cast<const T*>(in), out, n);
  });
}

cudaError_t launch_gather_rows(const float* in, const std::int32_t* index, float* out,
                               std::int64_t rows, std::int64_t dim, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  return launch_kernel(gather_rows_kernel, static_cast<unsigned>(rows), kThreads, stream, in, index,
                       out, dim);
}

}  // namespace kvlab::cuda
