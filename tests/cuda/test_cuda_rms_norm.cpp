// Correctness rung 3, first kernel: CUDA RMSNorm against the Eigen reference.
// Skips with the probe's reason where no GPU is present (as on the build machines).
#include <gtest/gtest.h>

#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cuda/device.hpp"
#include "kvlab/cuda/rms_norm.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

TEST(CudaRmsNorm, MatchesTheReference) {
  const cuda::DeviceProbe probe = cuda::probe_device();
  if (!probe.available) GTEST_SKIP() << probe.reason;
  RecordProperty("device", probe.name);
  for (const auto& [rows, dim] :
       std::vector<std::pair<int, int>>{{1, 64}, {7, 288}, {33, 4096}, {5, 100}}) {
    std::srand(static_cast<unsigned>(rows * dim));
    const cpu::RowMatrix x = cpu::RowMatrix::Random(rows, dim) * 3.0f;
    const Eigen::VectorXf weight = Eigen::VectorXf::Random(dim);
    cpu::RowMatrix expected;
    cpu::rms_norm(x, weight, 1e-5f, expected);
    cpu::RowMatrix actual(rows, dim);
    const std::string error =
        cuda::rms_norm_host(x.data(), weight.data(), rows, dim, 1e-5f, actual.data());
    ASSERT_EQ(error, "");
    const auto c = test::compare(
        std::span<const float>(actual.data(), static_cast<std::size_t>(actual.size())),
        std::span<const float>(expected.data(), static_cast<std::size_t>(expected.size())));
    EXPECT_FALSE(c.has_nan);
    // fp32, reduction order differs: a few ulps of values of magnitude <= ~5.
    EXPECT_LT(c.max_abs, 1e-5) << rows << "x" << dim << " max rel " << c.max_rel;
  }
}

TEST(CudaDevice, ProbeExplainsItself) {
  const cuda::DeviceProbe probe = cuda::probe_device();
  if (probe.available) {
    EXPECT_FALSE(probe.name.empty());
    EXPECT_GT(probe.memory_bytes, 0u);
  } else {
    EXPECT_NE(probe.reason.find("no CUDA device"), std::string::npos) << probe.reason;
  }
}

}  // namespace
}  // namespace kvlab
