// Weights multiplied in their stored format (f16, bf16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the
// rounding matches
// llama.cpp's reference quantizers within their stated error, the product equals the fp32
// product over the dequantized values (only the summation order differs), and the CPU backend
// fed such weights computes the reference's logits over the same dequantized values.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

constexpr WeightFormat kAllFormats[] = {WeightFormat::f32,  WeightFormat::f16,  WeightFormat::bf16,
                                        WeightFormat::q8_0, WeightFormat::q4_0, WeightFormat::q4_1,
                                        WeightFormat::q5_0, WeightFormat::q5_1};
constexpr WeightFormat kQFormats[] = {WeightFormat::q8_0, WeightFormat::q4_0, WeightFormat::q4_1,
                                      WeightFormat::q5_0, WeightFormat::q5_1};

RowMatrix random_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed,
                        float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  RowMatrix m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

TEST(WeightFormat, NamesRoundTripAndGgufTypesMap) {
  for (WeightFormat f : kAllFormats) EXPECT_EQ(weight_format_from_name(weight_format_name(f)), f);
  EXPECT_FALSE(weight_format_from_name("q4_k"));
  EXPECT_EQ(weight_format_of_gguf_type(3), WeightFormat::q4_1);  // GGML_TYPE_Q4_1
  EXPECT_EQ(weight_format_of_gguf_type(30), WeightFormat::bf16);
  EXPECT_EQ(weight_format_of_gguf_type(6), WeightFormat::q5_0);  // GGML_TYPE_Q5_0
  EXPECT_EQ(weight_format_of_gguf_type(7), WeightFormat::q5_1);
  EXPECT_EQ(weight_row_bytes(WeightFormat::q5_0, 640), 20 * 22);
  EXPECT_EQ(weight_row_bytes(WeightFormat::q5_1, 64), 2 * 24);
  EXPECT_FALSE(weight_format_of_gguf_type(12));  // Q4_K: dequantized only
  EXPECT_EQ(weight_row_bytes(WeightFormat::q4_1, 576), 18 * 20);
  EXPECT_EQ(weight_row_bytes(WeightFormat::q8_0, 64), 2 * 34);
}

// Each Q block's error is bounded by half a quantization step (plus the f16 rounding of the
// scale and minimum): the bound llama.cpp's reference quantizers give. Q4_0 (Q5_0) maps the
// block's largest magnitude to -8 (-16) steps, so a value of the opposite sign and equal size
// would be +8 (+16), clipped to +7 (+15): up to one whole step there.
TEST(WeightMatrix, RoundingStaysWithinHalfAStep) {
  const RowMatrix source = random_matrix(8, 256, 1);
  for (WeightFormat f : kAllFormats) {
    const RowMatrix back = WeightMatrix::quantize(source, f).dequantize();
    for (Eigen::Index r = 0; r < source.rows(); ++r)
      for (Eigen::Index b = 0; b < source.cols() / 32; ++b) {
        const auto block = source.row(r).segment(b * 32, 32);
        const float amax = block.cwiseAbs().maxCoeff(), range = block.maxCoeff() - block.minCoeff();
        const float step = f == WeightFormat::q8_0   ? amax / 127
                           : f == WeightFormat::q4_0 ? amax / 8
                           : f == WeightFormat::q4_1 ? range / 15
                           : f == WeightFormat::q5_0 ? amax / 16
                           : f == WeightFormat::q5_1 ? range / 31
                                                     : 0.0f;
        const float relative = f == WeightFormat::f16    ? 0x1p-11f
                               : f == WeightFormat::bf16 ? 0x1p-8f
                                                         : 0.0f;
        for (Eigen::Index k = 0; k < 32; ++k) {
          const float x = block(k), error = std::abs(back(r, b * 32 + k) - x);
          const bool q5 = f == WeightFormat::q5_0 || f == WeightFormat::q5_1;
          const float max_q = f == WeightFormat::q8_0 ? 127.0f
                              : q5                    ? 32.0f
                                                      : 16.0f;  // |q| times the f16 scale error
          const float steps = f == WeightFormat::q4_0 || f == WeightFormat::q5_0 ? 1.0f : 0.5f;
          const bool with_min = f == WeightFormat::q4_1 || f == WeightFormat::q5_1;
          const float bound = steps * step + max_q * step * 0x1p-11f + amax * 0x1p-11f * with_min +
                              relative * std::abs(x) +
                              0x1p-25f * (f == WeightFormat::f16);  // f16 subnormals
          ASSERT_LE(error, bound) << weight_format_name(f) << " row " << r << " col " << b * 32 + k;
        }
      }
  }
}

