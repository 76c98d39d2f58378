// KIVI pools (kivi2, kivi4): per-channel key groups of 32 slots, open in fp16 beside the pool
// until their owner seals them, and the copies and swaps that must carry the open ones. Bounds are
// stated per test: half a quantization step of the channel's (keys) or the block's (values)
// range, plus fp16's rounding of the stored scale and min.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvlab/dtype.hpp"
#include "kvlab/kv/block_table.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv/kv_rows.hpp"
#include "kvlab/kv_pool.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

constexpr std::int64_t kLayers = 2, kHeads = 2, kHeadDim = 64, kWidth = kHeads * kHeadDim;

// Slot `slot`'s K (or V) row of `layer`: N(0, 1) values, and key channel 3 of every head an
// outlier channel (around 40), as real keys have.
std::vector<float> row_of(std::int64_t layer, std::int64_t slot, bool value) {
  std::mt19937 rng(static_cast<std::uint32_t>(1000 * layer + 2 * slot + (value ? 1 : 0)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(kWidth);
  for (float& x : row) x = normal(rng);
  if (!value)
    for (std::int64_t h = 0; h < kHeads; ++h) row[static_cast<std::size_t>(h * kHeadDim + 3)] += 40;
  return row;
}

// Writes slots [first, end) and, unless `seal` is false, seals every group they complete (the
// groups before `end`'s: a residual of 0).
void write_slots(KvPool& pool, std::int64_t first, std::int64_t end, std::int64_t tag = 0,
                 bool seal = true) {
  for (std::int64_t slot = first; slot < end; ++slot)
    for (std::int64_t layer = 0; layer < kLayers; ++layer)
      for (const bool value : {false, true})
        pool.write_row(layer, slot, value, row_of(layer, slot + tag, value).data());
  if (seal) pool.seal_open_groups(first, end / kKiviGroup * kKiviGroup - first);
}

std::vector<float> read(const KvPool& pool, std::int64_t layer, std::int64_t slot, bool value) {
  std::vector<float> row(kWidth);
  pool.read_row(layer, slot, value, row.data());
  return row;
}

float half_of(float x) {
  std::byte bytes[2];
  convert_from_f32(DType::dtype_f16, {&x, 1}, bytes);
  float back;
  convert_to_f32(DType::dtype_f16, bytes, {&back, 1});
  return back;
}

// Max |error| per key channel over a sealed group [first, first + 32) of layer 0, head 0.
std::vector<float> channel_errors(const KvPool& pool, std::int64_t first, std::int64_t tag = 0) {
  std::vector<float> worst(kHeadDim, 0.0f);
  for (std::int64_t slot = first; slot < first + kKiviGroup; ++slot) {
    const std::vector<float> x = row_of(0, slot + tag, false), back = read(pool, 0, slot, false);
    for (std::int64_t d = 0; d < kHeadDim; ++d)
      worst[static_cast<std::size_t>(d)] =
          std::max(worst[static_cast<std::size_t>(d)],
                   std::fabs(back[static_cast<std::size_t>(d)] - x[static_cast<std::size_t>(d)]));
  }
  return worst;
}

// Half a quantization step of key channel d's range over the group [first, first + 32) of layer
// 0, head 0 (levels: 3 for 2 bits, 15 for 4), + the fp16 rounding of its stored min.
float channel_bound(std::int64_t first, std::int64_t tag, std::int64_t d, float levels) {
  float lo = 1e9f, hi = -1e9f;
  for (std::int64_t slot = first; slot < first + kKiviGroup; ++slot) {
    lo = std::min(lo, row_of(0, slot + tag, false)[static_cast<std::size_t>(d)]);
    hi = std::max(hi, row_of(0, slot + tag, false)[static_cast<std::size_t>(d)]);
  }
  return 0.503f * (hi - lo) / levels + std::fabs(lo) / 1024;
}

TEST(KiviPool, RowsAreAsLongAsTheirValueFormatsRows) {
  EXPECT_EQ(dtype_row_bytes(DType::dtype_kivi2, 128), 48);  // = int2's
  EXPECT_EQ(dtype_row_bytes(DType::dtype_kivi4, 128), 80);  // = q4_1's
  EXPECT_FALSE(dtype_row_fits(DType::dtype_kivi2, 48));
  EXPECT_EQ(kivi_value_dtype(DType::dtype_kivi2), DType::dtype_kv_int2);
  for (const char* name : {"kivi2", "kivi4"})
    EXPECT_TRUE(kv_pool_holds(*dtype_from_short_name(name)));
  // A key row's params share (head_dim / 8 bytes) + codes fill it exactly.
  EXPECT_EQ(kivi_code_bytes(2, 128) + 128 / 8, 48);
  EXPECT_EQ(kivi_code_bytes(4, 128) + 128 / 8, 80);
}

// A sequence's open groups under residual R: ceil(n / 32) - floor((n - R) / 32) once n > R.
TEST(KiviPool, OpenGroupsFollowTheResidual) {
  EXPECT_EQ(kivi_open_groups(0, 128), 0);
  EXPECT_EQ(kivi_open_groups(100, 128), 4);   // all of it: groups 0-3
  EXPECT_EQ(kivi_open_groups(160, 128), 4);   // group 0 left the newest 128
  EXPECT_EQ(kivi_open_groups(161, 128), 5);   // and group 5 opened
  EXPECT_EQ(kivi_open_groups(1000, 128), 5);  // the most: R / 32 + 1
  EXPECT_EQ(kivi_most_open_groups(128), 5);
  EXPECT_EQ(kivi_open_groups(64, 0), 0);  // residual 0: only a partly written group
  EXPECT_EQ(kivi_open_groups(65, 0), 1);
  test::expect_error_containing(
      [] {
        KvPoolShape shape{kLayers, kHeads, kHeadDim, 64, DType::dtype_kivi2};
        shape.kivi_residual = 100;
        KvPool pool(shape);
      },
      {"KIVI residual of 100", "multiple of 32"});
}

// Rows of an open group come back as their fp16 rounding until its owner seals it, whole (a
// backend, once the group left the residual); then keys are codes within half a step of their
// channel's range, values of their block's.
TEST(KiviPool, OpenGroupsHoldFp16UntilTheirOwnerSealsThem) {
  for (DType dtype : {DType::dtype_kivi2, DType::dtype_kivi4}) {
    KvPool pool({kLayers, kHeads, kHeadDim, 96, dtype});
    write_slots(pool, 0, 41, 0, false);
    EXPECT_EQ(pool.open_group_bytes(), 2 * pool.bytes_per_open_group());  // nothing sealed itself
    for (const bool value : {false, true}) {
      const std::vector<float> x = row_of(0, 5, value), back = read(pool, 0, 5, value);
      for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], half_of(x[i])) << i;
    }
    pool.seal_open_groups(0, 1);  // group 0 only: the group holding slot 0
    EXPECT_EQ(pool.open_group_bytes(), pool.bytes_per_open_group());  // group 1 (slots 32-40)
    EXPECT_EQ(pool.bytes_per_open_group(), 2 * kLayers * 32 * kWidth * 2);
    ASSERT_NE(pool.open_row(1, 40, true), nullptr);
    EXPECT_EQ(pool.open_row(1, 31, true), nullptr);
    for (const bool value : {false, true}) {
      const std::vector<float> x = row_of(1, 37, value), back = read(pool, 1, 37, value);
      for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(back[i], half_of(x[i])) << i;
    }
    const float levels = dtype == DType::dtype_kivi2 ? 3.0f : 15.0f;
    for (std::int64_t slot = 0; slot < 32; ++slot) {
      const std::vector<float> v = row_of(1, slot, true), back = read(pool, 1, slot, true);
      for (std::size_t b = 0; b < v.size(); b += 32) {
        const auto [lo, hi] = std::minmax_element(v.begin() + b, v.begin() + b + 32);
        for (std::size_t i = b; i < b + 32; ++i)
          EXPECT_NEAR(back[i], v[i], 0.503f * (*hi - *lo) / levels + std::fabs(*lo) / 1024);
      }
    }
    const std::vector<float> worst = channel_errors(pool, 0);
    for (std::int64_t d = 0; d < kHeadDim; ++d)
      EXPECT_LE(worst[static_cast<std::size_t>(d)], channel_bound(0, 0, d, levels))
          << dtype_short_name(dtype) << " channel " << d;
  }
}

