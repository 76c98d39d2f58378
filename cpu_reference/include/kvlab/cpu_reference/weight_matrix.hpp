#pragma once
// Weights as the CPU backend multiplies them: a (rows, cols) matrix whose values are stored in one
// of GGUF's formats — f32, f16, bf16, or the 32-value blocks Q8_0, Q4_0, Q4_1 — and multiplied
// in that format, widened to fp32 in registers or cache right before the FMAs: no fp32 copy of
// the matrix exists and every byte of it is read once per product. The math is the fp32
// reference's over the dequantized values (gguf_dequantize), only summed in another order;
// activations stay fp32 unless reduced-precision activations are chosen (ActivationFormat:
// llama.cpp's kinds of dot product). Matrices are stored row by row, or, once packed for their
// products at load (packed_for), in the layout their kernel reads.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/cpu_reference/weight_choices.hpp"

namespace kvlab::cpu {

// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1".
std::string_view weight_format_name(WeightFormat format);
// The format of GGUF tensor type `type`; nullopt for the types kvlab only dequantizes (Q4_K..).
std::optional<WeightFormat> weight_format_of_gguf_type(std::uint32_t type);
// Values per block (32 for the Q formats, 1 otherwise) and bytes per block.
std::int64_t weight_format_block_values(WeightFormat format);
std::int64_t weight_format_block_bytes(WeightFormat format);
// Bytes of one row of `cols` values (cols a multiple of the block values).
std::int64_t weight_row_bytes(WeightFormat format, std::int64_t cols);

// How a matrix's values are laid out: row by row (the file's order), interleaved for products
// with reduced-precision activations (src/interleaved.hpp), or in panels of 32 rows for products
// with fp32 activations (src/panels.hpp).
enum class WeightLayout : std::uint8_t { rows, interleaved, panels };

class WeightMatrix {
 public:
  WeightMatrix() = default;
  // Rounds `source` (rows, cols) to `format` as llama.cpp's quantize_row_*_ref does (f16/bf16:
  // round to nearest even). Throws kvlab::Error when cols is not a multiple of the block.
  static WeightMatrix quantize(const WeightMatrixView& source, WeightFormat format);
  static WeightMatrix quantize(const RowMatrix& source, WeightFormat format) {
    return quantize(matrix_view(source), format);
  }
  // Shares `source`'s storage, no copy (f32): `source` must outlive the result.
  static WeightMatrix view(const WeightMatrixView& source);
  static WeightMatrix view(const RowMatrix& source) { return view(matrix_view(source)); }
  // Rows already in `format`'s layout: rows * weight_row_bytes(format, cols) bytes, copied.
  static WeightMatrix from_bytes(WeightFormat format, std::int64_t rows, std::int64_t cols,
                                 std::span<const std::byte> bytes);
  // The rows of every part, in order (one format and column count; e.g. q; k; v).
  static WeightMatrix stack(std::span<const WeightMatrix> parts);
  // A Q4_0 or Q5_0 matrix (rows) as Q8_0, exactly: each block keeps its fp16 scale d and its
  // integers q - 8 or q - 16 (x = d (q - offset) in both). Throws kvlab::Error for another format.
  WeightMatrix widened_to_q8_0() const;