TEST(WeightMatrix, ExactValuesSurviveEveryFormat) {
  // Integers 0..15 times 0.25 are exact in f16, bf16 and, with a range of 15 steps, Q4_1;
  // Q8_0 keeps zero exactly and the maximum up to its f16 scale.
  RowMatrix source(1, 32);
  for (int k = 0; k < 32; ++k) source(0, k) = 0.25f * static_cast<float>(k % 16);
  for (WeightFormat f : {WeightFormat::f16, WeightFormat::bf16, WeightFormat::q4_1})
    EXPECT_EQ(WeightMatrix::quantize(source, f).dequantize(), source) << weight_format_name(f);
  // 0..31 times 0.25 (a range of 31 steps) is exact in Q5_1, which needs the fifth bits.
  RowMatrix five_bits(1, 32);
  for (int k = 0; k < 32; ++k) five_bits(0, k) = 0.25f * static_cast<float>((k * 7) % 32);
  EXPECT_EQ(WeightMatrix::quantize(five_bits, WeightFormat::q5_1).dequantize(), five_bits);
  const RowMatrix q8 = WeightMatrix::quantize(source, WeightFormat::q8_0).dequantize();
  EXPECT_NEAR(q8(0, 15), 3.75f, 3.75f * 0x1p-11f);
  EXPECT_EQ(q8(0, 0), 0.0f);
}

// Byte for byte what llama.cpp's reference quantizers make of the same fp32 rows (gguf-py's port,
// tests/fixtures/gguf/make_quantize_fixture.py): zero blocks, skewed ranges and large values.
TEST(WeightMatrix, RoundingIsLlamaCppsByteForByte) {
  const auto fixture = nlohmann::json::parse(test::read_file(
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "quantize_reference.json"));
  const auto values = fixture["values"].get<std::vector<std::vector<float>>>();
  RowMatrix source(static_cast<Eigen::Index>(values.size()),
                   static_cast<Eigen::Index>(values[0].size()));
  for (Eigen::Index r = 0; r < source.rows(); ++r)
    for (Eigen::Index c = 0; c < source.cols(); ++c)
      source(r, c) = values[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)];
  for (const auto& [name, rows] : fixture["bytes"].items()) {
    const WeightMatrix m = WeightMatrix::quantize(source, *weight_format_from_name(name));
    for (Eigen::Index r = 0; r < source.rows(); ++r) {
      std::string hex;
      for (std::int64_t b = 0; b < m.row_bytes(); ++b)
        hex += fmt::format("{:02x}", std::to_integer<int>(m.row(r)[b]));
      EXPECT_EQ(hex, rows[static_cast<std::size_t>(r)].get<std::string>()) << name << " row " << r;
    }
  }
}

TEST(WeightMatrix, BadShapesAreClearErrors) {
  test::expect_error_containing(
      [] { WeightMatrix::quantize(RowMatrix::Zero(2, 40), WeightFormat::q4_0); },
      {"q4_0", "multiple of 32", "40"});
  test::expect_error_containing(
      [] {
        std::vector<std::byte> bytes(10);
        WeightMatrix::from_bytes(WeightFormat::q8_0, 1, 32, bytes);
      },
      {"10 bytes", "q8_0"});
}

