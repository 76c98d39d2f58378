// The two inner loops of decode attention (cpu_reference/src/attention_rows.hpp) against plain
// loops over the same widened rows, for every head_dim path (8-wide AVX2 in 64-column blocks and
// 8-column tails, plain loops where head_dim is not a multiple of 8), key counts around the 8-key
// groups, rows a slot apart and each pool dtype (the quantized ones dequantized in registers,
// key rows in their stored channel order). Tolerance: fp32 sums in another order, |error| <=
// hd * 1.2e-7 * sum |terms|; the asymmetric formats (q4_1, int2: x = code x scale + min) sum
// q x code x scale and q x min apart, so their terms are bounded by |q| (|x| + |min|) with |min|
// <= the row's largest |x| (the min is a value of its block).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "attention_rows.hpp"
#include "kivi_attention.hpp"

namespace kvlab::cpu {
namespace {

// `count` slot rows of three heads (head rows of `hd` values in `dtype`, key rows in the stored
// channel order when `key`) and 8 bytes more, `stride` bytes apart.
std::vector<std::byte> slot_rows(DType dtype, bool key, std::int64_t hd, std::int64_t count,
                                 std::int64_t stride, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  const std::int64_t head_bytes = dtype_row_bytes(dtype, hd);
  std::vector<std::byte> rows(static_cast<std::size_t>(count * stride));
  std::vector<float> head(static_cast<std::size_t>(hd));
  for (std::int64_t j = 0; j < count; ++j)
    for (std::int64_t h = 0; h < 3; ++h) {
      for (float& v : head) v = value(rng);
      std::byte* target = rows.data() + j * stride + h * head_bytes;
      if (key)
        key_row_from_f32(dtype, head.data(), hd, target);
      else
        convert_from_f32(dtype, head, {target, static_cast<std::size_t>(head_bytes)});
    }
  return rows;
}

float largest_magnitude(const std::vector<float>& row) {
  float largest = 0;
  for (float x : row) largest = std::max(largest, std::fabs(x));
  return largest;
}

TEST(AttentionRows, ScoresAndWeightedSumsEqualPlainLoops) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (DType dtype : {DType::dtype_f32, DType::dtype_f16, DType::dtype_bf16, DType::dtype_f8_e4m3,
                      DType::dtype_kv_int8, DType::dtype_q8_0, DType::dtype_q4_0, DType::dtype_q4_1,
                      DType::dtype_kv_int2})
    for (std::int64_t hd : {8, 12, 16, 48, 64, 80, 128})
      for (std::int64_t count : {1, 7, 8, 9, 16, 21, 33}) {
        if (!dtype_row_fits(dtype, hd)) continue;
        const std::int64_t head_bytes = dtype_row_bytes(dtype, hd);
        const std::int64_t stride = 3 * head_bytes + 8;  // a slot row holds other heads too
        const std::vector<std::byte> keys = slot_rows(dtype, true, hd, count, stride, rng);
        const std::vector<std::byte> values = slot_rows(dtype, false, hd, count, stride, rng);
        std::vector<float> q(static_cast<std::size_t>(hd)), p(static_cast<std::size_t>(count));
        for (float& v : q) v = value(rng);
        for (float& v : p) v = value(rng);
        const std::byte* k = keys.data() + head_bytes;  // the second head of each row
        const std::byte* v = values.data() + head_bytes;
        std::vector<float> scores(static_cast<std::size_t>(count)),
            o(static_cast<std::size_t>(hd), 0.5f);
        score_rows(dtype, q.data(), k, stride, count, count, hd, 0.25f, scores.data());
        add_weighted_rows(dtype, p.data(), v, stride, count, count, hd, o.data());
        std::vector<float> k_row(static_cast<std::size_t>(hd)), v_row(k_row.size());
        std::vector<double> expected_o(k_row.size(), 0.5), o_bound(k_row.size(), 0);
        for (std::int64_t j = 0; j < count; ++j) {
          key_row_to_f32(dtype, k + j * stride, hd, k_row.data());
          widen_attention_row(dtype, v + j * stride, hd, v_row.data());
          const bool asymmetric = dtype == DType::dtype_q4_1 || dtype == DType::dtype_kv_int2;
          const double k_min = asymmetric ? largest_magnitude(k_row) : 0.0;
          const double v_min = asymmetric ? largest_magnitude(v_row) : 0.0;
          double dot = 0, bound = 0;
          const auto pj = static_cast<double>(p[static_cast<std::size_t>(j)]);
          for (std::size_t d = 0; d < k_row.size(); ++d) {
            dot += static_cast<double>(q[d]) * k_row[d];
            bound += std::abs(static_cast<double>(q[d])) * (std::abs(k_row[d]) + k_min);
            expected_o[d] += pj * v_row[d];
            o_bound[d] += std::abs(pj) * (std::abs(v_row[d]) + v_min);
          }
          EXPECT_NEAR(scores[static_cast<std::size_t>(j)], 0.25 * dot,
                      0.25 * bound * static_cast<double>(hd) * 1.2e-7 + 1e-7)
              << dtype_short_name(dtype) << " hd " << hd << " count " << count << " key " << j;
        }
        for (std::size_t d = 0; d < k_row.size(); ++d)
          EXPECT_NEAR(o[d], expected_o[d], (o_bound[d] + 0.5) * static_cast<double>(count) * 1.2e-7)
              << dtype_short_name(dtype) << " hd " << hd << " count " << count << " column " << d;
      }
}

#if KVLAB_ATTENTION_SIMD
// The decode kernels widen fp8 by shifts into f16 (not the table): every one of the 256 codes
// gives the table's value exactly, subnormals and saturation included, NaN for NaN.
TEST(AttentionRows, Fp8WidensEveryCodeExactly) {
  std::vector<std::byte> codes(256);
  for (int c = 0; c < 256; ++c) codes[static_cast<std::size_t>(c)] = static_cast<std::byte>(c);
  const float* table = fp8_e4m3_values();
  for (int d = 0; d < 256; d += 8) {
    float widened[8];
    _mm256_storeu_ps(widened, load_row8<DType::dtype_f8_e4m3>(codes.data(), d));
    for (float& w : widened) w *= row_scale<DType::dtype_f8_e4m3>(codes.data());  // 2^8
    for (int i = 0; i < 8; ++i) {
      if (std::isnan(table[d + i]))
        EXPECT_TRUE(std::isnan(widened[i])) << d + i;
      else
        EXPECT_EQ(widened[i], table[d + i]) << d + i;
    }
  }
}
#endif

}  // namespace
}  // namespace kvlab::cpu

