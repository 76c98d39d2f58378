// The cuda backend's cuBLASLt plans (cuda/backend/lt_gemm.hpp) on the emulator's CPU cuBLASLt:
// a shape beyond 512 rows runs on its bucket's plan with its own row count.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <gtest/gtest.h>

#include <random>

#include "../../cuda/backend/lt_gemm.hpp"
#include "cuda_test_util.hpp"

namespace kvlab::test {
namespace {

TEST(CudaLtGemm, RowsBeyond512ShareTheirBucketsPlanAndGetTheirOwnProducts) {
  KVLAB_REQUIRE_CUDA();
  EXPECT_EQ(cuda::LtGemm::plan_rows(512), 512);
  EXPECT_EQ(cuda::LtGemm::plan_rows(513), 640);
  EXPECT_EQ(cuda::LtGemm::plan_rows(1024), 1024);
  constexpr std::int64_t in = 24, out = 16, most_rows = 1024;
  GuardedBuffer workspace(1 << 16, 1), w(out * in, 4), x(most_rows * in, 4), y(most_rows * out, 4);
  cuda::LtGemm lt;
  ASSERT_EQ(lt.init(workspace.get(), 1 << 16), CUBLAS_STATUS_SUCCESS);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> weights(out * in), inputs(most_rows * in);
  for (float& v : weights) v = uniform(rng);
  for (float& v : inputs) v = uniform(rng);
  w.write(weights, cuda::Dtype::f32);
  x.write(inputs, cuda::Dtype::f32);
  // y (rows, out) = x w^T; what lies beyond the call's rows must stay the sentinel.
  for (std::int64_t rows : {600, 513, 700, 640, 1000, 300}) {
    ASSERT_EQ(cudaMemset(y.get(), GuardedBuffer::kSentinel, most_rows * out * 4), cudaSuccess);
    ASSERT_EQ(lt.run({rows, in, out, CUDA_R_32F, CUDA_R_32F}, x.get(), w.get(), y.get(), nullptr),
              CUBLAS_STATUS_SUCCESS);
    std::vector<unsigned char> bytes(most_rows * out * 4);
    y.read_bytes(bytes.data(), bytes.size());
    const auto* got = reinterpret_cast<const float*>(bytes.data());
    double worst = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        double want = 0;
        for (std::int64_t i = 0; i < in; ++i)
          want += double{inputs[r * in + i]} * weights[o * in + i];
        worst = std::max(worst, std::abs(got[r * out + o] - want));
      }
    EXPECT_LT(worst, 1e-5) << rows << " rows";  // fp32 sums of 24 products of O(1) values
    EXPECT_TRUE(std::all_of(bytes.begin() + rows * out * 4, bytes.end(),
                            [](unsigned char b) { return b == GuardedBuffer::kSentinel; }))
        << rows << " rows: written beyond them";
  }
  // 640 (600, 513, 640), 768 (700), 1024 (1000) and 300 (its own).
  EXPECT_EQ(lt.plan_count(), 4u);
  EXPECT_TRUE(y.guards_intact());
}

}  // namespace
}  // namespace kvlab::test
