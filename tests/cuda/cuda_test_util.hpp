#pragma once
// Device buffers with guard regions for the CUDA tests: every buffer is allocated with
// kGuard extra elements on both sides filled with a sentinel, and guards_intact() checks that no
// kernel wrote outside [0, size). Values travel as fp32 on the host and are stored as the
// kernel's dtype (fp32 or bf16, rounded to nearest even) on the device.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvlab/cuda/device.hpp"
#include "kvlab/cuda/kernels.hpp"

namespace kvlab::test {

// Skips the calling test with the probe's reason when there is no device.
#define KVLAB_REQUIRE_CUDA()                                                \
  do {                                                                      \
    const ::kvlab::cuda::DeviceProbe probe = ::kvlab::cuda::probe_device(); \
    if (!probe.available) GTEST_SKIP() << probe.reason;                     \
  } while (0)

// Host values as the device stores them: bf16 rounding applied, then back to float.
inline float stored(float x, cuda::Dtype dtype) {
  return dtype == cuda::Dtype::f32 ? x : static_cast<float>(Eigen::bfloat16(x));
}

class GuardedBuffer {
 public:
  static constexpr std::size_t kGuard = 64;  // elements on each side
  static constexpr unsigned char kSentinel = 0x7b;

  GuardedBuffer(std::size_t elements, std::size_t element_bytes)
      : elements_(elements), element_bytes_(element_bytes) {
    const std::size_t bytes = (elements + 2 * kGuard) * element_bytes;
    EXPECT_EQ(cudaMalloc(&base_, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(base_, kSentinel, bytes), cudaSuccess);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;
  ~GuardedBuffer() { cudaFree(base_); }

  void* get() const { return static_cast<char*>(base_) + kGuard * element_bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(get());
  }

  // Raw bytes in and out.
  void write_bytes(const void* host, std::size_t bytes) {
    ASSERT_LE(bytes, elements_ * element_bytes_);
    ASSERT_EQ(cudaMemcpy(get(), host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void read_bytes(void* host, std::size_t bytes) const {
    ASSERT_EQ(cudaMemcpy(host, get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  // fp32 values stored as `dtype`.
  void write(const std::vector<float>& values, cuda::Dtype dtype) {
    if (dtype == cuda::Dtype::f32) {
      write_bytes(values.data(), values.size() * sizeof(float));
    } else {
      std::vector<Eigen::bfloat16> converted(values.begin(), values.end());
      write_bytes(converted.data(), converted.size() * sizeof(Eigen::bfloat16));
    }
  }
  std::vector<float> read(std::size_t count, cuda::Dtype dtype) const {
    std::vector<float> out(count);
    if (dtype == cuda::Dtype::f32) {
      read_bytes(out.data(), count * sizeof(float));
    } else {
      std::vector<Eigen::bfloat16> raw(count);
      read_bytes(raw.data(), count * sizeof(Eigen::bfloat16));
      for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(raw[i]);
    }
    return out;
  }
  bool guards_intact() const {
    std::vector<unsigned char> guard(kGuard * element_bytes_);
    for (const char* at :
         {static_cast<const char*>(base_),
          static_cast<const char*>(base_) + (kGuard + elements_) * element_bytes_}) {
      if (cudaMemcpy(guard.data(), at, guard.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        return false;
      for (unsigned char b : guard)
        if (b != kSentinel) return false;
    }
    return true;
  }

 private:
  void* base_ = nullptr;
  std::size_t elements_, element_bytes_;
};

}  // namespace kvlab::test
