// Quantized KV: the fp8 e4m3 code, the grouped row formats (int8 with a per-row scale, llama.cpp's
// q8_0, q4_0 and q4_1 blocks, KIVI's asymmetric 2-bit int2 blocks), their bytes, and KV pools that
// hold them (rows, swaps, key channel order). Bounds are the formats' own rounding steps, stated
// per test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvlab/dtype.hpp"
#include "kvlab/kv/kv_rows.hpp"
#include "kvlab/kv_pool.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

std::vector<float> random_row(std::mt19937& rng, std::size_t n, float outlier = 0) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(n);
  for (float& v : row) v = normal(rng);
  if (outlier != 0) row[n / 3] = outlier;
  return row;
}

std::vector<float> round_trip(DType dtype, const std::vector<float>& row) {
  std::vector<std::byte> bytes(
      static_cast<std::size_t>(dtype_row_bytes(dtype, static_cast<std::int64_t>(row.size()))));
  convert_from_f32(dtype, row, bytes);
  std::vector<float> back(row.size());
  convert_to_f32(dtype, bytes, back);
  return back;
}

TEST(KvFormats, RowBytesCountTheScales) {
  EXPECT_EQ(dtype_row_bytes(DType::dtype_f16, 64), 128);
  EXPECT_EQ(dtype_row_bytes(DType::dtype_f8_e4m3, 64), 64);
  EXPECT_EQ(dtype_row_bytes(DType::dtype_kv_int8, 64), 68);   // + one fp32 scale
  EXPECT_EQ(dtype_row_bytes(DType::dtype_q8_0, 64), 68);      // 2 blocks of 34
  EXPECT_EQ(dtype_row_bytes(DType::dtype_q4_0, 128), 72);     // 4 blocks of 18
  EXPECT_EQ(dtype_row_bytes(DType::dtype_q4_1, 128), 80);     // 4 blocks of 20
  EXPECT_EQ(dtype_row_bytes(DType::dtype_kv_int2, 128), 48);  // 4 blocks of 12: 3 bits a value
  EXPECT_FALSE(dtype_row_fits(DType::dtype_kv_int2, 48));
  EXPECT_TRUE(dtype_row_fits(DType::dtype_kv_int8, 48));
  EXPECT_FALSE(dtype_row_fits(DType::dtype_q8_0, 48));
  EXPECT_FALSE(dtype_row_fits(DType::dtype_q4_0, 80));
  EXPECT_EQ(dtype_size(DType::dtype_q8_0), 0u);   // no per-value size: rows only
  EXPECT_FALSE(dtype_from_safetensors_name(""));  // the KV-only formats have no file name
  for (const char* name : {"int8", "q8_0", "q4_0", "q4_1", "int2", "fp8"}) {
    ASSERT_TRUE(dtype_from_short_name(name)) << name;
    EXPECT_TRUE(kv_pool_holds(*dtype_from_short_name(name))) << name;
  }
  test::expect_error_containing(
      [] { (void)kv_pool_dtype("q5_k", "--kv-dtype"); },
      {"--kv-dtype must be one of f32, f16, bf16, fp8, int8, q8_0, q4_0, q4_1, int2", "q5_k"});
}