  WeightFormat format() const { return format_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  std::int64_t row_bytes() const { return weight_row_bytes(format_, cols_); }
  std::int64_t bytes() const;  // of the storage, in its layout
  // Row r's bytes (layout rows only: the other layouts do not store rows one after another; use
  // dequantize_rows).
  const std::byte* row(std::int64_t r) const { return data_ + r * row_bytes(); }
  const std::byte* data() const { return data_; }  // the storage, in its layout
  bool is_view() const { return data_ != nullptr && owned_ == nullptr; }  // of another's storage

  // The same values laid out once, at load, for products with `activations` (the row-major bytes
  // are not kept):
  //   q8 and a Q8_0/Q4_0/Q4_1 matrix, or bf16 and a bf16 matrix with an even number of column
  //     pairs: interleaved, 16 rows at a time, so that one AVX-512 VNNI (BF16) instruction sums
  //     4 (2) values for 16 outputs (src/interleaved.hpp); every product rounds its activations;
  //   otherwise an f32/f16/bf16 matrix: panels of 32 rows, (cols, 32) each, which the register
  //     tiles of the fp32-activation product read as they are (src/panels.hpp);
  //   otherwise (Q formats with fp32 activations) as it is: those kernels widen rows.
  // A matrix already packed is returned as it is.
  WeightMatrix packed_for(ActivationFormat activations) const;
  WeightLayout layout() const { return layout_; }
  bool interleaved() const { return layout_ == WeightLayout::interleaved; }

  // Rows [first, first + count) widened to fp32 into `out` (count, cols) row-major.
  void dequantize_rows(std::int64_t first, std::int64_t count, float* out) const;
  RowMatrix dequantize() const;  // (rows, cols)

 private:
  WeightFormat format_ = WeightFormat::f32;
  std::int64_t rows_ = 0, cols_ = 0;
  WeightLayout layout_ = WeightLayout::rows;
  std::shared_ptr<const std::vector<std::byte>> owned_;  // null for a view
  const std::byte* data_ = nullptr;
};

// y (+)= x w^T: x (M, K) fp32, w (N, K) in its format and layout, y (M, N). Threads split w's
// rows. Panels: register tiles of x read them in place (panel_matmul.cpp); interleaved: x rounded
// to 8-bit blocks or bf16 first (q8_matmul.cpp, bf16_matmul.cpp); rows: up to 4 rows of x, each
// weight row is widened in registers and used at once, more, each thread widens and transposes a
// panel of rows into cache and runs every row of x against it in register tiles (AVX2 + FMA +
// F16C, AVX-512 where compiled for it; Eigen dot products otherwise). weight_matmul.cpp.
void multiply_by_transposed(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y,
                            bool accumulate);

// The row counts of x at which multiply_by_transposed switches to another kernel for weights
// in `format` packed for fp32 activations (ascending): what a cost model's gemm regimes should
// start at (kvlab calibrate --backend cpu fits one efficiency per kernel).
std::vector<std::int64_t> gemm_kernel_switch_rows(WeightFormat format);

// The matrices of a LLaMA layer in a compute format (same stacking as LayerWeights).
struct LayerComputeWeights {
  WeightMatrix w_qkv;      // (q_dim + 2 kv_dim, dim)
  WeightMatrix wo;         // (dim, q_dim)
  WeightMatrix w_gate_up;  // (2 ffn, dim)
  WeightMatrix w_down;     // (dim, ffn)
};

// What CpuBackend multiplies with; norms and the embedding lookup stay in LlamaWeights (fp32).
struct ComputeWeights {
  std::string description;  // "f32", "q4_1", "gguf native (Q4_1, Q8_0)" ...
  ActivationFormat activations = ActivationFormat::f32;
  std::vector<LayerComputeWeights> layers;
  WeightMatrix output_projection;  // (vocab, dim)
  std::int64_t bytes() const;      // of every matrix above
};

// Views of the fp32 matrices (format f32: nothing copied) or a rounded copy in `format`, row by
// row; with_activations packs them for their products (a view becomes a packed copy).
ComputeWeights compute_weights(const ModelWeightsView& weights, WeightFormat format);
inline ComputeWeights compute_weights(const LlamaWeights& weights, WeightFormat format) {
  return compute_weights(weights_view(weights), format);
}

// The matrices of a GGUF file in their stored formats, no fp32 copy (Q and K rows put back in
// Hugging Face's order, as read_gguf_tensor does); a matrix stored in a type kvlab only
// dequantizes (Q4_K, Q6_K), a stack whose parts differ in type (but Q4_0 or Q5_0 parts beside
// Q8_0 ones, widened to Q8_0 exactly: widened_to_q8_0), or one whose K/V heads an attention
// variant converted, is multiplied in fp32 from `weights` (which must be this file's, converted
// or not), so the product is always the reference's. Throws kvlab::Error.
ComputeWeights gguf_compute_weights(const std::filesystem::path& gguf_path,
                                    const ModelWeightsView& weights);
inline ComputeWeights gguf_compute_weights(const std::filesystem::path& gguf_path,
                                           const LlamaWeights& weights) {
  return gguf_compute_weights(gguf_path, weights_view(weights));
}

// Every matrix of `weights` packed for its products with `activations` (WeightMatrix::packed_for);
// the description says how many were interleaved. Views of the reference's fp32 values become
// packed copies only while `memory_bytes` (default: allocatable_bytes()) holds twice their bytes
// (the values and the copies); otherwise they stay row-major views, multiplied by the row kernels
// (the same math, slower), and the description says so.
ComputeWeights with_activations(ComputeWeights weights, ActivationFormat activations,
                                std::optional<std::uint64_t> memory_bytes = std::nullopt);

// `format`: nullopt for as stored (gguf_compute_weights when `weights.source` is a .gguf file, f32
// otherwise: presets and safetensors folders are held in fp32); packed by with_activations.
ComputeWeights select_compute_weights(const ModelWeightsView& weights,
                                      std::optional<WeightFormat> format,
                                      ActivationFormat activations);
// The same by names: `choice` one of kWeightChoices ("stored" or a format), `activations` one
// of kActivationChoices. Throws kvlab::Error for another name.
ComputeWeights select_compute_weights(const ModelWeightsView& weights, std::string_view choice,
                                      std::string_view activations = "f32");
inline ComputeWeights select_compute_weights(const LlamaWeights& weights,
                                             const std::filesystem::path& source,
                                             std::string_view choice,
                                             std::string_view activations = "f32") {
  return select_compute_weights(weights_view(weights, source.string()), choice, activations);
}

}  // namespace kvlab::cpu
