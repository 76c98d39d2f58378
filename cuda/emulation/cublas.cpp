// The cuBLAS and cuBLASLt subsets the cuda backend calls (handle, stream, workspace, GemmEx;
// Lt's handle, matmul and layout descriptors, preference, heuristic and matmul), on the CPU for
// the emulated build (a GEMM inside a stream capture is recorded for the graph): column-major C =
// alpha op(A) op(B) + beta C with fp32 accumulation, inputs and outputs fp32 or bf16 (outputs
// rounded to nearest even), like CUBLAS_COMPUTE_32F.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>

#include "kvlab/cuda/emulated_capture.hpp"

struct cublasContext {
  cudaStream_t stream = nullptr;
};
struct cublasLtContext {};

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

// C = alpha op(A) op(B) + beta C, column-major (cublasGemmEx's arguments).
struct GemmCall {
  cublasOperation_t transa, transb;
  int m, n, k;
  float alpha;
  const void* A;
  cudaDataType Atype;
  int lda;
  const void* B;
  cudaDataType Btype;
  int ldb;
  float beta;
  void* C;
  cudaDataType Ctype;
  int ldc;
  cublasComputeType_t compute;
};

// The types and operations the emulator implements (what kvlab calls).
bool supported_call(const GemmCall& g) {
  const auto op_ok = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; };
  return g.compute == CUBLAS_COMPUTE_32F && supported(g.Atype) && supported(g.Btype) &&
         supported(g.Ctype) && op_ok(g.transa) && op_ok(g.transb);
}

// Sizes and leading dimensions as cuBLAS checks them.
bool valid_dimensions(const GemmCall& g) {
  return g.m >= 0 && g.n >= 0 && g.k >= 0 && g.ldc >= std::max(1, g.m) &&
         g.lda >= std::max(1, g.transa == CUBLAS_OP_N ? g.m : g.k) &&
         g.ldb >= std::max(1, g.transb == CUBLAS_OP_N ? g.k : g.n);
}

// C = alpha op(A) op(B) + beta C, in fp32, stored in C's type.
void multiply(const GemmCall& g) {
  const Matrix product = g.alpha * (operand(g.A, g.Atype, g.lda, g.transa, g.m, g.k) *
                                    operand(g.B, g.Btype, g.ldb, g.transb, g.k, g.n));
  for (int c = 0; c < g.n; ++c)
    for (int r = 0; r < g.m; ++r) {
      const std::int64_t index = std::int64_t{c} * g.ldc + r;
      float value = product(r, c);
      if (g.beta != 0.0f) value += g.beta * element(g.C, g.Ctype, index);
      if (g.Ctype == CUDA_R_32F)
        static_cast<float*>(g.C)[index] = value;
      else
        static_cast<__nv_bfloat16*>(g.C)[index] = __float2bfloat16(value);
    }
}

// Checks the call, then runs it now or records it for the graph being captured.
cublasStatus_t gemm(const GemmCall& g) {
  if (!supported_call(g)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!valid_dimensions(g)) return CUBLAS_STATUS_INVALID_VALUE;
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;
  const auto run = [g] { multiply(g); };
  if (!kvlab::cuda::emulation::record(run)) run();
  return CUBLAS_STATUS_SUCCESS;
}

// What the emulated cuBLASLt descriptors hold, in their opaque storage.
struct MatmulSettings {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t trans_a, trans_b;
};
struct LayoutSettings {
  cudaDataType type;
  int rows, cols, ld;
};
template <typename Opaque, typename Settings>
void store(Opaque* opaque, const Settings& settings) {
  static_assert(sizeof(Settings) <= sizeof(Opaque));
  std::memcpy(opaque->data, &settings, sizeof settings);
}
template <typename Settings, typename Opaque>
Settings load(const Opaque* opaque) {
  Settings settings;
  std::memcpy(&settings, opaque->data, sizeof settings);
  return settings;
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
  return gemm({transa, transb, m, n, k, *static_cast<const float*>(alpha), A, Atype, lda, B, Btype,
               ldb, *static_cast<const float*>(beta), C, Ctype, ldc, computeType});
}

// ---- cuBLASLt: descriptors keep their settings in the opaque storage cublasLt.h gives them --
cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  *handle = new cublasLtContext();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  *desc = new cublasLtMatmulDescOpaque_t{};
  store(*desc, MatmulSettings{compute, scale, CUBLAS_OP_N, CUBLAS_OP_N});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attribute,
                                              const void* value, size_t bytes) {
  MatmulSettings settings = load<MatmulSettings>(desc);
  if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
  if (attribute == CUBLASLT_MATMUL_DESC_TRANSA)
    std::memcpy(&settings.trans_a, value, bytes);
  else if (attribute == CUBLASLT_MATMUL_DESC_TRANSB)
    std::memcpy(&settings.trans_b, value, bytes);
  else
    return CUBLAS_STATUS_NOT_SUPPORTED;
  store(desc, settings);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  *layout = new cublasLtMatrixLayoutOpaque_t{};
  store(*layout,
        LayoutSettings{type, static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(ld)});
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attribute,
                                                const void* value, size_t bytes) {
  LayoutSettings settings = load<LayoutSettings>(layout);
  std::uint64_t extent = 0;
  if (bytes != sizeof extent) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&extent, value, bytes);
  if (attribute == CUBLASLT_MATRIX_LAYOUT_ROWS)
    settings.rows = static_cast<int>(extent);
  else if (attribute == CUBLASLT_MATRIX_LAYOUT_COLS)
    settings.cols = static_cast<int>(extent);
  else
    return CUBLAS_STATUS_NOT_SUPPORTED;
  store(layout, settings);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference) {
  *preference = new cublasLtMatmulPreferenceOpaque_t{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference) {
  delete preference;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t,
                                                    cublasLtMatmulPreferenceAttributes_t,
                                                    const void*, size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
// One "algorithm" for every shape the GEMM subset supports.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const auto settings = load<MatmulSettings>(desc);
  const auto la = load<LayoutSettings>(a), lb = load<LayoutSettings>(b),
             ld = load<LayoutSettings>(d);
  *returned = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  if (settings.compute != CUBLAS_COMPUTE_32F || !supported(la.type) || !supported(lb.type) ||
      !supported(ld.type))
    return CUBLAS_STATUS_SUCCESS;  // found none
  results[0] = cublasLtMatmulHeuristicResult_t{};
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}
// D = alpha op(A) op(B) + beta C, with C and D the same matrix (what the backend asks).
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t a, const void* B,
                              cublasLtMatrixLayout_t b, const void* beta, const void* C,
                              cublasLtMatrixLayout_t, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (C != D) return CUBLAS_STATUS_NOT_SUPPORTED;
  const auto settings = load<MatmulSettings>(desc);
  const auto la = load<LayoutSettings>(a), lb = load<LayoutSettings>(b),
             ld = load<LayoutSettings>(d);
  const int k = settings.trans_a == CUBLAS_OP_N ? la.cols : la.rows;
  return gemm({settings.trans_a, settings.trans_b, ld.rows, ld.cols, k,
               *static_cast<const float*>(alpha), A, la.type, la.ld, B, lb.type, lb.ld,
               *static_cast<const float*>(beta), D, ld.type, ld.ld, settings.compute});
}

}  // extern "C"