// KIVI's point at the scale of one group: with an outlier channel, per-token 2-bit blocks (int2)
// spend their range on it and lose the other 31 channels of its block; per-channel 2-bit keys
// do not (measured: a summed error of 0.15 of int2's there).
TEST(KiviPool, PerChannelKeysKeepTheChannelsBesideAnOutlier) {
  KvPool kivi({kLayers, kHeads, kHeadDim, 32, DType::dtype_kivi2});
  KvPool per_token({kLayers, kHeads, kHeadDim, 32, DType::dtype_kv_int2});
  write_slots(kivi, 0, 32);
  write_slots(per_token, 0, 32);
  const std::vector<float> a = channel_errors(kivi, 0), b = channel_errors(per_token, 0);
  double kivi_sum = 0, per_token_sum = 0;
  const std::int64_t outlier_block = paired_key_position(3, kHeadDim) / 32;  // int2's pairing
  for (std::int64_t d = 0; d < kHeadDim; ++d)
    if (d != 3 && paired_key_position(d, kHeadDim) / 32 == outlier_block) {
      kivi_sum += a[static_cast<std::size_t>(d)];
      per_token_sum += b[static_cast<std::size_t>(d)];
    }
  EXPECT_LT(kivi_sum, 0.3 * per_token_sum) << kivi_sum << " vs " << per_token_sum;
}

