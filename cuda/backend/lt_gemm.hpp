#pragma once
// The backend's GEMMs on cuBLASLt: Y (rows, out) = X (rows, in) W^T with W (out, in) row-major,
// operands fp32 or bf16, fp32 accumulation (CUBLAS_COMPUTE_32F), Y fp32 or bf16. In cuBLAS's
// column-major terms Y^T (out x rows) = op_T(W) X^T: A = W as an (in x out) matrix transposed,
// B = X^T (in x rows), D = Y^T (out x rows). One plan per shape (descriptors and the
// heuristic's first algorithm for the workspace init() was given), made on first use and kept: a
// decode step of a given batch size always runs the same kernel, inside a CUDA graph or not.
// Beyond 512 rows (prefills and the mixed steps of continuous batching, whose row count is new
// almost every step) rows share the plan of their multiple of 128 (plan_rows), run with the
// step's own row count: on an H200 a mixed step whose row count was new cost 1.23x its price
// against 1.12x on a repeat, the heuristic's query per new shape. If the shared plan's
// algorithm refuses the rows, the shape gets a plan of its own.
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace kvlab::cuda {

class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm() {
    for (auto& [key, plan] : plans_) destroy(plan);
    if (handle_ != nullptr) cublasLtDestroy(handle_);
  }

  // Makes the cuBLASLt handle (before any capture: the first GEMM may be inside one) and keeps
  // the device workspace every matmul may use.
  cublasStatus_t init(void* workspace, std::size_t workspace_bytes) {
    workspace_ = workspace;
    workspace_bytes_ = workspace_bytes;
    return handle_ != nullptr ? CUBLAS_STATUS_SUCCESS : cublasLtCreate(&handle_);
  }

  struct Shape {
    std::int64_t rows = 0, in = 0, out = 0;
    cudaDataType_t operands = CUDA_R_32F, result = CUDA_R_32F;
  };

  // Enqueues Y = X W^T on `stream` (after init()). CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt
  // offers no algorithm for the shape (the caller may fall back to cublasGemmEx).
  cublasStatus_t run(const Shape& s, const void* x, const void* w, void* y, cudaStream_t stream) {
    if (handle_ == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    const std::int64_t shared_rows = plan_rows(s.rows);
    Plan& p = plan(s, shared_rows);
    if (p.status != CUBLAS_STATUS_SUCCESS) return p.status;
    if (s.rows <= 512) return matmul(p, x, w, y, stream);  // a plan of its own
    // A shared plan takes this call's rows (the last call may have set others).
    if (const cublasStatus_t set = set_rows(p, s.rows); set != CUBLAS_STATUS_SUCCESS) return set;
    const cublasStatus_t status = matmul(p, x, w, y, stream);
    if (status == CUBLAS_STATUS_SUCCESS || shared_rows == s.rows) return status;
    // The bucket's algorithm refused these rows (cuBLASLt checks at enqueue): a plan of their own.
    Plan& own = plan(s, s.rows);
    return own.status != CUBLAS_STATUS_SUCCESS ? own.status : matmul(own, x, w, y, stream);
  }

  // The rows a shape's plan is made for: its own up to 512, else the multiple of 128 above.
  static std::int64_t plan_rows(std::int64_t rows) {
    return rows <= 512 ? rows : (rows + 127) / 128 * 128;
  }
  std::size_t plan_count() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    cublasStatus_t status = CUBLAS_STATUS_NOT_INITIALIZED;
  };

  Plan& plan(Shape s, std::int64_t rows) {
    s.rows = rows;
    const auto key = std::tuple{s.rows, s.in, s.out, s.operands, s.result};
    auto found = plans_.find(key);
    if (found == plans_.end()) found = plans_.emplace(key, make_plan(s)).first;
    return found->second;
  }

  // A shared plan's B (in x rows) and D (out x rows) take this call's rows.
  static cublasStatus_t set_rows(Plan& p, std::int64_t rows) {
    const auto columns = static_cast<std::uint64_t>(rows);
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    for (cublasLtMatrixLayout_t layout : {p.b, p.d})
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_COLS, &columns,
                                                  sizeof columns);
    return status;
  }

  cublasStatus_t matmul(const Plan& p, const void* x, const void* w, void* y, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.d, y, p.d, &p.algo,
                          workspace_, workspace_bytes_, stream);
  }

  Plan make_plan(const Shape& s) {
    Plan p;
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    const auto in = static_cast<std::uint64_t>(s.in), out = static_cast<std::uint64_t>(s.out),
               rows = static_cast<std::uint64_t>(s.rows);
    if ((p.status = cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        (p.status = cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                   sizeof transpose)) ||
        (p.status = cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep,
                                                   sizeof keep)) ||
        (p.status = cublasLtMatrixLayoutCreate(&p.a, s.operands, in, out, s.in)) ||
        (p.status = cublasLtMatrixLayoutCreate(&p.b, s.operands, in, rows, s.in)) ||
        (p.status = cublasLtMatrixLayoutCreate(&p.d, s.result, out, rows, s.out)))
      return p;
    cublasLtMatmulPreference_t preference = nullptr;
    if ((p.status = cublasLtMatmulPreferenceCreate(&preference))) return p;
    p.status =
        cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes_, sizeof workspace_bytes_);
    cublasLtMatmulHeuristicResult_t best{};
    int found = 0;
    if (p.status == CUBLAS_STATUS_SUCCESS)
      p.status = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, preference, 1,
                                                &best, &found);
    cublasLtMatmulPreferenceDestroy(preference);
    if (p.status == CUBLAS_STATUS_SUCCESS && found == 0) p.status = CUBLAS_STATUS_NOT_SUPPORTED;
    if (p.status == CUBLAS_STATUS_SUCCESS) p.algo = best.algo;
    return p;
  }

  static void destroy(Plan& p) {
    if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
    for (cublasLtMatrixLayout_t layout : {p.a, p.b, p.d})
      if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, cudaDataType_t, cudaDataType_t>,
           Plan>
      plans_;
};

}  // namespace kvlab::cuda
