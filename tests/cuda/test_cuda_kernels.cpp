// Correctness rung 3: every CUDA kernel against cpu_reference (or, for attention, an
// independent double-precision reference that is itself checked against cpu_reference here),
// over a grid of head_dim 64/128, group size 1/4/8, block size 1/16/32, and sequence lengths
// that are not multiples of the block, tile or split sizes; fp32 and bf16.
// Tolerances (outputs are O(1)): fp32 max abs 2e-5 (5e-5 for attention over 1,000 keys);
// bf16 max abs 1e-2, i.e. about one bf16 ulp (2^-8) of an O(1) value plus rounding of inputs
// that the reference sees rounded too. Every check also asserts no NaN and that guard regions
// around every output are untouched (no out-of-bounds writes).
// Without a GPU every device test skips with the probe's reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "cuda_test_util.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cuda/block_table.hpp"
#include "kvlab/engine/sampling.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using cuda::Dtype;
using test::GuardedBuffer;
using test::stored;

constexpr Dtype kDtypes[] = {Dtype::f32, Dtype::bf16};
const char* dtype_name(Dtype d) {
  return d == Dtype::f32 ? "f32" : "bf16";
}
double abs_tolerance(Dtype d) {
  return d == Dtype::f32 ? 2e-5 : 1e-2;
}

std::vector<float> random_values(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected,
                  double tolerance, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  const auto c = test::compare(actual, expected);
  EXPECT_FALSE(c.has_nan) << what;
  EXPECT_LE(c.max_abs, tolerance) << what << " (max rel " << c.max_rel << ")";
}

