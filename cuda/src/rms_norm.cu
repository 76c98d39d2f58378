#include <cuda_runtime_api.h>

#include "kvlab/cuda/kernels.hpp"
#include "kvlab/cuda/rms_norm.hpp"

namespace kvlab::cuda {

std::string rms_norm_host(const float* x, const float* weight, std::int64_t rows, std::int64_t dim,
                          float eps, float* out) {
  if (rows <= 0 || dim <= 0) return "rms_norm_host: rows and dim must be positive";
  void *d_x = nullptr, *d_weight = nullptr, *d_out = nullptr;
  const std::size_t bytes = static_cast<std::size_t>(rows * dim) * sizeof(float);
  const std::size_t weight_bytes = static_cast<std::size_t>(dim) * sizeof(float);
  cudaError_t status = cudaMalloc(&d_x, bytes);
  if (status == cudaSuccess) status = cudaMalloc(&d_out, bytes);
  if (status == cudaSuccess) status = cudaMalloc(&d_weight, weight_bytes);
  if (status == cudaSuccess) status = cudaMemcpy(d_x, x, bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess)
    status = cudaMemcpy(d_weight, weight, weight_bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess)  // the backend's kernel, fp32 in and out
    status =
        launch_rms_norm({static_cast<const float*>(d_x), dim, static_cast<const float*>(d_weight),
                         d_out, rows, dim, eps, Dtype::f32},
                        nullptr);
  if (status == cudaSuccess) status = cudaMemcpy(out, d_out, bytes, cudaMemcpyDeviceToHost);
  cudaFree(d_x);
  cudaFree(d_out);
  cudaFree(d_weight);
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}

}  // namespace kvlab::cuda