// e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; nearest even, saturated.
TEST(KvFormats, Fp8E4m3CodesAndRounding) {
  const float* table = fp8_e4m3_values();
  EXPECT_EQ(table[0x38], 1.0f);
  EXPECT_EQ(table[0x7e], 448.0f);
  EXPECT_EQ(table[0xfe], -448.0f);
  EXPECT_EQ(table[0x08], std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(table[0x01], std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(table[0x7f]));
  for (int code = 0; code < 256; ++code) {  // every finite code round-trips exactly
    if ((code & 0x7f) == 0x7f) continue;
    const std::vector<float> back = round_trip(DType::dtype_f8_e4m3, {table[code]});
    EXPECT_EQ(back[0], table[code]) << code;
  }
  const auto fp8 = [](float x) { return round_trip(DType::dtype_f8_e4m3, {x})[0]; };
  EXPECT_EQ(fp8(1.0625f), 1.0f);    // a tie: to the even mantissa
  EXPECT_EQ(fp8(1.1875f), 1.25f);   // a tie: to the even mantissa (up)
  EXPECT_EQ(fp8(1.1f), 1.125f);     // nearest
  EXPECT_EQ(fp8(1000.0f), 448.0f);  // saturated, not NaN
  EXPECT_EQ(fp8(-1000.0f), -448.0f);
  std::mt19937 rng(3);
  for (float x : random_row(rng, 1000)) {  // relative error <= half a step of 3 mantissa bits
    if (std::fabs(x) < std::ldexp(1.0f, -6)) continue;
    EXPECT_LE(std::fabs(fp8(x) - x), std::fabs(x) * 0x1p-4f) << x;
  }
}

// Each value within half a quantization step of its group's scale: int8 one scale per row
// (absmax / 127); q8_0 per block of 32 (absmax / 127 stored in fp16: half a step + 127 x the
// fp16 rounding of the scale, <= 0.57 steps); q4_0 per block (max / -8 in fp16: one step, the
// block's extreme of the other sign is clipped to 7 steps); the asymmetric q4_1 and int2 per
// block, (max - min) / 15 and / 3, half a step plus the fp16 rounding of min and scale (<= 0.51
// steps of 15, 0.503 of 3, + |min| 2^-11).
TEST(KvFormats, QuantizedRowsStayWithinTheirStep) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> row = random_row(rng, 128, trial % 2 ? 25.0f : 0.0f);
    const std::vector<float> int8 = round_trip(DType::dtype_kv_int8, row);
    const std::vector<float> q8 = round_trip(DType::dtype_q8_0, row);
    const std::vector<float> q4 = round_trip(DType::dtype_q4_0, row);
    const std::vector<float> q41 = round_trip(DType::dtype_q4_1, row);
    const std::vector<float> int2 = round_trip(DType::dtype_kv_int2, row);
    float row_max = 0;
    for (float v : row) row_max = std::max(row_max, std::fabs(v));
    for (std::size_t b = 0; b < row.size(); b += 32) {
      float block_max = 0;
      for (std::size_t j = b; j < b + 32; ++j) block_max = std::max(block_max, std::fabs(row[j]));
      const auto [lo, hi] = std::minmax_element(row.begin() + static_cast<std::ptrdiff_t>(b),
                                                row.begin() + static_cast<std::ptrdiff_t>(b + 32));
      const float range = *hi - *lo, min_rounding = std::fabs(*lo) * 0x1p-11f;
      for (std::size_t j = b; j < b + 32; ++j) {
        EXPECT_LE(std::fabs(int8[j] - row[j]), 0.5001f * row_max / 127) << j;
        EXPECT_LE(std::fabs(q8[j] - row[j]), 0.57f * block_max / 127) << j;
        EXPECT_LE(std::fabs(q4[j] - row[j]), 1.01f * block_max / 8) << j;
        EXPECT_LE(std::fabs(q41[j] - row[j]), 0.51f * range / 15 + min_rounding) << j;
        EXPECT_LE(std::fabs(int2[j] - row[j]), 0.503f * range / 3 + min_rounding) << j;
      }
    }
  }
  std::vector<float> broken = random_row(rng, 64);  // a diverged model's row: no undefined cast
  broken[3] = std::numeric_limits<float>::quiet_NaN();
  broken[40] = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::dtype_kv_int8, DType::dtype_q8_0, DType::dtype_q4_0, DType::dtype_q4_1,
                      DType::dtype_kv_int2, DType::dtype_f8_e4m3})
    EXPECT_EQ(round_trip(dtype, broken).size(), broken.size());
  const std::vector<float> zeros(64, 0.0f);  // a zero scale: zeros back, no NaN
  EXPECT_EQ(round_trip(DType::dtype_kv_int8, zeros), zeros);
  EXPECT_EQ(round_trip(DType::dtype_q4_0, zeros), zeros);
  EXPECT_EQ(round_trip(DType::dtype_kv_int2, zeros), zeros);
  const std::vector<float> flat(64, -0.75f);  // a block of one value: min alone, exactly
  EXPECT_EQ(round_trip(DType::dtype_kv_int2, flat), flat);
  EXPECT_EQ(round_trip(DType::dtype_q4_1, flat), flat);
}