// A copy of a partly filled block carries its open group, which then seals as its own; copies
// of whole sealed groups move bytes; a copy that would split groups is refused; freed slots'
// open groups are forgotten.
TEST(KiviPool, CopiesCarryOpenGroupsAndDiscardFreesThem) {
  KvPool pool({kLayers, kHeads, kHeadDim, 128, DType::dtype_kivi2});
  write_slots(pool, 0, 41);
  pool.copy_slots(0, 64, 41);  // a copy-on-write of a block of 64 holding 41 tokens
  for (std::int64_t slot = 0; slot < 41; ++slot)
    for (const bool value : {false, true})
      EXPECT_EQ(read(pool, 1, slot, value), read(pool, 1, 64 + slot, value)) << slot;
  EXPECT_EQ(pool.open_group_bytes(), 2 * pool.bytes_per_open_group());
  write_slots(pool, 64 + 41, 128, -64);  // the copy's own tokens 41..63 seal its group
  EXPECT_EQ(pool.open_group_bytes(), pool.bytes_per_open_group());
  EXPECT_EQ(pool.open_row(0, 100, false), nullptr);
  const std::vector<float> worst = channel_errors(pool, 96, -64);  // tokens 32..63's group
  for (std::int64_t d = 0; d < kHeadDim; ++d)
    EXPECT_LE(worst[static_cast<std::size_t>(d)], channel_bound(96, -64, d, 3.0f)) << d;
  pool.discard_open_groups(32, 32);
  EXPECT_EQ(pool.open_group_bytes(), 0);
  test::expect_error_containing([&] { pool.copy_slots(0, 70, 8); },
                                {"internal", "groups of 32", "from slot 0 to 70"});
}

// A swap moves the sealed rows as stored and the open group's fp16 rows after them; swapping
// in elsewhere gives the same rows back, and the group goes on to seal.
TEST(KiviPool, SwapsCarryTheOpenGroup) {
  KvPool pool({kLayers, kHeads, kHeadDim, 128, DType::dtype_kivi4});
  write_slots(pool, 0, 41);
  const KvView view{{{0, 41}}, 0, {}};
  std::vector<std::byte> swapped;
  const std::int64_t row = pool.shape().slot_row_bytes(false);
  EXPECT_EQ(copy_kv_rows(pool, view, 0, 41, swapped, true),
            2 * kLayers * (32 * row + 9 * kWidth * 2));
  const KvView elsewhere{{{64, 41}}, 0, {}};
  copy_kv_rows(pool, elsewhere, 0, 41, swapped, false);
  for (std::int64_t slot = 0; slot < 41; ++slot)
    for (const bool value : {false, true})
      EXPECT_EQ(read(pool, 0, slot, value), read(pool, 0, 64 + slot, value)) << slot;
  ASSERT_NE(pool.open_row(0, 64 + 40, false), nullptr);
  // Positions 32.. of a swap-in whose first 32 the prefix cache serves: the tail comes along.
  std::vector<std::byte> part = swapped_positions_from(pool, swapped, 41, 32);
  const KvView third{{{96, 9}}, 32, {}};
  copy_kv_rows(pool, third, 32, 41, part, false);
  for (std::int64_t slot = 32; slot < 41; ++slot)
    EXPECT_EQ(read(pool, 1, slot, true), read(pool, 1, 64 + slot, true)) << slot;
}