// x w^T with w in its format equals x (dequantized w)^T in fp32, for w row by row and packed for
// fp32 activations (panels for f32/f16/bf16), for every tile edge: no rows of x, rows around the
// fused, AVX2 (6) and AVX-512 (8) register tiles, outputs around the 4-row tile, the 16-wide half
// panel and the 32-row panel, depths with and without an 8-wide tail (f32/f16/bf16 only: Q rows are
// whole blocks), rows a multiple of 4 KiB apart (copied to a padded buffer before the
// transposes), and for f16/bf16 panels against several tiles, larger batches (137 rows: 18 and
// 23 tiles) and a depth of 160.
TEST(WeightMatrix, ProductEqualsTheFp32ProductOfTheDequantizedValues) {
  for (WeightFormat f : kAllFormats)
    for (std::int64_t depth : {32, 96, 44, 160, 1024})  // 1024: rows 4 KiB apart (L1 aliasing)
      for (std::int64_t outputs : {1, 7, 16, 37, 48})
        for (std::int64_t rows : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 65, 137})
          for (bool packed : {false, true}) {
            if (depth % weight_format_block_values(f) != 0) continue;
            const WeightMatrix rows_layout =
                WeightMatrix::quantize(random_matrix(outputs, depth, 2, 0.1f), f);
            const WeightMatrix w =
                packed ? rows_layout.packed_for(ActivationFormat::f32) : rows_layout;
            const RowMatrix x = random_matrix(rows, depth, 3);
            const RowMatrix dense = w.dequantize();
            const RowMatrix expected = x * dense.transpose();
            // |error| <= depth * eps * sum |x_k w_k|: fp32 sums in any order.
            const RowMatrix bound = (x.cwiseAbs() * dense.cwiseAbs().transpose()) *
                                    (static_cast<float>(depth) * 1.2e-7f);
            RowMatrix y;
            multiply_by_transposed(x, w, y, false);
            RowMatrix accumulated = RowMatrix::Ones(rows, outputs);
            multiply_by_transposed(x, w, accumulated, true);
            for (Eigen::Index i = 0; i < expected.rows(); ++i)
              for (Eigen::Index j = 0; j < expected.cols(); ++j) {
                ASSERT_LE(std::abs(y(i, j) - expected(i, j)), bound(i, j) + 1e-6f)
                    << weight_format_name(f) << (packed ? " packed" : "") << " rows " << rows
                    << " outputs " << outputs << " depth " << depth << " at " << i << "," << j;
                ASSERT_NEAR(accumulated(i, j), 1.0f + expected(i, j), bound(i, j) + 1e-5f);
              }
          }
}

// Q rows stored as in a GGUF file (fp32 activations): a product of up to 8 rows of x gives each
// row the very bits of that row's product alone. A speculative verify entry (the newest token and
// up to 7 proposals) then scores each position exactly as decoding it would, so greedy
// speculation cannot flip a near-tie. Exact equality, no tolerance; depth 576 is SmolLM2's.
TEST(WeightMatrix, AQProductOfUpTo8RowsGivesEachRowItsOwnBits) {
  for (WeightFormat f : kQFormats) {
    const WeightMatrix w = WeightMatrix::quantize(random_matrix(37, 576, 4, 0.1f), f);
    for (std::int64_t rows = 1; rows <= 8; ++rows) {
      const RowMatrix x = random_matrix(rows, 576, 5);
      RowMatrix together;
      multiply_by_transposed(x, w, together, false);
      for (std::int64_t i = 0; i < rows; ++i) {
        RowMatrix alone;
        multiply_by_transposed(x.row(i), w, alone, false);
        for (Eigen::Index j = 0; j < alone.cols(); ++j)
          ASSERT_EQ(together(i, j), alone(0, j))
              << weight_format_name(f) << " rows " << rows << " row " << i << " output " << j;
      }
    }
  }
}

// The formats each reduced-precision activation format applies to.
struct Interleaving {
  WeightFormat weights;
  ActivationFormat activations;
};
constexpr Interleaving kInterleavings[] = {{WeightFormat::q8_0, ActivationFormat::q8},
                                           {WeightFormat::q4_0, ActivationFormat::q8},
                                           {WeightFormat::q4_1, ActivationFormat::q8},
                                           {WeightFormat::bf16, ActivationFormat::bf16}};