// Key rows in q8_0 / q4_0 keep each RoPE pair (d, d + 32 of 64) in one block: small channels
// paired with small ones keep their own fine scale even when other pairs are 100x larger.
TEST(KvFormats, KeyRowsShareBlocksByRotaryPair) {
  constexpr std::int64_t hd = 64;
  std::vector<bool> seen(hd, false);
  for (std::int64_t d = 0; d < hd; ++d) seen[paired_key_position(d, hd)] = true;
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), hd);  // a permutation
  EXPECT_EQ(paired_key_position(0, hd), 0);
  EXPECT_EQ(paired_key_position(32, hd), 16);  // 0's rotary partner, same block
  EXPECT_EQ(paired_key_position(16, hd), 32);  // the second block
  std::vector<float> key(hd);
  for (std::int64_t d = 0; d < hd; ++d) key[d] = (d % 32 < 16 ? 0.01f : 1.0f) * (1 + d % 5);
  for (DType dtype : {DType::dtype_q8_0, DType::dtype_q4_0, DType::dtype_q4_1}) {
    std::vector<std::byte> bytes(static_cast<std::size_t>(dtype_row_bytes(dtype, hd)));
    key_row_from_f32(dtype, key.data(), hd, bytes.data());
    std::vector<float> back(hd);
    key_row_to_f32(dtype, bytes.data(), hd, back.data());
    for (std::int64_t d = 0; d < hd; ++d) {  // within the small block's own step (max 0.05)
      if (d % 32 < 16) {
        EXPECT_LE(std::fabs(back[d] - key[d]), 0.05f / 8 * 1.01f) << d;
      }
    }
    EXPECT_FALSE(pairs_key_channels(DType::dtype_kv_int8));  // one scale per row: no order
  }
}

// A quantized pool counts its true bytes, reads rows back within the format's step, and swaps
// move its stored bytes unchanged (no second rounding).
TEST(KvFormats, QuantizedPoolsHoldRowsAndSwapTheirBytes) {
  std::mt19937 rng(11);
  for (DType dtype : {DType::dtype_f8_e4m3, DType::dtype_kv_int8, DType::dtype_q8_0,
                      DType::dtype_q4_0, DType::dtype_q4_1, DType::dtype_kv_int2}) {
    KvPool pool({2, 3, 64, 16, dtype});
    EXPECT_EQ(pool.bytes_per_slot(), 2 * 2 * 3 * dtype_row_bytes(dtype, 64));
    const std::vector<float> k = random_row(rng, 3 * 64), v = random_row(rng, 3 * 64);
    pool.write_row(1, 4, false, k.data());
    pool.write_row(1, 4, true, v.data());
    std::vector<float> back(k.size());
    pool.read_row(1, 4, false, back.data());
    for (std::size_t i = 0; i < k.size(); ++i) {
      // int2: half a step of its block's range / 3, under its head's range / 3 (x 0.503, + the
      // min's fp16 rounding); the others within 0.5 of these N(0, 1) values.
      const auto head = k.begin() + static_cast<std::ptrdiff_t>(i / 64 * 64);
      const auto [lo, hi] = std::minmax_element(head, head + 64);
      const float step = dtype == DType::dtype_kv_int2 ? 0.503f * (*hi - *lo) / 3 + 0.01f : 0.5f;
      EXPECT_NEAR(back[i], k[i], step) << dtype_short_name(dtype) << " " << i;
    }
    const KvView view{{{4, 1}}, 0, {}};
    std::vector<std::byte> swapped;
    EXPECT_EQ(copy_kv_rows(pool, view, 0, 1, swapped, true), pool.bytes_per_slot());
    const KvView elsewhere{{{9, 1}}, 0, {}};
    copy_kv_rows(pool, elsewhere, 0, 1, swapped, false);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      EXPECT_EQ(std::memcmp(pool.key_bytes(layer, 4), pool.key_bytes(layer, 9),
                            static_cast<std::size_t>(pool.shape().slot_row_bytes(false))),
                0);
      EXPECT_EQ(std::memcmp(pool.value_bytes(layer, 4), pool.value_bytes(layer, 9),
                            static_cast<std::size_t>(pool.shape().slot_row_bytes(true))),
                0);
    }
  }
  test::expect_error_containing(
      [] {
        KvPool pool({1, 1, 48, 4, DType::dtype_q8_0});
      },
      {"q8_0", "multiple of 32", "48"});
}

