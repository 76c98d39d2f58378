#include <gtest/gtest.h>

#include <cmath>

#include "kvlab/cpu_reference/ops.hpp"

namespace kvlab::cpu {
namespace {

RowMatrix random_rows(std::int64_t rows, std::int64_t cols, unsigned seed) {
  std::srand(seed);
  return RowMatrix::Random(rows, cols);
}

TEST(Rope, MatchesTheClosedForm) {
  constexpr std::int64_t kHeadDim = 16, kHeads = 3;
  constexpr double kTheta = 10000.0;
  const RopeTable rope(kHeadDim, kTheta, 4096);
  const std::vector<std::int32_t> positions{0, 1, 7, 100, 4095};
  const RowMatrix original =
      random_rows(static_cast<std::int64_t>(positions.size()), kHeads * kHeadDim, 3);
  RowMatrix rotated = original;
  rope.apply(rotated, positions, kHeads);
  double max_error = 0;
  for (std::size_t t = 0; t < positions.size(); ++t) {
    for (std::int64_t h = 0; h < kHeads; ++h) {
      for (std::int64_t i = 0; i < kHeadDim / 2; ++i) {
        const double angle =
            positions[t] * std::pow(kTheta, -2.0 * static_cast<double>(i) / kHeadDim);
        const double x1 = original(static_cast<Eigen::Index>(t), h * kHeadDim + i);
        const double x2 = original(static_cast<Eigen::Index>(t), h * kHeadDim + i + kHeadDim / 2);
        const double y1 = x1 * std::cos(angle) - x2 * std::sin(angle);
        const double y2 = x2 * std::cos(angle) + x1 * std::sin(angle);
        max_error = std::max(
            max_error, std::abs(y1 - rotated(static_cast<Eigen::Index>(t), h * kHeadDim + i)));
        max_error = std::max(max_error, std::abs(y2 - rotated(static_cast<Eigen::Index>(t),
                                                              h * kHeadDim + i + kHeadDim / 2)));
      }
    }
  }
  EXPECT_LT(max_error, 2e-6);  // fp32 rounding of |x| <= 1 values
  EXPECT_TRUE(rotated.allFinite());
}

TEST(Rope, PositionZeroIsIdentityAndNormsArePreserved) {
  const RopeTable rope(8, 10000.0, 64);
  const RowMatrix original = random_rows(4, 16, 5);
  RowMatrix rotated = original;
  rope.apply(rotated, std::vector<std::int32_t>{0, 5, 17, 63}, 2);
  EXPECT_EQ(rotated.row(0), original.row(0));
  for (Eigen::Index t = 1; t < 4; ++t)
    for (int h = 0; h < 2; ++h)
      EXPECT_NEAR(rotated.row(t).segment(h * 8, 8).norm(), original.row(t).segment(h * 8, 8).norm(),
                  1e-5);
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  // <rope(q, m), rope(k, n)> is a function of m - n: the property RoPE exists for.
  const RopeTable rope(32, 10000.0, 512);
  const RowMatrix q = random_rows(1, 32, 7), k = random_rows(1, 32, 8);
  auto score = [&](std::int32_t m, std::int32_t n) {
    RowMatrix qm = q, kn = k;
    rope.apply(qm, std::vector<std::int32_t>{m}, 1);
    rope.apply(kn, std::vector<std::int32_t>{n}, 1);
    return qm.row(0).dot(kn.row(0));
  };
  EXPECT_NEAR(score(10, 3), score(107, 100), 1e-5);
  EXPECT_NEAR(score(50, 50), score(0, 0), 1e-5);
  EXPECT_GT(std::abs(score(10, 3) - score(10, 9)), 1e-4);  // and it does depend on it
}

}  // namespace
}  // namespace kvlab::cpu