TEST(WeightMatrix, InterleavedKeepsEveryValueAndItsBytes) {
  const RowMatrix source = random_matrix(37, 96, 8);  // 37 rows: the last group of 16 is padded
  for (const auto [f, activations] : kInterleavings) {
    const WeightMatrix rows = WeightMatrix::quantize(source, f);
    const WeightMatrix interleaved = rows.packed_for(activations);
    ASSERT_TRUE(interleaved.interleaved());
    EXPECT_EQ(interleaved.dequantize(), rows.dequantize()) << weight_format_name(f);
    // The bytes of the row-major blocks over 48 rows; Q8_0 adds a 2-byte sum per block.
    const std::int64_t per_block = f == WeightFormat::q8_0 ? 36 : weight_format_block_bytes(f);
    EXPECT_EQ(interleaved.bytes(), 48 * 96 / weight_format_block_values(f) * per_block)
        << weight_format_name(f);
  }
  const WeightMatrix f16 = WeightMatrix::quantize(source, WeightFormat::f16);
  const WeightMatrix q4 = WeightMatrix::quantize(source, WeightFormat::q4_0);
  for (auto a : {ActivationFormat::f32, ActivationFormat::q8, ActivationFormat::bf16})
    EXPECT_EQ(f16.packed_for(a).layout(), WeightLayout::panels);  // no reduced-precision kernel
  EXPECT_EQ(q4.packed_for(ActivationFormat::bf16).layout(), WeightLayout::rows);
  EXPECT_EQ(q4.packed_for(ActivationFormat::f32).layout(), WeightLayout::rows);
  for (WeightFormat f : {WeightFormat::q5_0, WeightFormat::q5_1})  // no 8-bit kernel: fp32 x
    EXPECT_EQ(WeightMatrix::quantize(source, f).packed_for(ActivationFormat::q8).layout(),
              WeightLayout::rows);
}

// Panels (f32/f16/bf16 with fp32 activations) keep every value; 37 rows take two panels of 32
// (the second padded with zero rows); packing twice changes nothing; a packed matrix is not
// stacked (stacks are made from rows).
TEST(WeightMatrix, PanelsKeepEveryValueAndTheirBytes) {
  const RowMatrix source = random_matrix(37, 44, 9);
  for (WeightFormat f : {WeightFormat::f32, WeightFormat::f16, WeightFormat::bf16}) {
    const WeightMatrix rows = WeightMatrix::quantize(source, f);
    const WeightMatrix panels = rows.packed_for(ActivationFormat::f32);
    ASSERT_EQ(panels.layout(), WeightLayout::panels);
    EXPECT_EQ(panels.dequantize(), rows.dequantize()) << weight_format_name(f);
    EXPECT_EQ(panels.bytes(), 64 * 44 * (f == WeightFormat::f32 ? 4 : 2)) << weight_format_name(f);
    EXPECT_EQ(panels.packed_for(ActivationFormat::f32).data(), panels.data());
    RowMatrix middle(5, 44);
    panels.dequantize_rows(30, 5, middle.data());  // across the panel boundary
    EXPECT_EQ(middle, rows.dequantize().middleRows(30, 5)) << weight_format_name(f);
    test::expect_error_containing(
        [&] {
          WeightMatrix::stack(std::vector<WeightMatrix>{rows, panels});
        },
        {"internal"});
  }
  const WeightMatrix view = WeightMatrix::view(source);
  EXPECT_EQ(view.packed_for(ActivationFormat::f32).dequantize(), source);  // a packed copy
}