// K and V in dtypes apart (llama.cpp's -ctk / -ctv): each half holds its own rows (K q8_0's 34
// bytes a block of 32, V q4_0's 18), reads back within its own format's step (q8_0: 1/127 of
// the block's largest, under 0.05 for these N(0, 1) rows; q4_0: 1/7, under 0.6), copies and
// swaps move each half's bytes unchanged; KIVI cannot be split.
TEST(KvFormats, KeysAndValuesTakeDtypesOfTheirOwn) {
  std::mt19937 rng(12);
  KvPoolShape shape{2, 3, 64, 16, DType::dtype_q8_0};
  shape.value_dtype = DType::dtype_q4_0;
  KvPool pool(shape);
  EXPECT_TRUE(shape.splits_dtypes());
  EXPECT_EQ(pool.shape().slot_row_bytes(false), 3 * 68);
  EXPECT_EQ(pool.shape().slot_row_bytes(true), 3 * 36);
  EXPECT_EQ(pool.bytes_per_slot(), 2 * 3 * (68 + 36));
  const std::vector<float> k = random_row(rng, 3 * 64), v = random_row(rng, 3 * 64);
  for (std::int64_t slot : {4, 15}) {  // the last slot: each half ends where its buffer does
    pool.write_row(1, slot, false, k.data());
    pool.write_row(1, slot, true, v.data());
  }
  std::vector<float> back_k(k.size()), back_v(v.size());
  pool.read_row(1, 15, false, back_k.data());
  pool.read_row(1, 15, true, back_v.data());
  double k_error = 0, v_error = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    k_error = std::max(k_error, static_cast<double>(std::fabs(back_k[i] - k[i])));
    v_error = std::max(v_error, static_cast<double>(std::fabs(back_v[i] - v[i])));
  }
  EXPECT_LT(k_error, 0.05);
  EXPECT_LT(v_error, 0.6);
  EXPECT_GT(v_error, 2 * k_error);  // V's 4 bits are coarser than K's 8
  pool.copy_slots(4, 7, 1);
  const KvView view{{{7, 1}}, 0, {}};
  std::vector<std::byte> swapped;
  EXPECT_EQ(copy_kv_rows(pool, view, 0, 1, swapped, true), pool.bytes_per_slot());
  copy_kv_rows(pool, KvView{{{9, 1}}, 0, {}}, 0, 1, swapped, false);
  for (std::int64_t layer = 0; layer < 2; ++layer)
    for (const bool value : {false, true}) {
      const auto row = [&](std::int64_t slot) {
        return value ? pool.value_bytes(layer, slot) : pool.key_bytes(layer, slot);
      };
      EXPECT_EQ(
          std::memcmp(row(4), row(9), static_cast<std::size_t>(pool.shape().slot_row_bytes(value))),
          0)
          << layer << " " << value;
    }
  test::expect_error_containing(
      [] {
        KvPoolShape kivi{1, 1, 64, 32, DType::dtype_kivi2};
        kivi.value_dtype = DType::dtype_q4_0;
        KvPool split(kivi);
      },
      {"KIVI", "K kivi2 and V q4_0 cannot be split"});
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// A view whose positions a KV policy thinned: indices, positions and slots map both ways.
TEST(KvView, PositionsWithHolesMapToTheirSlots) {
  KvView view{{{10, 3}, {40, 2}}, 0, {0, 1, 5, 6, 9}};
  EXPECT_TRUE(view.has_holes());
  EXPECT_EQ(view.length(), 5);
  EXPECT_EQ(view.end_position(), 10);
  EXPECT_EQ(view.position_at(2), 5);
  EXPECT_EQ(view.index_at_or_after(2), 2);  // 2 was dropped: the next held is 5, index 2
  EXPECT_EQ(view.index_at_or_after(10), 5);
  EXPECT_EQ(view.slot_of(5), 12);
  EXPECT_EQ(view.slot_of(6), 40);
  EXPECT_EQ(view.slot_at(4), 41);
  const KvView consecutive{{{7, 4}}, 3, {}};  // positions 3-6
  EXPECT_FALSE(consecutive.has_holes());
  EXPECT_EQ(consecutive.index_at_or_after(0), 0);
  EXPECT_EQ(consecutive.index_at_or_after(5), 2);
  EXPECT_EQ(consecutive.slot_of(5), 9);
  EXPECT_EQ(consecutive.end_position(), 7);
}

}  // namespace
}  // namespace kvlab
