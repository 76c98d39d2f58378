// The cuBLAS subset the cuda backend calls (handle, stream, workspace, GemmEx), on the CPU for
// the emulated build (a GemmEx inside a stream capture is recorded for the graph): column-major C =
// alpha op(A) op(B) + beta C with fp32 accumulation, inputs and outputs fp32 or bf16 (outputs
// rounded to nearest even), like CUBLAS_COMPUTE_32F.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "kvlab/cuda/emulated_capture.hpp"

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

bool supported(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16BF;
}

float element(const void* data, cudaDataType type, std::int64_t index) {
  return type == CUDA_R_32F ? static_cast<const float*>(data)[index]
                            : __bfloat162float(static_cast<const __nv_bfloat16*>(data)[index]);
}

// op(X) as a rows x cols fp32 matrix; X column-major with leading dimension ld.
Matrix operand(const void* data, cudaDataType type, int ld, cublasOperation_t op, int rows,
               int cols) {
  Matrix out(rows, cols);
  for (int c = 0; c < cols; ++c)
    for (int r = 0; r < rows; ++r)
      out(r, c) = op == CUBLAS_OP_N ? element(data, type, std::int64_t{c} * ld + r)
                                    : element(data, type, std::int64_t{r} * ld + c);
  return out;
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void*, size_t) {
  return handle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (computeType != CUBLAS_COMPUTE_32F || !supported(Atype) || !supported(Btype) ||
      !supported(Ctype) || (transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m < 0 || n < 0 || k < 0 || ldc < std::max(1, m) ||
      lda < std::max(1, transa == CUBLAS_OP_N ? m : k) ||
      ldb < std::max(1, transb == CUBLAS_OP_N ? k : n))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
  auto multiply = [=] {
    Matrix product =
        a * (operand(A, Atype, lda, transa, m, k) * operand(B, Btype, ldb, transb, k, n));
    for (int c = 0; c < n; ++c)
      for (int r = 0; r < m; ++r) {
        const std::int64_t index = std::int64_t{c} * ldc + r;
        float value = product(r, c);
        if (b != 0.0f) value += b * element(C, Ctype, index);
        if (Ctype == CUDA_R_32F)
          static_cast<float*>(C)[index] = value;
        else
          static_cast<__nv_bfloat16*>(C)[index] = __float2bfloat16(value);
      }
  };
  if (!kvlab::cuda::emulation::record(multiply)) multiply();
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