// x as the reduced-precision products see it, and how far each value may have moved:
// q8: per 32-value block, scale max|x| / 127, nearest (ties to even), half a step;
// bf16: each value to nearest even, 2^-9 of it.
std::pair<RowMatrix, RowMatrix> rounded_activations(const RowMatrix& x, ActivationFormat a) {
  RowMatrix out(x.rows(), x.cols()), moved(x.rows(), x.cols());
  for (Eigen::Index m = 0; m < x.rows(); ++m)
    for (Eigen::Index b = 0; b < x.cols() / 32; ++b) {
      const float d = x.row(m).segment(b * 32, 32).cwiseAbs().maxCoeff() / 127.0f;
      for (Eigen::Index k = b * 32; k < b * 32 + 32; ++k) {
        if (a == ActivationFormat::q8) {
          out(m, k) = d == 0 ? 0.0f : d * std::nearbyint(x(m, k) * (1.0f / d));
          moved(m, k) = d / 2;
        } else {
          std::byte bits[2];
          convert_from_f32(DType::dtype_bf16, {&x(m, k), 1}, bits);
          convert_to_f32(DType::dtype_bf16, bits, {&out(m, k), 1});
          moved(m, k) = std::abs(x(m, k)) * 0x1p-9f;
        }
      }
    }
  return {out, moved};
}

// With reduced-precision activations the product is that of the rounded activations and the
// dequantized weights (integer block sums or bf16 pair products, then fp32: the bound below is
// fp32 summation), for every tile edge: rows of x around the 8-row tile and the 128-row pass,
// outputs around the 16-row group (27: a last group whose second half of 8 is partly there, which
// AVX2's Q4 tiles take whole). And it stays within the activations' rounding of the fp32
// product.
TEST(WeightMatrix, ReducedActivationProductIsTheProductOfTheRoundedActivations) {
  for (const auto [f, activations] : kInterleavings)
    for (std::int64_t outputs : {1, 16, 27, 37})
      for (std::int64_t rows : {1, 2, 3, 7, 8, 9, 17, 64, 130}) {
        const WeightMatrix w =
            WeightMatrix::quantize(random_matrix(outputs, 96, 9, 0.1f), f).packed_for(activations);
        const RowMatrix x = random_matrix(rows, 96, 10), dense = w.dequantize();
        const auto [rounded, moved] = rounded_activations(x, activations);
        const RowMatrix expected = rounded * dense.transpose();
        const RowMatrix bound =
            (rounded.cwiseAbs() * dense.cwiseAbs().transpose()) * (96 * 1.2e-7f);
        const RowMatrix rounding = moved * dense.cwiseAbs().transpose();
        const RowMatrix fp32 = x * dense.transpose();
        RowMatrix y;
        multiply_by_transposed(x, w, y, false);
        RowMatrix accumulated = RowMatrix::Ones(rows, outputs);
        multiply_by_transposed(x, w, accumulated, true);
        for (Eigen::Index i = 0; i < rows; ++i)
          for (Eigen::Index j = 0; j < outputs; ++j) {
            ASSERT_LE(std::abs(y(i, j) - expected(i, j)), bound(i, j) + 1e-6f)
                << weight_format_name(f) << " rows " << rows << " outputs " << outputs << " at "
                << i << "," << j;
            ASSERT_NEAR(accumulated(i, j), 1.0f + expected(i, j), bound(i, j) + 1e-5f);
            ASSERT_LE(std::abs(y(i, j) - fp32(i, j)), rounding(i, j) * 1.001f + 1e-5f);
          }
      }
}

// A NaN or infinite activation is not rounded away: every output of its row is NaN, as in
// fp32 (the engine reports non-finite logits), and the other rows are untouched.
TEST(WeightMatrix, NonFiniteActivationsStayNonFiniteWhenRounded) {
  for (const auto [f, activations] : kInterleavings)
    for (const float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      const WeightMatrix w =
          WeightMatrix::quantize(random_matrix(20, 64, 11, 0.1f), f).packed_for(activations);
      RowMatrix x = random_matrix(3, 64, 12);
      x(1, 40) = bad;
      RowMatrix y;
      multiply_by_transposed(x, w, y, false);
      for (Eigen::Index j = 0; j < y.cols(); ++j) {
        EXPECT_FALSE(std::isfinite(y(1, j))) << weight_format_name(f) << " " << bad << " " << j;
        EXPECT_TRUE(std::isfinite(y(0, j)) && std::isfinite(y(2, j))) << weight_format_name(f);
      }
    }
}

