#include <cuda_runtime.h>

#include "kvlab/cuda/rms_norm.hpp"

namespace kvlab::cuda {
namespace {

// One block per row. x, out: (rows, dim); weight: (dim).
__global__ void rms_norm_kernel(const float* x, const float* weight, float* out, int dim,
                                float eps) {
  const float* row = x + static_cast<long long>(blockIdx.x) * dim;
  float* out_row = out + static_cast<long long>(blockIdx.x) * dim;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffff, sum, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffff, sum, offset);
    if (threadIdx.x == 0) partial[0] = rsqrtf(sum / static_cast<float>(dim) + eps);
  }
  __syncthreads();
  const float inverse_rms = partial[0];
  for (int i = threadIdx.x; i < dim; i += blockDim.x) out_row[i] = row[i] * inverse_rms * weight[i];
}

}  // namespace

std::string rms_norm_host(const float* x, const float* weight, std::int64_t rows, std::int64_t dim,
                          float eps, float* out) {
  if (rows <= 0 || dim <= 0) return "rms_norm_host: rows and dim must be positive";
  float *d_x = nullptr, *d_weight = nullptr, *d_out = nullptr;
  const std::size_t bytes = static_cast<std::size_t>(rows * dim) * sizeof(float);
  const std::size_t weight_bytes = static_cast<std::size_t>(dim) * sizeof(float);
  cudaError_t status = cudaMalloc(&d_x, bytes);
  if (status == cudaSuccess) status = cudaMalloc(&d_out, bytes);
  if (status == cudaSuccess) status = cudaMalloc(&d_weight, weight_bytes);
  if (status == cudaSuccess) status = cudaMemcpy(d_x, x, bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess)
    status = cudaMemcpy(d_weight, weight, weight_bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess) {
    rms_norm_kernel<<<static_cast<unsigned>(rows), 256>>>(d_x, d_weight, d_out,
                                                          static_cast<int>(dim), eps);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = cudaMemcpy(out, d_out, bytes, cudaMemcpyDeviceToHost);
  cudaFree(d_x);
  cudaFree(d_out);
  cudaFree(d_weight);
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}

}  // namespace kvlab::cuda