namespace kvlab::cpu {
namespace {

// KIVI pools (kivi_attention.hpp): scores and weighted sums over runs that cross sealed groups
// and end in an open one (and start inside a group) against plain loops over the rows the pool
// reads back (KvPool::read_head_rows). Tolerance as above: fp32 sums in another order, terms
// bounded by |q| (|x| + |min|) for the sealed keys (q x code x scale and q . min summed apart).
TEST(KiviAttention, ScoresAndWeightedSumsEqualPlainLoopsOverTheRowsTheyRead) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (const DType dtype : {DType::dtype_kivi2, DType::dtype_kivi4})
    for (const std::int64_t hd : {64, 128}) {
      KvPool pool({1, 2, hd, 96, dtype});
      std::vector<float> row(static_cast<std::size_t>(2 * hd));
      for (std::int64_t slot = 0; slot < 75; ++slot)  // groups 0 and 1 sealed, 2 open
        for (const bool v : {false, true}) {
          for (float& x : row) x = value(rng) + (v ? 0.0f : 3.0f * (&x - row.data() == 5));
          pool.write_row(0, slot, v, row.data());
        }
      pool.seal_open_groups(0, 64);
      ASSERT_EQ(pool.open_row(0, 63, false), nullptr);
      ASSERT_NE(pool.open_row(0, 64, false), nullptr);
      std::vector<float> q(static_cast<std::size_t>(hd)), p(75);
      for (float& x : q) x = value(rng);
      for (float& x : p) x = 0.5f + 0.5f * value(rng);
      for (const auto& [first, count] : {std::pair<std::int64_t, std::int64_t>{0, 75}, {5, 61}}) {
        std::vector<float> keys(static_cast<std::size_t>(count * hd)), values(keys.size());
        pool.read_head_rows(0, first, count, false, 1, keys.data());
        pool.read_head_rows(0, first, count, true, 1, values.data());
        std::vector<float> scores(static_cast<std::size_t>(count)), o(static_cast<std::size_t>(hd));
        score_kivi_keys(pool, 0, 1, q.data(), first, count, 0.125f, scores.data());
        add_kivi_values(pool, 0, 1, p.data(), first, count, o.data());
        for (std::int64_t j = 0; j < count; ++j) {
          double dot = 0, bound = 0;
          for (std::int64_t d = 0; d < hd; ++d) {
            const float x = keys[static_cast<std::size_t>(j * hd + d)],
                        qd = q[static_cast<std::size_t>(d)];
            dot += qd * x;
            bound +=
                std::fabs(qd) * (2 * std::fabs(x) + 5.0);  // |min| <= 4 + |x| (values in [-1, 4])
          }
          EXPECT_NEAR(scores[static_cast<std::size_t>(j)], 0.125 * dot, 0.125 * hd * 1.2e-7 * bound)
              << dtype_short_name(dtype) << " hd " << hd << " key " << first + j;
        }
        for (std::int64_t d = 0; d < hd; ++d) {
          double sum = 0, bound = 0;
          for (std::int64_t j = 0; j < count; ++j) {
            const float x = values[static_cast<std::size_t>(j * hd + d)];
            sum += p[static_cast<std::size_t>(j)] * x;
            bound += p[static_cast<std::size_t>(j)] * (2 * std::fabs(x) + 1.0);
          }
          EXPECT_NEAR(o[static_cast<std::size_t>(d)], sum, count * 1.2e-7 * bound)
              << dtype_short_name(dtype) << " hd " << hd << " column " << d;
        }
      }
    }
}

}  // namespace
}  // namespace kvlab::cpu