TEST(WeightMatrix, F32ViewSharesStorageAndStackConcatenatesRows) {
  const RowMatrix a = random_matrix(3, 64, 4), b = random_matrix(2, 64, 5);
  const WeightMatrix view = WeightMatrix::view(a);
  EXPECT_EQ(view.row(0), reinterpret_cast<const std::byte*>(a.data()));
  const std::vector<WeightMatrix> parts{WeightMatrix::quantize(a, WeightFormat::q8_0),
                                        WeightMatrix::quantize(b, WeightFormat::q8_0)};
  const RowMatrix stacked = WeightMatrix::stack(parts).dequantize();
  ASSERT_EQ(stacked.rows(), 5);
  EXPECT_EQ(stacked.topRows(3), parts[0].dequantize());
  EXPECT_EQ(stacked.bottomRows(2), parts[1].dequantize());
}

// The fp32 weights of `source` replaced by the dequantized values of `compute`.
LlamaWeights dequantized_copy(const LlamaWeights& source, const ComputeWeights& compute) {
  LlamaWeights out = source;
  for (std::size_t l = 0; l < out.layers.size(); ++l) {
    out.layers[l].w_qkv = compute.layers[l].w_qkv.dequantize();
    out.layers[l].wo = compute.layers[l].wo.dequantize();
    out.layers[l].w_gate_up = compute.layers[l].w_gate_up.dequantize();
    out.layers[l].w_down = compute.layers[l].w_down.dequantize();
  }
  (out.config.tie_word_embeddings ? out.embedding : out.lm_head) =
      compute.output_projection.dequantize();
  return out;
}

// Prefill of a whole prompt through the CPU backend with `compute`: last-token logits.
RowMatrix backend_logits(const LlamaWeights& weights, const ComputeWeights& compute,
                         std::span<const std::int32_t> prompt) {
  const ModelConfig& c = weights.config;
  const auto n = static_cast<std::int64_t>(prompt.size());
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n});
  CpuBackend backend(weights, pool, std::nullopt, compute);
  const BatchEntry entry{prompt, 0, KvView{{{0, n}}, 0, {}}};
  return backend.run({&entry, 1});
}

TEST(ComputeWeights, BackendEqualsTheReferenceOverTheDequantizedValues) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 7);
  const std::vector<std::int32_t> prompt{1, 5, 9, 200, 3, 77, 12, 8};
  for (WeightFormat f : kAllFormats) {
    const ComputeWeights compute = compute_weights(weights, f);
    const LlamaWeights truth = dequantized_copy(weights, compute);
    const RowMatrix expected = ReferenceModel(truth).forward(prompt).bottomRows(1);
    const RowMatrix actual = backend_logits(truth, compute, prompt);
    const auto closeness =
        test::compare({actual.data(), static_cast<std::size_t>(actual.size())},
                      {expected.data(), static_cast<std::size_t>(expected.size())});
    EXPECT_LT(closeness.max_abs, 1e-4) << weight_format_name(f);
    if (f != WeightFormat::f32) {
      EXPECT_LT(compute.bytes(), compute_weights(weights, WeightFormat::f32).bytes());
    }
  }
}

// Views of the reference's fp32 values are packed into panels when memory holds the copies, and
// stay row-major views (same logits within fp32 summation order) when it does not.
TEST(ComputeWeights, ViewsStayViewsWhenMemoryCannotHoldPackedCopies) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 7);
  const std::vector<std::int32_t> prompt{1, 5, 9, 200, 3, 77, 12, 8};
  const ComputeWeights views = compute_weights(weights, WeightFormat::f32);
  ASSERT_TRUE(views.layers[0].w_qkv.is_view());
  const ComputeWeights packed = with_activations(views, ActivationFormat::f32);
  EXPECT_EQ(packed.layers[0].w_qkv.layout(), WeightLayout::panels);
  EXPECT_FALSE(packed.layers[0].w_qkv.is_view());
  const ComputeWeights kept =
      with_activations(views, ActivationFormat::f32, 2 * views.bytes() - 1);  // one byte short
  EXPECT_EQ(kept.layers[0].w_qkv.layout(), WeightLayout::rows);
  EXPECT_TRUE(kept.output_projection.is_view());
  EXPECT_NE(kept.description.find("row-major views"), std::string::npos) << kept.description;
  const RowMatrix a = backend_logits(weights, packed, prompt);
  const RowMatrix b = backend_logits(weights, kept, prompt);
  const auto closeness = test::compare({a.data(), static_cast<std::size_t>(a.size())},
                                       {b.data(), static_cast<std::size_t>(b.size())});
  EXPECT_LT(closeness.max_abs, 1e-4);
}

