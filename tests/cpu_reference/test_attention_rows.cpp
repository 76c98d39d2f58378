// The two inner loops of decode attention (cpu_reference/src/attention_rows.hpp) against plain
// loops over the same widened rows, for every head_dim path (8-wide AVX2 in 64-column blocks and
// 8-column tails, plain loops where head_dim is not a multiple of 8), key counts around the 8-key
// groups, rows a slot apart and each pool dtype. Tolerance: fp32 sums in another order, |error| <=
// hd * 1.2e-7 * sum |terms|.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attention_rows.hpp"

namespace kvlab::cpu {
namespace {

TEST(AttentionRows, ScoresAndWeightedSumsEqualPlainLoops) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (DType dtype : {DType::dtype_f32, DType::dtype_f16, DType::dtype_bf16})
    for (std::int64_t hd : {8, 12, 16, 48, 64, 80, 128})
      for (std::int64_t count : {1, 7, 8, 9, 16, 21, 33}) {
        const std::int64_t element = static_cast<std::int64_t>(dtype_size(dtype));
        const std::int64_t stride = (3 * hd + 8) * element;  // a slot row holds other heads too
        std::vector<float> values(static_cast<std::size_t>(count * (3 * hd + 8)));
        for (float& v : values) v = value(rng);
        std::vector<std::byte> rows(values.size() * static_cast<std::size_t>(element));
        convert_from_f32(dtype, values, rows);
        std::vector<float> q(static_cast<std::size_t>(hd)), p(static_cast<std::size_t>(count));
        for (float& v : q) v = value(rng);
        for (float& v : p) v = value(rng);
        const std::byte* first = rows.data() + hd * element;  // the second head of each row
        std::vector<float> scores(static_cast<std::size_t>(count)),
            o(static_cast<std::size_t>(hd), 0.5f);
        score_rows(dtype, q.data(), first, stride, count, count, hd, 0.25f, scores.data());
        add_weighted_rows(dtype, p.data(), first, stride, count, count, hd, o.data());
        std::vector<float> row(static_cast<std::size_t>(hd));
        std::vector<double> expected_o(static_cast<std::size_t>(hd), 0.5), o_bound(row.size(), 0);
        for (std::int64_t j = 0; j < count; ++j) {
          widen_attention_row(dtype, first + j * stride, hd, row.data());
          double dot = 0, bound = 0;
          for (std::size_t d = 0; d < row.size(); ++d) {
            dot += static_cast<double>(q[d]) * row[d];
            bound += std::abs(static_cast<double>(q[d]) * row[d]);
            expected_o[d] += static_cast<double>(p[static_cast<std::size_t>(j)]) * row[d];
            o_bound[d] += std::abs(static_cast<double>(p[static_cast<std::size_t>(j)]) * row[d]);
          }
          EXPECT_NEAR(scores[static_cast<std::size_t>(j)], 0.25 * dot,
                      0.25 * bound * static_cast<double>(hd) * 1.2e-7 + 1e-7)
              << dtype_short_name(dtype) << " hd " << hd << " count " << count << " key " << j;
        }
        for (std::size_t d = 0; d < row.size(); ++d)
          EXPECT_NEAR(o[d], expected_o[d], (o_bound[d] + 0.5) * static_cast<double>(count) * 1.2e-7)
              << dtype_short_name(dtype) << " hd " << hd << " count " << count << " column " << d;
      }
}

}  // namespace
}  // namespace kvlab::cpu