TEST(CudaKernels, EmbeddingGathersRowsExactly) {
  KVLAB_REQUIRE_CUDA();
  const std::int64_t vocab = 50, dim = 96, rows = 13;
  for (Dtype dtype : kDtypes) {
    const auto table = random_values(vocab * dim, 1);
    std::vector<std::int32_t> tokens(rows);
    for (std::int64_t r = 0; r < rows; ++r)
      tokens[r] = static_cast<std::int32_t>((r * 17 + 3) % vocab);
    GuardedBuffer d_table(table.size(), cuda::dtype_bytes(dtype)), d_tokens(rows, 4),
        d_out(rows * dim, 4);
    d_table.write(table, dtype);
    d_tokens.write_bytes(tokens.data(), tokens.size() * 4);
    ASSERT_EQ(cuda::launch_embedding({d_tokens.as<std::int32_t>(), d_table.get(), d_out.as<float>(),
                                      rows, dim, vocab, dtype},
                                     nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> expected;
    for (std::int32_t t : tokens)
      for (std::int64_t i = 0; i < dim; ++i) expected.push_back(stored(table[t * dim + i], dtype));
    expect_close(d_out.read(rows * dim, Dtype::f32), expected, 0.0, dtype_name(dtype));
    EXPECT_TRUE(d_out.guards_intact());
  }
}

// Greedy sampling on the device: each row's argmax, the lowest index on ties (the host
// Sampler's rule), -1 for a row holding NaN or inf; rows longer than the block, ties split
// across threads, a maximum in the last column.
TEST(CudaKernels, ArgmaxRowsPicksTheLowestIndexOfTheMaximumAndFlagsNonFinite) {
  KVLAB_REQUIRE_CUDA();
  const std::int64_t rows = 6, vocab = 1000;
  std::vector<float> logits = random_values(rows * vocab, 7);
  auto at = [&](std::int64_t r, std::int64_t i) -> float& { return logits[r * vocab + i]; };
  at(1, 700) = at(1, 300) = at(1, 301) = 5.0f;  // a tie: 300 wins, held by another thread
  at(2, vocab - 1) = 3.0f;                      // the last column
  at(3, 10) = std::numeric_limits<float>::quiet_NaN();
  at(4, 999) = std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < vocab; ++i) at(5, i) = -2.0f;  // all equal: index 0
  std::vector<std::int32_t> expected;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int32_t best = 0;
    for (std::int64_t i = 0; i < vocab; ++i) {
      if (!std::isfinite(at(r, i))) {
        best = -1;
        break;
      }
      if (at(r, i) > at(r, best)) best = static_cast<std::int32_t>(i);
    }
    expected.push_back(best);
  }
  ASSERT_EQ(expected[1], 300);
  GuardedBuffer d_logits(logits.size(), 4), d_out(rows, 4);
  d_logits.write(logits, Dtype::f32);
  ASSERT_EQ(cuda::launch_sample_rows(d_logits.as<float>(), rows, vocab, nullptr,
                                     d_out.as<std::int32_t>(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::int32_t> actual(rows);
  d_out.read_bytes(actual.data(), actual.size() * 4);
  EXPECT_EQ(actual, expected);
  EXPECT_TRUE(d_out.guards_intact());
  EXPECT_EQ(cuda::launch_sample_rows(d_logits.as<float>(), rows, 0, nullptr,
                                     d_out.as<std::int32_t>(), nullptr),
            cudaErrorInvalidValue);
}

// A block table maps every position of a view to the view's own slot, whatever its extents: one
// contiguous run, paged blocks with the first released in part (a window), interior runs whose
// lengths share only a small power of two, two runs, single slots. And it stays small: at most
// one entry per block the positions span plus one per extent.
TEST(BlockTable, EveryPositionFindsItsSlotInBlocksOfThePowerOfTwoTheExtentsShare) {
  struct Case {
    std::int64_t first_position;
    std::vector<KvExtent> extents;
    std::int32_t shift;  // the block the layout should choose
  };
  const std::vector<Case> cases = {
      {5, {{100, 37}}, 6},                                       // one run: one block
      {23, {{169, 9}, {32, 16}, {480, 16}, {64, 5}}, 4},         // paged 16, window-released
      {0, {{7, 3}, {200, 8}, {96, 24}, {40, 8}, {300, 30}}, 3},  // interior gcd 8
      {2, {{10, 5}, {60, 12}, {120, 12}, {500, 1}}, 2},          // interior 12: blocks of 4
      {0, {{50, 7}, {300, 100}}, 7},                             // two runs: one block each
      {9, {{4, 1}, {8, 1}, {2, 1}, {6, 1}}, 0},                  // single slots
  };
  for (const Case& c : cases) {
    KvView view;
    view.first_position = c.first_position;
    view.extents = c.extents;
    const cuda::BlockLayout layout = cuda::block_layout(view);
    EXPECT_EQ(layout.shift, c.shift) << "first position " << c.first_position;
    std::vector<std::int64_t> table = {-7};  // an earlier sequence's entry: offsets are relative
    cuda::append_block_table(view, layout, table);
    const std::int64_t block = std::int64_t{1} << layout.shift;
    for (std::int64_t p = view.first_position; p < view.end_position(); ++p) {
      const std::int64_t v = p - view.first_position + layout.lead;
      ASSERT_EQ(table[1 + static_cast<std::size_t>(v >> layout.shift)] + (v & (block - 1)),
                view.slot_of(p))
          << "position " << p << " of the view starting at " << c.first_position;
    }
    const auto blocks = static_cast<std::size_t>((layout.lead + view.length() + block - 1) / block);
    EXPECT_LE(table.size() - 1, blocks + c.extents.size());
  }
}

// One sampled row's setting and the host's pick for it.
struct SampleCase {
  SamplingParams params;
  double uniform = 0;
};

// The settings a row is sampled with: temperatures from near-greedy to flat, top-k and top-p
// each alone and together, draws at 0, mid-range, just below 1 and between the host
// distribution's cumulative boundaries (not on one: there the order of a sum decides).
std::vector<SampleCase> sample_cases(std::span<const float> row) {
  std::vector<SampleCase> cases;
  auto add = [&](double t, std::int32_t k, double p, double u) {
    SampleCase c;
    c.params.temperature = t;
    c.params.top_k = k;
    c.params.top_p = p;
    c.uniform = u;
    cases.push_back(c);
  };
  for (double t : {0.0, 1e-3, 0.7, 1.8})
    for (std::int32_t k : {0, 1, 50})
      for (double p : {1.0, 0.9, 1e-6})
        for (double u : {0.0, 0.37, 0.999999}) add(t, k, p, u);
  // Between consecutive boundaries of a spread-out distribution: every kept token gets drawn.
  SamplingParams spread;
  spread.temperature = 1.5;
  spread.top_k = 12;
  const std::vector<double> d = sampling_distribution(row, spread);
  std::vector<double> kept;
  for (double v : d)
    if (v > 0) kept.push_back(v);
  std::sort(kept.begin(), kept.end(), std::greater<>());
  double cumulative = 0;
  for (double v : kept) {
    add(spread.temperature, spread.top_k, 1.0, cumulative + v / 2);
    cumulative += v;
  }
  return cases;
}

// Sampling on the device picks the host's token (kvlab::pick_token) for every setting and draw,
// on rows longer than the block with ties split across threads, a flat row, and a row whose
// logits are far apart; greedy rows in the same launch take the argmax; a NaN row gives -1.
TEST(CudaKernels, SampleRowsPicksTheHostsTokenForEverySettingAndDraw) {
  KVLAB_REQUIRE_CUDA();
  constexpr std::int64_t kVocab = 2000;
  std::vector<std::vector<float>> rows;
  rows.push_back(random_values(kVocab, 11, 3.0f));
  rows.push_back(random_values(kVocab, 12, 3.0f));
  rows[1][700] = rows[1][300] = rows[1][1999] = 9.0f;  // a three-way tie at the top
  rows[1][5] = rows[1][6] = 8.5f;
  rows.push_back(std::vector<float>(kVocab, 0.25f));  // flat: ties everywhere
  rows.push_back(random_values(kVocab, 13, 40.0f));   // near one-hot at temperature 1
  std::vector<float> logits;
  std::vector<cuda::RowSampling> choices;
  std::vector<std::int32_t> expected;
  for (const auto& row : rows)
    for (const SampleCase& c : sample_cases(row)) {
      logits.insert(logits.end(), row.begin(), row.end());
      choices.push_back({c.params.temperature, c.params.top_p, c.uniform, c.params.top_k});
      expected.push_back(pick_token(row, c.params, c.uniform));
    }
  logits.insert(logits.end(), rows[0].begin(), rows[0].end());
  logits[logits.size() - 17] = std::numeric_limits<float>::quiet_NaN();
  choices.push_back({1.0, 0.9, 0.5, 0});
  expected.push_back(-1);
  const auto count = static_cast<std::int64_t>(choices.size());
  GuardedBuffer d_logits(logits.size(), 4),
      d_choices(choices.size() * sizeof(cuda::RowSampling), 1),
      d_out(static_cast<std::size_t>(count), 4);
  d_logits.write(logits, Dtype::f32);
  d_choices.write_bytes(choices.data(), choices.size() * sizeof(cuda::RowSampling));
  ASSERT_EQ(cuda::launch_sample_rows(d_logits.as<float>(), count, kVocab,
                                     d_choices.as<cuda::RowSampling>(), d_out.as<std::int32_t>(),
                                     nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::int32_t> actual(static_cast<std::size_t>(count));
  d_out.read_bytes(actual.data(), actual.size() * 4);
  for (std::size_t r = 0; r < actual.size(); ++r)
    ASSERT_EQ(actual[r], expected[r])
        << "row " << r << ": temperature " << choices[r].temperature << ", top_k "
        << choices[r].top_k << ", top_p " << choices[r].top_p << ", draw " << choices[r].uniform;
  EXPECT_TRUE(d_out.guards_intact());
  // The cases reach far into the distribution: more than a handful of distinct tokens.
  std::vector<std::int32_t> distinct = expected;
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 20);
}

// Log-probabilities on the device are the host's (kvlab::token_logprob / top_logprobs over the
// same row, to 1e-6: both sum exp in double, the device's exp may differ in its last bit): on
// rows longer than the block, with a three-way tie at the top (the lower ids first), a flat row
// (ids in order), counts of 0, 1, 20 and -1 (none asked), a NaN row, and a vocabulary smaller
// than the count (the rest {-1, NaN}).
TEST(CudaKernels, RowLogprobsAreTheHostsForTheChosenAndTheTopTokens) {
  KVLAB_REQUIRE_CUDA();
  constexpr std::int64_t kVocab = 2000;
  constexpr int kWidth = 1 + kMaxLogprobs;
  std::vector<std::vector<float>> rows;
  rows.push_back(random_values(kVocab, 21, 3.0f));
  rows.push_back(random_values(kVocab, 22, 3.0f));
  rows[1][700] = rows[1][300] = rows[1][1999] = 9.0f;
  rows.push_back(std::vector<float>(kVocab, 0.25f));
  rows.push_back(random_values(kVocab, 23, 40.0f));
  rows.push_back(random_values(kVocab, 24, 3.0f));
  rows.push_back(random_values(kVocab, 25, 3.0f));
  rows[5][17] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::int32_t> counts = {20, 5, 3, 1, -1, 4};
  const std::vector<std::int32_t> chosen = {1234, 1999, 0, 77, 5, 6};
  std::vector<float> logits;
  for (const auto& row : rows) logits.insert(logits.end(), row.begin(), row.end());
  const auto count = static_cast<std::int64_t>(rows.size());
  GuardedBuffer d_logits(logits.size(), 4), d_chosen(chosen.size(), 4), d_counts(counts.size(), 4),
      d_out(static_cast<std::size_t>(count * kWidth), sizeof(cuda::LogprobEntry));
  d_logits.write(logits, Dtype::f32);
  d_chosen.write_bytes(chosen.data(), chosen.size() * 4);
  d_counts.write_bytes(counts.data(), counts.size() * 4);
  ASSERT_EQ(cuda::launch_row_logprobs(d_logits.as<float>(), count, kVocab,
                                      d_chosen.as<std::int32_t>(), d_counts.as<std::int32_t>(),
                                      kWidth, d_out.as<cuda::LogprobEntry>(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<cuda::LogprobEntry> out(static_cast<std::size_t>(count * kWidth));
  d_out.read_bytes(out.data(), out.size() * sizeof(cuda::LogprobEntry));
  EXPECT_TRUE(d_out.guards_intact());
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const cuda::LogprobEntry* o = out.data() + r * kWidth;
    if (counts[r] < 0 || r == 5) {  // none asked; a NaN row
      for (int j = 0; j < kWidth; ++j) {
        EXPECT_EQ(o[j].token, -1) << "row " << r;
        EXPECT_TRUE(std::isnan(o[j].logprob)) << "row " << r;
      }
      continue;
    }
    EXPECT_EQ(o[0].token, chosen[r]);
    EXPECT_NEAR(o[0].logprob, token_logprob(rows[r], chosen[r]), 1e-6) << "row " << r;
    const auto top = top_logprobs(rows[r], counts[r]);
    for (int j = 1; j < kWidth; ++j) {
      if (j > counts[r]) {
        EXPECT_EQ(o[j].token, -1) << "row " << r << " rank " << j;
        continue;
      }
      EXPECT_EQ(o[j].token, top[static_cast<std::size_t>(j - 1)].token) << "row " << r;
      EXPECT_NEAR(o[j].logprob, top[static_cast<std::size_t>(j - 1)].logprob, 1e-6);
    }
  }
  EXPECT_EQ(out[kWidth + 1].token, 300);  // the tie: lower ids first
  EXPECT_EQ(out[kWidth + 2].token, 700);
  EXPECT_EQ(out[kWidth + 3].token, 1999);
  EXPECT_EQ(out[2 * kWidth + 3].token, 2);  // flat: ids in order
  // A 5-token vocabulary asked for 8: five, then {-1, NaN}.
  const std::vector<float> tiny = {0.5f, -1.0f, 2.0f, 2.0f, 0.0f};
  const std::int32_t eight = 8, two = 2;
  GuardedBuffer d_tiny(tiny.size(), 4), d_eight(1, 4), d_two(1, 4), d_few(9, 8);
  d_tiny.write(tiny, Dtype::f32);
  d_eight.write_bytes(&eight, 4);
  d_two.write_bytes(&two, 4);
  ASSERT_EQ(cuda::launch_row_logprobs(d_tiny.as<float>(), 1, 5, d_two.as<std::int32_t>(),
                                      d_eight.as<std::int32_t>(), 9, d_few.as<cuda::LogprobEntry>(),
                                      nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<cuda::LogprobEntry> few(9);
  d_few.read_bytes(few.data(), few.size() * sizeof(cuda::LogprobEntry));
  const std::vector<std::int32_t> order = {2, 2, 3, 0, 4, 1, -1, -1, -1};
  for (std::size_t j = 0; j < few.size(); ++j) EXPECT_EQ(few[j].token, order[j]) << j;
  EXPECT_NEAR(few[0].logprob, token_logprob(tiny, 2), 1e-6);
  EXPECT_TRUE(std::isnan(few[8].logprob));
}

TEST(CudaKernels, RmsNormMatchesTheReference) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (std::int64_t dim : {64, 288, 4096}) {
      const std::int64_t rows = 7, stride = dim + 8;  // rows of x are padded: stride is honoured
      const auto x_padded = random_values(rows * stride, 2, 3.0f);
      const auto weight = random_values(dim, 3);
      cpu::RowMatrix x(rows, dim);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t i = 0; i < dim; ++i) x(r, i) = x_padded[r * stride + i];
      const Eigen::VectorXf w = Eigen::Map<const Eigen::VectorXf>(weight.data(), dim);
      cpu::RowMatrix expected;
      cpu::rms_norm(x, w, 1e-5f, expected);
      GuardedBuffer d_x(x_padded.size(), 4), d_w(dim, 4),
          d_out(rows * dim, cuda::dtype_bytes(dtype));
      d_x.write(x_padded, Dtype::f32);
      d_w.write(weight, Dtype::f32);
      ASSERT_EQ(cuda::launch_rms_norm({d_x.as<float>(), stride, d_w.as<float>(), d_out.get(), rows,
                                       dim, 1e-5f, dtype},
                                      nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> want(expected.data(), expected.data() + expected.size());
      // |out| <= ~5: fp32 a few ulps; bf16 one ulp of 5 is 0.03.
      expect_close(d_out.read(rows * dim, dtype), want, dtype == Dtype::f32 ? 2e-5 : 4e-2,
                   std::string(dtype_name(dtype)) + " dim " + std::to_string(dim));
      EXPECT_TRUE(d_out.guards_intact());
    }
}

// The CPU reference's cos and sin as the kernels read them: (max_positions, head_dim / 2) each.
std::pair<std::vector<float>, std::vector<float>> rope_tables(const cpu::RopeTable& rope,
                                                              std::int64_t head_dim,
                                                              std::int64_t max_positions) {
  std::vector<float> cos, sin;
  for (std::int64_t p = 0; p < max_positions; ++p)
    for (std::int64_t i = 0; i < head_dim / 2; ++i) {
      cos.push_back(rope.cos(p, i));
      sin.push_back(rope.sin(p, i));
    }
  return {cos, sin};
}

// RoPE on Q in place and on K into the pool, V into the pool, in one launch: Q and K rotated as
// the CPU reference rotates them, V copied exactly into each row's slot, every other slot and
// qkv's K/V and padding columns left alone.
TEST(CudaKernels, RopeKvWriteRotatesQInPlaceAndWritesRotatedKAndVIntoTheirSlots) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (std::int64_t head_dim : {64, 128}) {
      const std::int64_t rows = 9, heads = 4, kv_heads = 2, q_dim = heads * head_dim,
                         kv_dim = kv_heads * head_dim, stride = q_dim + 2 * kv_dim + 32,
                         max_positions = 512, slots = 20;
      const cpu::RopeTable rope(head_dim, 10000.0, max_positions);
      const auto [cos, sin] = rope_tables(rope, head_dim, max_positions);
      std::vector<std::int32_t> positions(rows);
      for (std::int64_t r = 0; r < rows; ++r)
        positions[r] = static_cast<std::int32_t>((r * 97 + 5) % max_positions);
      const std::vector<std::int64_t> where{7, 0, 19, 3, 12, 8, 15, 1, 10};
      auto values = random_values(rows * stride, 4);
      for (auto& v : values) v = stored(v, dtype);
      cpu::RowMatrix q(rows, q_dim), k(rows, kv_dim);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t i = 0; i < q_dim; ++i) q(r, i) = values[r * stride + i];
        for (std::int64_t i = 0; i < kv_dim; ++i) k(r, i) = values[r * stride + q_dim + i];
      }
      rope.apply(q, positions, heads);
      rope.apply(k, positions, kv_heads);
      const std::size_t e = cuda::dtype_bytes(dtype);
      GuardedBuffer d_x(values.size(), e), d_pos(rows, 4), d_cos(cos.size(), 4),
          d_sin(sin.size(), 4), d_slots(rows, 8), k_pool(slots * kv_dim, e),
          v_pool(slots * kv_dim, e);
      d_x.write(values, dtype);
      d_pos.write_bytes(positions.data(), positions.size() * 4);
      d_cos.write(cos, Dtype::f32);
      d_sin.write(sin, Dtype::f32);
      d_slots.write_bytes(where.data(), where.size() * 8);
      const std::vector<float> zeros(slots * kv_dim, 0.0f);
      k_pool.write(zeros, dtype);
      v_pool.write(zeros, dtype);
      ASSERT_EQ(cuda::launch_rope_kv_write(
                    {d_x.get(), stride, d_pos.as<std::int32_t>(), d_cos.as<float>(),
                     d_sin.as<float>(), d_slots.as<std::int64_t>(), k_pool.get(), v_pool.get(),
                     rows, heads, kv_heads, head_dim, dtype},
                    nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto out = d_x.read(values.size(), dtype);
      const auto kp = k_pool.read(slots * kv_dim, dtype), vp = v_pool.read(slots * kv_dim, dtype);
      std::vector<float> got, want;
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t i = 0; i < q_dim; ++i) {
          got.push_back(out[r * stride + i]);
          want.push_back(q(r, i));
        }
        for (std::int64_t i = 0; i < kv_dim; ++i) {
          got.push_back(kp[where[r] * kv_dim + i]);
          want.push_back(k(r, i));
          ASSERT_EQ(vp[where[r] * kv_dim + i], values[r * stride + q_dim + kv_dim + i]);
        }
        for (std::int64_t i = q_dim; i < stride; ++i)  // K, V and padding columns: untouched
          ASSERT_EQ(out[r * stride + i], values[r * stride + i]) << "column " << i;
      }
      expect_close(got, want, abs_tolerance(dtype),
                   std::string(dtype_name(dtype)) + " hd " + std::to_string(head_dim));
      for (std::int64_t s = 0; s < slots; ++s)
        if (std::find(where.begin(), where.end(), s) == where.end())
          for (std::int64_t i = 0; i < kv_dim; ++i) {
            ASSERT_EQ(kp[s * kv_dim + i], 0.0f) << "slot " << s;
            ASSERT_EQ(vp[s * kv_dim + i], 0.0f) << "slot " << s;
          }
      EXPECT_TRUE(d_x.guards_intact());
      EXPECT_TRUE(k_pool.guards_intact());
      EXPECT_TRUE(v_pool.guards_intact());
      EXPECT_EQ(
          cuda::launch_rope_kv_write({d_x.get(), q_dim, d_pos.as<std::int32_t>(), d_cos.as<float>(),
                                      d_sin.as<float>(), d_slots.as<std::int64_t>(), k_pool.get(),
                                      v_pool.get(), rows, heads, kv_heads, head_dim, dtype},
                                     nullptr),
          cudaErrorInvalidValue);  // rows too narrow for Q, K and V
    }
}

// The residual add fused into the next RMSNorm computes what the two launches compute, bit for
// bit: the residual stream and the normed rows.
TEST(CudaKernels, AddRmsNormEqualsTheResidualAddThenTheRmsNorm) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (std::int64_t dim : {64, 288, 4096}) {
      const std::int64_t rows = 5;
      const auto x = random_values(rows * dim, 21, 3.0f), weight = random_values(dim, 22);
      auto y = random_values(rows * dim, 23, 2.0f);
      for (auto& v : y) v = stored(v, dtype);
      const std::size_t e = cuda::dtype_bytes(dtype);
      GuardedBuffer x_fused(x.size(), 4), x_apart(x.size(), 4), d_y(y.size(), e), d_w(dim, 4),
          out_fused(rows * dim, e), out_apart(rows * dim, e);
      x_fused.write(x, Dtype::f32);
      x_apart.write(x, Dtype::f32);
      d_y.write(y, dtype);
      d_w.write(weight, Dtype::f32);
      ASSERT_EQ(cuda::launch_add_rms_norm({x_fused.as<float>(), d_y.get(), d_w.as<float>(),
                                           out_fused.get(), rows, dim, 1e-5f, dtype},
                                          nullptr),
                cudaSuccess);
      ASSERT_EQ(
          cuda::launch_residual_add({x_apart.as<float>(), d_y.get(), rows, dim, dtype}, nullptr),
          cudaSuccess);
      ASSERT_EQ(cuda::launch_rms_norm({x_apart.as<float>(), dim, d_w.as<float>(), out_apart.get(),
                                       rows, dim, 1e-5f, dtype},
                                      nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::string what = std::string(dtype_name(dtype)) + " dim " + std::to_string(dim);
      const auto fused = x_fused.read(x.size(), Dtype::f32);
      EXPECT_EQ(fused, x_apart.read(x.size(), Dtype::f32)) << what;
      for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(fused[i], x[i] + y[i]) << what;
      EXPECT_EQ(out_fused.read(rows * dim, dtype), out_apart.read(rows * dim, dtype)) << what;
      EXPECT_TRUE(x_fused.guards_intact());
      EXPECT_TRUE(out_fused.guards_intact());
    }
}

TEST(CudaKernels, SwiGluAndResidualAddMatchTheFormula) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes) {
    const std::int64_t rows = 5, ffn = 176;
    auto gate_up = random_values(rows * 2 * ffn, 5, 4.0f);
    for (auto& v : gate_up) v = stored(v, dtype);
    std::vector<float> expected(rows * ffn);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < ffn; ++i) {
        const double g = gate_up[r * 2 * ffn + i], u = gate_up[r * 2 * ffn + ffn + i];
        expected[r * ffn + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
      }
    GuardedBuffer d_in(gate_up.size(), cuda::dtype_bytes(dtype)),
        d_out(rows * ffn, cuda::dtype_bytes(dtype));
    d_in.write(gate_up, dtype);
    ASSERT_EQ(cuda::launch_swiglu({d_in.get(), d_out.get(), rows, ffn, dtype}, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // |out| <= ~16: fp32 relative 1e-6 -> 2e-5 abs; bf16 one ulp of 16 is 0.125.
    expect_close(d_out.read(rows * ffn, dtype), expected, dtype == Dtype::f32 ? 2e-5 : 1.3e-1,
                 std::string("swiglu ") + dtype_name(dtype));
    EXPECT_TRUE(d_out.guards_intact());

    const auto x = random_values(rows * ffn, 6);
    auto y = random_values(rows * ffn, 7);
    for (auto& v : y) v = stored(v, dtype);
    GuardedBuffer d_x(x.size(), 4), d_y(y.size(), cuda::dtype_bytes(dtype));
    d_x.write(x, Dtype::f32);
    d_y.write(y, dtype);
    ASSERT_EQ(cuda::launch_residual_add({d_x.as<float>(), d_y.get(), rows, ffn, dtype}, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> sum(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + y[i];
    expect_close(d_x.read(x.size(), Dtype::f32), sum, 0.0, "residual add");  // the same fp32 add
    EXPECT_TRUE(d_x.guards_intact());
  }
}

TEST(CudaKernels, SlotRowsGatherAndScatterWholeSlotsOfEveryLayer) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes) {
    const std::int64_t layers = 3, slots = 40, kv_dim = 24, layer_elements = slots * kv_dim;
    const std::size_t e = cuda::dtype_bytes(dtype);
    auto k = random_values(layers * layer_elements, 10),
         v = random_values(layers * layer_elements, 11);
    for (auto* values : {&k, &v})
      for (auto& x : *values) x = stored(x, dtype);
    const std::vector<std::int64_t> where{33, 2, 17, 39, 0};
    const auto count = static_cast<std::int64_t>(where.size());
    GuardedBuffer k_pool(k.size(), e), v_pool(v.size(), e), d_slots(where.size(), 8),
        packed(layers * 2 * count * kv_dim, e);
    k_pool.write(k, dtype);
    v_pool.write(v, dtype);
    d_slots.write_bytes(where.data(), where.size() * 8);
    cuda::SlotRowsParams p;
    p.k_pool = k_pool.get();
    p.v_pool = v_pool.get();
    p.layer_bytes = layer_elements * static_cast<std::int64_t>(e);
    p.layers = layers;
    p.slots = d_slots.as<std::int64_t>();
    p.count = count;
    p.row_bytes = kv_dim * static_cast<std::int64_t>(e);
    p.packed = packed.get();
    ASSERT_EQ(cuda::launch_copy_slot_rows(p, nullptr), cudaSuccess);  // gather
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = packed.read(layers * 2 * count * kv_dim, dtype);
    for (std::int64_t l = 0; l < layers; ++l)
      for (int kv = 0; kv < 2; ++kv)
        for (std::int64_t i = 0; i < count; ++i)
          for (std::int64_t d = 0; d < kv_dim; ++d)
            ASSERT_EQ(got[((l * 2 + kv) * count + i) * kv_dim + d],
                      (kv == 0 ? k : v)[l * layer_elements + where[i] * kv_dim + d])
                << "layer " << l << " kv " << kv << " slot " << where[i];
    EXPECT_TRUE(packed.guards_intact());

    // Scatter the packed rows into zeroed pools: exactly those slots of every layer change.
    const std::vector<float> zeros(k.size(), 0.0f);
    k_pool.write(zeros, dtype);
    v_pool.write(zeros, dtype);
    p.to_pool = true;
    ASSERT_EQ(cuda::launch_copy_slot_rows(p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto kp = k_pool.read(k.size(), dtype), vp = v_pool.read(v.size(), dtype);
    for (std::int64_t l = 0; l < layers; ++l)
      for (std::int64_t s = 0; s < slots; ++s) {
        const bool moved = std::find(where.begin(), where.end(), s) != where.end();
        for (std::int64_t d = 0; d < kv_dim; ++d) {
          const std::int64_t at = l * layer_elements + s * kv_dim + d;
          ASSERT_EQ(kp[at], moved ? k[at] : 0.0f) << "layer " << l << " slot " << s;
          ASSERT_EQ(vp[at], moved ? v[at] : 0.0f) << "layer " << l << " slot " << s;
        }
      }
    EXPECT_TRUE(k_pool.guards_intact());
    EXPECT_TRUE(v_pool.guards_intact());
  }
}

// ---- attention ----

// Double-precision attention of the queries at [start, start + n) of one sequence.
// q: (n, heads * hd); k, v: (L, kv_heads * hd) for positions [0, L); window 0 = none.
std::vector<double> reference_attention(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, std::int64_t heads,
                                        std::int64_t kv_heads, std::int64_t hd, std::int64_t start,
                                        std::int64_t n, std::int64_t window) {
  std::vector<double> out(n * heads * hd, 0.0);
  const std::int64_t group = heads / kv_heads, kv_width = kv_heads * hd;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t position = start + i;
    const std::int64_t lo = window > 0 ? std::max<std::int64_t>(0, position - window + 1) : 0;
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t g = h / group;
      std::vector<double> scores;
      double max_score = -1e300;
      for (std::int64_t j = lo; j <= position; ++j) {
        double dot = 0;
        for (std::int64_t d = 0; d < hd; ++d)
          dot += static_cast<double>(q[(i * heads + h) * hd + d]) * k[j * kv_width + g * hd + d];
        scores.push_back(dot / std::sqrt(static_cast<double>(hd)));
        max_score = std::max(max_score, scores.back());
      }
      double total = 0;
      for (auto& s : scores) total += (s = std::exp(s - max_score));
      for (std::int64_t j = lo; j <= position; ++j)
        for (std::int64_t d = 0; d < hd; ++d)
          out[(i * heads + h) * hd + d] += scores[j - lo] / total * v[j * kv_width + g * hd + d];
    }
  }
  return out;
}

TEST(CudaAttentionReference, EqualsCpuReferenceCausalAttention) {  // runs without a GPU
  const std::int64_t heads = 4, kv_heads = 2, hd = 16, length = 23, window = 7;
  const auto q = random_values(length * heads * hd, 10),
             k = random_values(length * kv_heads * hd, 11),
             v = random_values(length * kv_heads * hd, 12);
  for (std::int64_t w : {std::int64_t{0}, window}) {
    cpu::RowMatrix out;
    cpu::causal_attention(Eigen::Map<const cpu::RowMatrix>(q.data(), length, heads * hd),
                          Eigen::Map<const cpu::RowMatrix>(k.data(), length, kv_heads * hd),
                          Eigen::Map<const cpu::RowMatrix>(v.data(), length, kv_heads * hd), heads,
                          kv_heads, w > 0 ? std::optional<std::int64_t>(w) : std::nullopt, out);
    const auto mine = reference_attention(q, k, v, heads, kv_heads, hd, 0, length, w);
    double max_abs = 0;
    for (std::int64_t i = 0; i < out.size(); ++i)
      max_abs = std::max(max_abs, std::abs(mine[i] - out.data()[i]));
    EXPECT_LT(max_abs, 1e-5) << "window " << w;
  }
}

TEST(CudaAttention, OnlyInstantiatedHeadDimsAreAccepted) {  // host-only: runs without a GPU
  for (std::int64_t hd : {16, 32, 48, 64, 80, 96, 128, 256})
    EXPECT_TRUE(cuda::attention_supports(hd)) << hd;
  for (std::int64_t hd : {8, 40, 100, 512}) EXPECT_FALSE(cuda::attention_supports(hd)) << hd;
}

TEST(CudaAttention, LaunchesItCannotRunAreRefusedBeforeTouchingMemory) {
  KVLAB_REQUIRE_CUDA();
  cuda::AttentionParams p;  // null pointers: a refused launch must not read them
  p.entry_count = 4;
  p.heads = 8;
  p.kv_heads = 2;
  p.head_dim = 40;  // not instantiated
  EXPECT_EQ(cuda::launch_attention(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 64;
  p.kv_heads = 3;  // 8 query heads do not split over 3 K/V heads
  EXPECT_EQ(cuda::launch_attention(p, nullptr), cudaErrorInvalidValue);
  p.kv_heads = 2;
  p.split_keys = 0;
  EXPECT_EQ(cuda::launch_attention(p, nullptr), cudaErrorInvalidValue);
  p.split_keys = 256;
  p.entry_count = 65536;  // the decode grid's y dimension holds 65,535
  EXPECT_EQ(cuda::launch_attention(p, nullptr), cudaErrorInvalidValue);
  p.entry_count = 0;  // nothing to do
  EXPECT_EQ(cuda::launch_attention(p, nullptr), cudaSuccess);
}

// The host pool's dtype of a device KV format, and a head row in it.
DType host_dtype(cuda::KvFormat format) {
  return format == cuda::KvFormat::fp8_e4m3 ? DType::dtype_f8_e4m3 : DType::dtype_kv_int8;
}
std::vector<std::byte> host_row(cuda::KvFormat format, std::span<const float> values) {
  const DType dtype = host_dtype(format);
  std::vector<std::byte> row(
      static_cast<std::size_t>(dtype_row_bytes(dtype, static_cast<std::int64_t>(values.size()))));
  convert_from_f32(dtype, values, row);
  return row;
}

// Values where fp8 and int8 rounding decide: ties between two e4m3 codes (to the even one),
// subnormals and the subnormal/normal boundary, saturation at 448, negative zero, NaN, infinity.
const float kRoundingCases[] = {
    1.0625f,  1.1875f, -1.3125f, 3 * 0x1p-10f, 5 * 0x1p-10f, 0x1p-6f - 0x1p-11f,
    0x1p-12f, 447.9f,  460.0f,   500.0f,       -1e6f,        -0.0f,
    0.0f,     240.0f,  -15.5f};

// RoPE with the K/V write into fp8 and int8 pools: each V head row holds exactly the bytes the
// host pool's rounding gives it (kvlab::convert_from_f32), rounding cases included, and each K
// row those of its rotated fp32 values (the K heads are given the values of Q heads, which the
// kernel rotates in place with the same arithmetic, so their rotation is read back); other slots
// and the guard regions stay untouched; head_dim over 256 is refused.
TEST(CudaKernels, RopeKvWriteQuantizesKAndVRowsAsTheHostPoolDoes) {
  KVLAB_REQUIRE_CUDA();
  for (cuda::KvFormat format : {cuda::KvFormat::fp8_e4m3, cuda::KvFormat::int8})
    for (std::int64_t head_dim : {64, 256}) {
      const std::int64_t rows = 5, heads = 4, kv_heads = 2, q_dim = heads * head_dim,
                         kv_dim = kv_heads * head_dim, stride = q_dim + 2 * kv_dim,
                         max_positions = 64, slots = 12;
      const std::int64_t row_bytes = cuda::kv_row_bytes(format, Dtype::f32, head_dim);
      const cpu::RopeTable rope(head_dim, 10000.0, max_positions);
      const auto [cos, sin] = rope_tables(rope, head_dim, max_positions);
      const std::vector<std::int32_t> positions{3, 0, 63, 17, 40};
      const std::vector<std::int64_t> where{7, 0, 11, 3, 9};
      auto values = random_values(rows * stride, 8, 4.0f);
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = values.data() + r * stride;
        std::copy_n(row, kv_dim, row + q_dim);  // K heads = Q heads 0 and 1
        float* v = row + q_dim + kv_dim;
        for (std::size_t i = 0; i < std::size(kRoundingCases); ++i) v[i * 3] = kRoundingCases[i];
        if (r == 1) v[1] = std::numeric_limits<float>::quiet_NaN();
        if (r == 2)
          v[head_dim + 5] = std::numeric_limits<float>::infinity();  // a whole row's scale
      }
      GuardedBuffer d_x(values.size(), 4), d_pos(rows, 4), d_cos(cos.size(), 4),
          d_sin(sin.size(), 4), d_slots(rows, 8), k_pool(slots * kv_heads * row_bytes, 1),
          v_pool(slots * kv_heads * row_bytes, 1);
      d_x.write(values, Dtype::f32);
      d_pos.write_bytes(positions.data(), positions.size() * 4);
      d_cos.write(cos, Dtype::f32);
      d_sin.write(sin, Dtype::f32);
      d_slots.write_bytes(where.data(), where.size() * 8);
      const std::vector<std::byte> zeros(slots * kv_heads * row_bytes);
      k_pool.write_bytes(zeros.data(), zeros.size());
      v_pool.write_bytes(zeros.data(), zeros.size());
      cuda::RopeKvWriteParams p{d_x.get(),
                                stride,
                                d_pos.as<std::int32_t>(),
                                d_cos.as<float>(),
                                d_sin.as<float>(),
                                d_slots.as<std::int64_t>(),
                                k_pool.get(),
                                v_pool.get(),
                                rows,
                                heads,
                                kv_heads,
                                head_dim,
                                Dtype::f32,
                                format};
      ASSERT_EQ(cuda::launch_rope_kv_write(p, nullptr), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto rotated = d_x.read(values.size(), Dtype::f32);
      std::vector<std::byte> kp(zeros.size()), vp(zeros.size());
      k_pool.read_bytes(kp.data(), kp.size());
      v_pool.read_bytes(vp.data(), vp.size());
      const std::string what =
          std::string(dtype_short_name(host_dtype(format))) + " hd " + std::to_string(head_dim);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t h = 0; h < kv_heads; ++h) {
          const std::span<const float> k(rotated.data() + r * stride + h * head_dim, head_dim);
          const std::span<const float> v(values.data() + r * stride + q_dim + kv_dim + h * head_dim,
                                         head_dim);
          const auto at = static_cast<std::ptrdiff_t>((where[r] * kv_heads + h) * row_bytes);
          EXPECT_TRUE(
              std::equal(kp.begin() + at, kp.begin() + at + row_bytes, host_row(format, k).begin()))
              << what << " K row " << r << " head " << h;
          EXPECT_TRUE(
              std::equal(vp.begin() + at, vp.begin() + at + row_bytes, host_row(format, v).begin()))
              << what << " V row " << r << " head " << h;
        }
      for (std::int64_t s = 0; s < slots; ++s) {
        if (std::find(where.begin(), where.end(), s) != where.end()) continue;
        for (std::int64_t b = 0; b < kv_heads * row_bytes; ++b)
          ASSERT_EQ(kp[s * kv_heads * row_bytes + b], std::byte{0}) << what << " slot " << s;
      }
      EXPECT_TRUE(k_pool.guards_intact()) << what;
      EXPECT_TRUE(v_pool.guards_intact()) << what;
      p.head_dim = 512;
      p.row_stride = (heads + 2 * kv_heads) * 512;
      EXPECT_EQ(cuda::launch_rope_kv_write(p, nullptr), cudaErrorInvalidValue) << what;
    }
}

struct SequenceCase {
  std::int64_t start;    // cached tokens before the queries
  std::int64_t queries;  // 1 = decode
};

// How a case's launch names its prefill entries (AttentionParams::prefill_entries).
enum class PrefillList {
  listed,         // the entries with more than one query, as the backend lists them
  none,           // no list: the prefill grid covers every entry
  last_left_out,  // the list leaves out the last such entry: its rows must stay unwritten
};

struct AttentionCase {
  std::int64_t head_dim, group, block, window;
  Dtype dtype;
  bool unaligned_pools = false;  // K/V pools one element off 16 bytes: the scalar decode kernel
  bool tensor_cores = true;      // AttentionParams::tensor_cores
  float query_scale = 1.0f;      // > 1: peaked softmax, whose splits' maxima differ widely
  PrefillList prefill_list = PrefillList::listed;
  cuda::KvFormat kv_format = cuda::KvFormat::compute;  // quantized: the reference reads it back
};

// Each head row of `values` (rows of head_dim) rounded to the format and read back as fp32.
void round_trip_rows(cuda::KvFormat format, std::int64_t head_dim, std::vector<float>& values) {
  for (std::size_t at = 0; at < values.size(); at += static_cast<std::size_t>(head_dim)) {
    const std::span<float> row(values.data() + at, static_cast<std::size_t>(head_dim));
    convert_to_f32(host_dtype(format), host_row(format, row), row);
  }
}
// A pool of fp32 rows as the device stores it in a quantized format.
std::vector<std::byte> quantized_pool(cuda::KvFormat format, std::int64_t head_dim,
                                      const std::vector<float>& values) {
  std::vector<std::byte> bytes;
  for (std::size_t at = 0; at < values.size(); at += static_cast<std::size_t>(head_dim)) {
    const auto row = host_row(format, {values.data() + at, static_cast<std::size_t>(head_dim)});
    bytes.insert(bytes.end(), row.begin(), row.end());
  }
  return bytes;
}

// The prefill entries a case's launch lists, and the one it leaves out (-1: none).
std::pair<std::vector<std::int32_t>, std::int64_t> prefill_list(
    const AttentionCase& c, const std::vector<cuda::AttentionEntry>& entries) {
  std::vector<std::int32_t> listed;
  for (std::size_t e = 0; e < entries.size(); ++e)
    if (entries[e].queries > 1) listed.push_back(static_cast<std::int32_t>(e));
  std::int64_t left_out = -1;
  if (c.prefill_list == PrefillList::last_left_out && !listed.empty()) {
    left_out = listed.back();
    listed.pop_back();
  }
  return {listed, left_out};
}

// The host side of an attention case: pools holding every sequence's K/V in blocks shuffled
// across them, the fused QKV rows of the queries, one entry (and block table) per sequence, and
// the double-precision reference outputs.
struct AttentionInputs {
  std::int64_t heads = 0, kv_heads = 2;
  std::vector<float> k_pool, v_pool, q_rows;
  std::vector<std::int64_t> block_table;
  std::vector<cuda::AttentionEntry> entries;
  std::vector<std::vector<double>> expected;
  std::int64_t rows = 0, max_keys = 0, max_queries = 0;
};

// Sequence s's entry: its view as a paged allocator of block c.block hands it out (from
// `first`, whole blocks released before it), blocks physical[0..), block table appended.
cuda::AttentionEntry paged_entry(const AttentionCase& c, const SequenceCase& s, std::int64_t first,
                                 const std::int64_t* physical, AttentionInputs& in) {
  const std::int64_t length = s.start + s.queries;
  cuda::AttentionEntry a;
  a.first_row = static_cast<std::int32_t>(in.rows);
  a.queries = static_cast<std::int32_t>(s.queries);
  a.start_position = static_cast<std::int32_t>(s.start);
  a.first_position = static_cast<std::int32_t>(first);
  KvView view;
  view.first_position = first;
  for (std::int64_t b = first / c.block; b < (length + c.block - 1) / c.block; ++b)
    view.extents.push_back({physical[b] * c.block, std::min(c.block, length - b * c.block)});
  const cuda::BlockLayout layout = cuda::block_layout(view);
  a.block_shift = layout.shift;
  a.lead = layout.lead;
  a.table_offset = static_cast<std::int64_t>(in.block_table.size());
  cuda::append_block_table(view, layout, in.block_table);
  return a;
}

AttentionInputs attention_inputs(const AttentionCase& c,
                                 const std::vector<SequenceCase>& sequences) {
  AttentionInputs in;
  in.heads = in.kv_heads * c.group;
  const std::int64_t hd = c.head_dim, q_width = in.heads * hd, kv_width = in.kv_heads * hd;
  std::mt19937 rng(static_cast<std::uint32_t>(hd * 131 + c.group * 17 + c.block * 3 + c.window));
  std::int64_t total_blocks = 3;  // 3 never used: attention must not read them
  for (const auto& s : sequences) total_blocks += (s.start + s.queries + c.block - 1) / c.block;
  std::vector<std::int64_t> physical(total_blocks);  // shuffled across the pool
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  in.k_pool.assign(total_blocks * c.block * kv_width, 0.0f);
  in.v_pool = in.k_pool;
  std::int64_t next_block = 0;
  for (std::size_t e = 0; e < sequences.size(); ++e) {
    const auto& s = sequences[e];
    const std::int64_t length = s.start + s.queries;
    auto q = random_values(s.queries * q_width, 100 + e, c.query_scale),
         k = random_values(length * kv_width, 200 + e),
         v = random_values(length * kv_width, 300 + e);
    for (auto* values : {&q, &k, &v})
      for (auto& x : *values) x = stored(x, c.dtype);
    if (c.kv_format != cuda::KvFormat::compute)
      for (auto* values : {&k, &v}) round_trip_rows(c.kv_format, hd, *values);
    // A window lets the allocator release whole blocks no query of this step still sees.
    std::int64_t first = 0;
    if (c.window > 0) first = std::max<std::int64_t>(0, s.start - c.window + 1) / c.block * c.block;
    in.entries.push_back(paged_entry(c, s, first, physical.data() + next_block, in));
    for (std::int64_t p = 0; p < length; ++p) {
      const std::int64_t slot = physical[next_block + p / c.block] * c.block + p % c.block;
      std::copy_n(k.begin() + p * kv_width, kv_width, in.k_pool.begin() + slot * kv_width);
      std::copy_n(v.begin() + p * kv_width, kv_width, in.v_pool.begin() + slot * kv_width);
    }
    next_block += (length + c.block - 1) / c.block;
    for (std::int64_t i = 0; i < s.queries; ++i) {
      in.q_rows.insert(in.q_rows.end(), q.begin() + i * q_width, q.begin() + (i + 1) * q_width);
      in.q_rows.insert(in.q_rows.end(), 2 * kv_width, 7.0f);  // K/V columns of the fused rows
    }
    in.rows += s.queries;
    if (s.queries == 1) in.max_keys = std::max(in.max_keys, s.start - first + 1);
    in.max_queries = std::max(in.max_queries, s.queries);
    in.expected.push_back(
        reference_attention(q, k, v, in.heads, in.kv_heads, hd, s.start, s.queries, c.window));
  }
  return in;
}

// Bytes before a case's pools' first slot: one element (a byte for a quantized pool) when the
// case asks for unaligned pools.
std::size_t pool_offset_bytes(const AttentionCase& c) {
  if (!c.unaligned_pools) return 0;
  return c.kv_format == cuda::KvFormat::compute ? cuda::dtype_bytes(c.dtype) : 1;
}
// A pool of fp32 rows as the device holds it for the case (its dtype or its quantized format),
// pool_offset_bytes in.
std::vector<std::byte> device_pool(const AttentionCase& c, const std::vector<float>& values) {
  std::vector<std::byte> bytes;
  if (c.kv_format != cuda::KvFormat::compute) {
    bytes = quantized_pool(c.kv_format, c.head_dim, values);
  } else if (c.dtype == Dtype::f32) {
    bytes.resize(values.size() * sizeof(float));
    std::memcpy(bytes.data(), values.data(), bytes.size());
  } else {
    const std::vector<Eigen::bfloat16> rounded(values.begin(), values.end());
    bytes.resize(rounded.size() * sizeof(Eigen::bfloat16));
    std::memcpy(bytes.data(), rounded.data(), bytes.size());
  }
  bytes.insert(bytes.begin(), pool_offset_bytes(c), std::byte{0});
  return bytes;
}

void run_attention_case(const AttentionCase& c, const std::vector<SequenceCase>& sequences) {
  AttentionInputs in = attention_inputs(c, sequences);
  const std::int64_t heads = in.heads, kv_heads = in.kv_heads, hd = c.head_dim;
  const std::int64_t q_width = heads * hd, q_stride = q_width + 2 * kv_heads * hd;
  const std::size_t e_bytes = cuda::dtype_bytes(c.dtype);
  const std::int32_t split_keys = 256;
  const std::vector<std::byte> k_bytes = device_pool(c, in.k_pool),
                               v_bytes = device_pool(c, in.v_pool);
  GuardedBuffer d_q(in.q_rows.size(), e_bytes), d_k(k_bytes.size(), 1), d_v(v_bytes.size(), 1),
      d_table(in.block_table.size(), 8), d_entries(in.entries.size(), sizeof(cuda::AttentionEntry)),
      d_out(in.rows * q_width, e_bytes),
      d_workspace(
          cuda::attention_workspace_floats(in.entries.size(), heads, hd,
                                           std::max<std::int64_t>(in.max_keys, 1), split_keys),
          4);
  d_q.write(in.q_rows, c.dtype);
  d_k.write_bytes(k_bytes.data(), k_bytes.size());
  d_v.write_bytes(v_bytes.data(), v_bytes.size());
  d_table.write_bytes(in.block_table.data(), in.block_table.size() * 8);
  d_entries.write_bytes(in.entries.data(), in.entries.size() * sizeof(cuda::AttentionEntry));
  const auto [listed, left_out] = prefill_list(c, in.entries);
  GuardedBuffer d_listed(std::max<std::size_t>(listed.size(), 1), 4);
  d_listed.write_bytes(listed.data(), listed.size() * 4);
  cuda::AttentionParams p;
  p.q = d_q.get();
  p.q_row_stride = q_stride;
  p.k_pool = d_k.as<char>() + pool_offset_bytes(c);
  p.v_pool = d_v.as<char>() + pool_offset_bytes(c);
  p.block_table = d_table.as<std::int64_t>();
  p.entries = d_entries.as<cuda::AttentionEntry>();
  p.entry_count = static_cast<std::int32_t>(in.entries.size());
  p.max_keys = static_cast<std::int32_t>(in.max_keys);
  p.max_queries = static_cast<std::int32_t>(in.max_queries);
  if (c.prefill_list != PrefillList::none) {
    p.prefill_entries = d_listed.as<std::int32_t>();
    p.prefill_count = static_cast<std::int32_t>(listed.size());
  }
  p.out = d_out.get();
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = hd;
  p.window = c.window;
  p.split_keys = split_keys;
  p.workspace = d_workspace.as<float>();
  p.dtype = c.dtype;
  p.tensor_cores = c.tensor_cores;
  p.kv_format = c.kv_format;
  ASSERT_EQ(cuda::launch_attention(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto out = d_out.read(in.rows * q_width, c.dtype);
  const std::string what =
      std::string(dtype_name(c.dtype)) + (c.tensor_cores ? "" : " (CUDA cores)") +
      (c.kv_format != cuda::KvFormat::compute
           ? " KV " + std::string(dtype_short_name(host_dtype(c.kv_format)))
           : std::string()) +
      " hd " + std::to_string(hd) + " group " + std::to_string(c.group) + " block " +
      std::to_string(c.block) + " window " + std::to_string(c.window);
  std::vector<unsigned char> out_bytes(in.rows * q_width * e_bytes);
  d_out.read_bytes(out_bytes.data(), out_bytes.size());
  for (std::size_t e = 0; e < sequences.size(); ++e) {
    if (static_cast<std::int64_t>(e) == left_out) {  // no block of the prefill grid served it
      const auto first = out_bytes.begin() + in.entries[e].first_row * q_width * e_bytes;
      EXPECT_TRUE(std::all_of(first, first + sequences[e].queries * q_width * e_bytes,
                              [](unsigned char b) { return b == GuardedBuffer::kSentinel; }))
          << what << ": the unlisted prefill entry " << e << " was written";
      continue;
    }
    std::vector<float> got(
        out.begin() + in.entries[e].first_row * q_width,
        out.begin() + (in.entries[e].first_row + sequences[e].queries) * q_width);
    std::vector<float> want(in.expected[e].begin(), in.expected[e].end());
    const double tolerance = c.dtype == Dtype::f32 ? 5e-5 : 1e-2;
    expect_close(got, want, tolerance,
                 what + " sequence start " + std::to_string(sequences[e].start) + " queries " +
                     std::to_string(sequences[e].queries));
  }
  EXPECT_TRUE(d_out.guards_intact()) << what;
  EXPECT_TRUE(d_workspace.guards_intact()) << what;
}

// Decodes at 1, 17, 256 and 1,000 keys (one to four splits of 256), a prompt of 37 from
// scratch, a later chunk of 50 after 77 cached tokens (chunked prefill) and a short one of 9.
const std::vector<SequenceCase> kSequences{{0, 1},  {16, 1},  {255, 1}, {999, 1},
                                           {0, 37}, {77, 50}, {0, 9}};

class CudaAttentionGrid
    : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t, std::int64_t, Dtype>> {
};

TEST_P(CudaAttentionGrid, MatchesTheReference) {
  KVLAB_REQUIRE_CUDA();
  const auto [head_dim, group, block, dtype] = GetParam();
  run_attention_case({head_dim, group, block, 0, dtype}, kSequences);
}

INSTANTIATE_TEST_SUITE_P(HeadDimGroupBlockDtype, CudaAttentionGrid,
                         ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 4, 8),
                                            ::testing::Values(1, 16, 32),
                                            ::testing::Values(Dtype::f32, Dtype::bf16)),
                         [](const auto& info) {
                           return "hd" + std::to_string(std::get<0>(info.param)) + "_group" +
                                  std::to_string(std::get<1>(info.param)) + "_block" +
                                  std::to_string(std::get<2>(info.param)) + "_" +
                                  dtype_name(std::get<3>(info.param));
                         });

// Prefill chunks longer than one tensor-core query tile (64) and key tile (64): 150 queries
// after 40 cached tokens spread over three query tiles and up to four key tiles, with the
// causal diagonal inside tiles; beside them a prompt of 65 (one row into a second tile) and a
// decode. Both dtypes (bf16 takes the tensor-core kernel), with and without a window.
// The prefill grid covers the listed entries only (a mixed step's decodes cost it no blocks):
// without a list every entry is still served; an entry left off the list is not computed.
TEST(CudaAttention, PrefillGridCoversTheListedEntries) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (PrefillList list : {PrefillList::none, PrefillList::last_left_out}) {
      AttentionCase c{128, 4, 16, 0, dtype};
      c.prefill_list = list;
      run_attention_case(c, kSequences);
    }
}

// Decode (split-K, up to four splits) and prefill (chunked, long, windowed) over fp8 and int8
// pools: the attention of the rows the pool holds, read back as the host reads them, in both
// compute dtypes (bf16 included: quantized pools leave tensor cores for the CUDA-core kernels),
// head_dim 64, 128 and 256, MHA, GQA 4 and 8, block sizes 1 and 16; fp8 pools on the vectorized
// decode kernel (16 values per 16-byte load) and, one byte off alignment, on the scalar one.
TEST(CudaAttention, QuantizedPoolsGiveTheAttentionOfTheirRoundedRows) {
  KVLAB_REQUIRE_CUDA();
  for (cuda::KvFormat format : {cuda::KvFormat::fp8_e4m3, cuda::KvFormat::int8})
    for (Dtype dtype : kDtypes) {
      for (const auto& [head_dim, group] : {std::pair{128, 4}, std::pair{256, 8}}) {
        AttentionCase c{head_dim, group, 16, 0, dtype};
        c.kv_format = format;
        run_attention_case(c, kSequences);
      }
      AttentionCase c{64, 1, 1, 48, dtype};
      c.kv_format = format;
      run_attention_case(c, {{40, 150}, {0, 65}, {200, 1}, {999, 1}});
      c = {128, 8, 16, 0, dtype};
      c.kv_format = format;
      c.unaligned_pools = true;
      run_attention_case(c, {{0, 1}, {255, 1}, {999, 1}, {77, 50}});
    }
}

TEST(CudaAttention, LongPrefillChunksSpanSeveralQueryAndKeyTiles) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (std::int64_t window : {0, 48})
      run_attention_case({128, 4, 16, window, dtype}, {{40, 150}, {0, 65}, {200, 1}});
}

// Decode on tensor cores with more query heads per K/V head than one row tile (16) holds (MQA
// with 32 heads: two tiles; 24: a full and a half one) and exactly 16; keys over two warps'
// halves of a tile, several tiles, a split boundary (256) and four splits.
TEST(CudaAttention, DecodeGroupsBeyondOneTensorCoreRowTile) {
  KVLAB_REQUIRE_CUDA();
  for (std::int64_t group : {16, 24, 32})
    run_attention_case({64, group, 16, 0, Dtype::bf16}, {{0, 1}, {40, 1}, {300, 1}, {999, 1}});
}

// Scores spread wide (queries x 6): each split's softmax is dominated by its own few largest
// keys and the splits' maxima differ by several units, so combining them with a wrong base or
// merging a block's warps with the wrong weight shows (with flat scores it hides within bf16's
// tolerance). Both decode paths, and fp32.
TEST(CudaAttention, PeakedScoresCombineSplitsAndWarpsByTheirMaxima) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (bool tensor_cores : {true, false}) {
      AttentionCase c{128, 8, 16, 0, dtype};
      c.tensor_cores = tensor_cores;
      c.query_scale = 6.0f;
      run_attention_case(c, {{20, 1}, {600, 1}, {999, 1}, {0, 40}});
    }
}

// The CUDA-core kernels for bf16 (tensor_cores off), which bench_cuda compares the tensor-core
// ones against: the vectorized decode and warp-per-query prefill.
TEST(CudaAttention, CudaCoreKernelsMatchTheReferenceInBf16) {
  KVLAB_REQUIRE_CUDA();
  for (std::int64_t head_dim : {64, 128})
    for (std::int64_t group : {1, 8}) {
      AttentionCase c{head_dim, group, 16, 0, Dtype::bf16};
      c.tensor_cores = false;
      run_attention_case(c, kSequences);
    }
}

TEST(CudaAttention, SlidingWindowMatchesTheReference) {
  KVLAB_REQUIRE_CUDA();
  for (Dtype dtype : kDtypes)
    for (std::int64_t block : {1, 16})
      run_attention_case({64, 4, block, 64, dtype}, {{300, 1}, {100, 40}, {10, 1}, {0, 70}});
}

TEST(CudaAttention, UnalignedPoolsTakeTheScalarDecodeKernel) {
  KVLAB_REQUIRE_CUDA();
  // The vectorized decode kernel needs 16-byte aligned rows; pools that are not fall back to
  // the scalar kernel, which must give the same answers.
  for (Dtype dtype : kDtypes)
    for (std::int64_t group : {1, 8}) {
      AttentionCase c{128, group, 16, 0, dtype};
      c.unaligned_pools = true;
      run_attention_case(c, kSequences);
    }
}

TEST(CudaAttention, SmallAndOddHeadDimsAndGroups) {
  KVLAB_REQUIRE_CUDA();
  // The tiny preset (hd 16, group 2; vectorized with 4 and 2 lanes per key), stories15m-like
  // shapes (hd 48: scalar; group 3 and 6 take the one-query-head-per-block path) and hd 256
  // (two 16-byte chunks per lane in fp32).
  run_attention_case({16, 2, 4, 0, Dtype::f32}, kSequences);
  run_attention_case({16, 2, 4, 0, Dtype::bf16}, kSequences);
  run_attention_case({256, 4, 16, 0, Dtype::f32}, kSequences);
  run_attention_case({256, 8, 16, 0, Dtype::bf16}, kSequences);
  run_attention_case({48, 3, 16, 0, Dtype::f32}, kSequences);
  run_attention_case({48, 6, 16, 0, Dtype::bf16}, kSequences);
}

}  // namespace
}  // namespace kvlab
