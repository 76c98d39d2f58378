// Embedding gather, RMSNorm, RoPE, SwiGLU, residual add, K/V write, conversions.
#include "common.cuh"

namespace kvlab::cuda {
namespace {

constexpr int kThreads = 256;

// out (rows, dim) fp32 = table[tokens[r]]
template <typename T>
__global__ void embedding_kernel(EmbeddingParams p) {
  const std::int64_t row = blockIdx.x;
  const std::int32_t token = p.tokens[row];
  const T* source = static_cast<const T*>(p.table) + static_cast<std::int64_t>(token) * p.dim;
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x)
    p.out[row * p.dim + i] = to_float(source[i]);
}

// One block per row: out = x * rsqrt(mean(x^2) + eps) * weight.
template <typename T>
__global__ void rms_norm_kernel(RmsNormParams p) {
  const float* x = p.x + static_cast<std::int64_t>(blockIdx.x) * p.x_row_stride;
  T* out = static_cast<T*>(p.out) + static_cast<std::int64_t>(blockIdx.x) * p.dim;
  float sum = 0.0f;
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) sum += x[i] * x[i];
  __shared__ float partial[kThreads / 32];
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    sum = warp_sum(sum);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / static_cast<float>(p.dim) + p.eps);
  }
  __syncthreads();
  const float inverse_rms = partial[0];
  for (std::int64_t i = threadIdx.x; i < p.dim; i += blockDim.x)
    out[i] = from_float<T>(x[i] * inverse_rms * p.weight[i]);
}

// One thread per (row, head, i < head_dim / 2).
template <typename T>
__global__ void rope_kernel(RopeParams p) {
  const std::int64_t half = p.head_dim / 2;
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= p.rows * p.heads * half) return;
  const std::int64_t i = index % half, head = (index / half) % p.heads,
                     row = index / (half * p.heads);
  const std::int64_t position = p.positions[row];
  const float c = p.cos[position * half + i], s = p.sin[position * half + i];
  T* x = static_cast<T*>(p.x) + row * p.row_stride + head * p.head_dim;
  const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
  x[i] = from_float<T>(x1 * c - x2 * s);
  x[i + half] = from_float<T>(x2 * c + x1 * s);
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

// One block per row.
template <typename T>
__global__ void kv_write_kernel(KvWriteParams p) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t slot = p.slots[row];
  const T* k = static_cast<const T*>(p.k) + row * p.row_stride;
  const T* v = static_cast<const T*>(p.v) + row * p.row_stride;
  T* k_out = static_cast<T*>(p.k_pool) + slot * p.kv_dim;
  T* v_out = static_cast<T*>(p.v_pool) + slot * p.kv_dim;
  for (std::int64_t i = threadIdx.x; i < p.kv_dim; i += blockDim.x) {
    k_out[i] = k[i];
    v_out[i] = v[i];
  }
}

// One block per (slot i, layer x K/V).
template <typename T>
__global__ void slot_rows_kernel(SlotRowsParams p) {
  const std::int64_t i = blockIdx.x, layer_kv = blockIdx.y;
  T* pool = static_cast<T*>(layer_kv % 2 == 0 ? p.k_pool : p.v_pool) +
            (layer_kv / 2) * p.layer_elements + p.slots[i] * p.kv_dim;
  T* packed = static_cast<T*>(p.packed) + (layer_kv * p.count + i) * p.kv_dim;
  for (std::int64_t d = threadIdx.x; d < p.kv_dim; d += blockDim.x) {
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

cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  const std::int64_t n = p.rows * p.heads * (p.head_dim / 2);
  if (n <= 0) return cudaSuccess;
  if (p.head_dim % 2 != 0) return cudaErrorInvalidValue;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(rope_kernel<T>, blocks_for(n, kThreads), kThreads, stream, p);
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

cudaError_t launch_kv_write(const KvWriteParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    return launch_kernel(kv_write_kernel<T>, static_cast<unsigned>(p.rows), 128, stream, p);
  });
}

cudaError_t launch_copy_slot_rows(const SlotRowsParams& p, cudaStream_t stream) {
  if (p.count <= 0 || p.layers <= 0) return cudaSuccess;
  if (p.layers * 2 > 65535 || p.kv_dim <= 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.count), static_cast<unsigned>(p.layers * 2));
  KVLAB_DISPATCH_DTYPE(p.dtype, T,
                       { return launch_kernel(slot_rows_kernel<T>, grid, 128, stream, p); });
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