// A freed block that stays in the prefix cache has its open groups sealed (a later hit reads its
// codes, within the bound of a sealed group); a freed block that nobody can find again forgets
// them.
TEST(KiviPool, FreedBlocksSealWhatThePrefixCacheKeepsAndForgetTheRest) {
  KvPool pool({kLayers, kHeads, kHeadDim, 128, DType::dtype_kivi2});
  PagedBlocks blocks(pool, 64, true);
  const BlockId cached = blocks.take(), plain = blocks.take();
  write_slots(pool, cached * 64, cached * 64 + 64, 0, false);
  write_slots(pool, plain * 64, plain * 64 + 40, 0, false);
  const std::vector<std::int32_t> tokens(64, 7);
  blocks.pool().register_prefix(cached, 12345, tokens);
  EXPECT_EQ(pool.open_group_bytes(), 4 * pool.bytes_per_open_group());
  blocks.release(cached);
  EXPECT_EQ(pool.open_group_bytes(), 2 * pool.bytes_per_open_group());  // the plain block's
  EXPECT_EQ(pool.open_row(0, cached * 64 + 63, false), nullptr);
  const std::vector<float> worst = channel_errors(pool, cached * 64);
  for (std::int64_t d = 0; d < kHeadDim; ++d)
    EXPECT_LE(worst[static_cast<std::size_t>(d)], channel_bound(cached * 64, 0, d, 3.0f)) << d;
  blocks.release(plain);
  EXPECT_EQ(pool.open_group_bytes(), 0);
}

// A kept row moved into another group (a KV policy's compaction): its values as they read,
// written into the destination's group, which reopens; the destination's other rows keep what
// they read (to fp16's rounding of it: 2^-11 relative), even a move to the same row of another
// group; the source group is untouched.
TEST(KiviPool, AMovedRowJoinsItsNewGroupAndLeavesTheOthers) {
  KvPool pool({kLayers, kHeads, kHeadDim, 64, DType::dtype_kivi2});
  write_slots(pool, 0, 64);  // two sealed groups
  std::vector<std::vector<float>> before;
  for (std::int64_t slot = 0; slot < 64; ++slot) before.push_back(read(pool, 1, slot, true));
  EXPECT_EQ(pool.move_slot(40, 8), pool.bytes_per_slot());  // row 8 of group 1 to row 8 of 0
  ASSERT_NE(pool.open_row(1, 8, true), nullptr);
  auto near = [](const std::vector<float>& a, const std::vector<float>& b, std::int64_t slot) {
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(a[i], b[i], std::fabs(b[i]) / 2048 + 1e-6f) << slot << " " << i;
  };
  near(read(pool, 1, 8, true), before[40], 8);
  for (std::int64_t slot = 0; slot < 32; ++slot)
    if (slot != 8) near(read(pool, 1, slot, true), before[static_cast<std::size_t>(slot)], slot);
  for (std::int64_t slot = 32; slot < 64; ++slot)
    EXPECT_EQ(read(pool, 1, slot, true), before[static_cast<std::size_t>(slot)]) << slot;
}

// A write into a sealed group (a recomputed token) reopens it with its rows dequantized.
TEST(KiviPool, AWriteIntoASealedGroupReopensIt) {
  KvPool pool({kLayers, kHeads, kHeadDim, 32, DType::dtype_kivi2});
  write_slots(pool, 0, 32);
  const std::vector<float> before = read(pool, 0, 7, false);
  pool.write_row(0, 20, false, row_of(0, 20, false).data());
  ASSERT_NE(pool.open_row(0, 7, false), nullptr);
  EXPECT_EQ(pool.open_row(1, 7, false), nullptr);  // layer 1 stays sealed
  const std::vector<float> reopened = read(pool, 0, 7, false);
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_EQ(reopened[i], half_of(before[i])) << i;
}

}  // namespace
}  // namespace kvlab