// A GGUF file's matrices keep their stored types (here Q8_0, and F32 where a row is not whole
// blocks) and dequantize to exactly what the fp32 loader reads, Q/K row order included.
// Q4_0 and Q5_0 widen to Q8_0 exactly (x = d (q - offset) in all three: the scale kept, the
// integers q - offset): the same values, bit for bit, in a matrix of every sign and a zero block.
// Q4_1 (x = q d + m) has no exact widening and is refused.
TEST(WeightMatrix, Q4_0AndQ5_0WidenToQ8_0Exactly) {
  RowMatrix w = random_matrix(6, 96, 17);
  w.row(2).head(32).setZero();  // d = 0
  for (const WeightFormat format : {WeightFormat::q4_0, WeightFormat::q5_0}) {
    const WeightMatrix narrow = WeightMatrix::quantize(w, format);
    const WeightMatrix wide = narrow.widened_to_q8_0();
    EXPECT_EQ(wide.format(), WeightFormat::q8_0);
    EXPECT_EQ(wide.bytes(), 6 * 3 * 34);
    EXPECT_EQ(wide.dequantize(), narrow.dequantize()) << weight_format_name(format);
    EXPECT_NE(narrow.dequantize(), w);  // the check compares rounded values, not the originals
  }
  EXPECT_THROW((void)WeightMatrix::quantize(w, WeightFormat::q4_1).widened_to_q8_0(), Error);
}

TEST(ComputeWeights, GgufMatricesStayInTheirStoredTypes) {
  const auto path = std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "tiny_llama_q8_0.gguf";
  const LlamaWeights weights = load_llama_weights(path);
  const ComputeWeights compute = gguf_compute_weights(path, weights);
  EXPECT_EQ(compute.layers[0].w_qkv.format(), WeightFormat::q8_0);
  EXPECT_EQ(compute.layers[0].w_down.format(), WeightFormat::f32);  // 88 columns: not blocks
  EXPECT_NE(compute.description.find("q8_0"), std::string::npos) << compute.description;
  for (std::size_t l = 0; l < weights.layers.size(); ++l) {
    EXPECT_EQ(compute.layers[l].w_qkv.dequantize(), weights.layers[l].w_qkv);
    EXPECT_EQ(compute.layers[l].wo.dequantize(), weights.layers[l].wo);
    EXPECT_EQ(compute.layers[l].w_gate_up.dequantize(), weights.layers[l].w_gate_up);
    EXPECT_EQ(compute.layers[l].w_down.dequantize(), weights.layers[l].w_down);
  }
  EXPECT_EQ(compute.output_projection.dequantize(), weights.output_projection());
  // K/V heads converted by an attention variant (2 -> 1, MQA): the stored Q/K/V blocks are not
  // the served matrix, so it is multiplied in fp32 from the converted weights, as the
  // reference computes it; the other matrices keep their stored types.
  const LlamaWeights mqa = convert_kv_heads(weights, 1);
  const ComputeWeights converted = gguf_compute_weights(path, mqa);
  EXPECT_EQ(converted.layers[0].w_qkv.format(), WeightFormat::f32);
  EXPECT_EQ(converted.layers[0].w_qkv.dequantize(), mqa.layers[0].w_qkv);
  EXPECT_EQ(converted.layers[0].w_gate_up.format(), WeightFormat::q8_0);
  EXPECT_NE(converted.description.find("multiplied in fp32"), std::string::npos);
}

}  // namespace
}  // namespace kvlab::cpu
