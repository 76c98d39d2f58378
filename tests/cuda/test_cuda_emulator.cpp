// The CPU emulator the kernel tests run on without a GPU (kvlab/cuda/emulation.hpp): CUDA's
// execution model as far as the kernels rely on it (block and thread coordinates, shared memory
// per block, __syncthreads, warp shuffles), and the failures it must report instead of hanging
// or corrupting memory.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kvlab/cuda/emulation.hpp"

namespace kvlab {
namespace {

namespace emulation = cuda::emulation;

__global__ void warp_sums(int* out) {
  int v = static_cast<int>(threadIdx.x);
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

TEST(CudaEmulator, WarpShufflesExchangeBetweenLanesOfOneWarp) {
  std::vector<int> out(3 * 64, -1);
  int* data = out.data();
  ASSERT_EQ(emulation::launch(dim3(3), dim3(64), [&] { warp_sums(data); }), cudaSuccess);
  for (int block = 0; block < 3; ++block)
    for (int t = 0; t < 64; ++t)
      EXPECT_EQ(out[block * 64 + t], t < 32 ? 496 : 32 * 32 + 496) << block << " " << t;
}

__global__ void broadcast_and_shift(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int from_lane_5 = __shfl_sync(0xffffffffu, lane * 10, 5);
  const int from_below = __shfl_down_sync(0xffffffffu, lane, 3);
  out[threadIdx.x] = from_lane_5 * 100 + from_below;
}

TEST(CudaEmulator, ShflSyncBroadcastsAndShflDownKeepsItsOwnValuePastTheEnd) {
  std::vector<int> out(32, -1);
  int* data = out.data();
  ASSERT_EQ(emulation::launch(dim3(1), dim3(32), [&] { broadcast_and_shift(data); }), cudaSuccess);
  for (int lane = 0; lane < 32; ++lane)
    EXPECT_EQ(out[lane], 50 * 100 + (lane + 3 < 32 ? lane + 3 : lane)) << lane;
}

// Every thread writes its slot of shared memory, waits, then reads the slot of its mirror
// thread: correct only if __syncthreads holds every thread until all have written, and shared
// memory is one array per block.
__global__ void mirror_through_shared(int* out) {
  __shared__ int slots[128];
  const int t = static_cast<int>(threadIdx.x);
  slots[t] = static_cast<int>(blockIdx.x) * 1000 + t;
  __syncthreads();
  out[blockIdx.x * 128 + t] = slots[127 - t];
  __syncthreads();
}

TEST(CudaEmulator, SyncthreadsMakesSharedWritesVisibleToTheWholeBlock) {
  std::vector<int> out(4 * 128, -1);
  int* data = out.data();
  ASSERT_EQ(emulation::launch(dim3(4), dim3(128), [&] { mirror_through_shared(data); }),
            cudaSuccess);
  for (int block = 0; block < 4; ++block)
    for (int t = 0; t < 128; ++t) EXPECT_EQ(out[block * 128 + t], block * 1000 + 127 - t);
}

__global__ void coordinates(unsigned* out) {
  const unsigned linear_block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned linear_thread =
      threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  out[linear_block * threads + linear_thread] = linear_block * 10000 + linear_thread;
}

TEST(CudaEmulator, EveryThreadOfAThreeDimensionalGridRunsOnceWithItsCoordinates) {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  std::vector<unsigned> out(12 * 24, 0xffffffffu);
  unsigned* data = out.data();
  ASSERT_EQ(emulation::launch(grid, block, [&] { coordinates(data); }), cudaSuccess);
  for (unsigned b = 0; b < 12; ++b)
    for (unsigned t = 0; t < 24; ++t) EXPECT_EQ(out[b * 24 + t], b * 10000 + t);
}

// Threads exiting early count as arrived at __syncthreads, as on the hardware.
__global__ void early_exit_then_barrier(int* out) {
  if (threadIdx.x >= 40) return;
  __shared__ int value;
  if (threadIdx.x == 0) value = 7;
  __syncthreads();
  out[threadIdx.x] = value;
}

TEST(CudaEmulator, ExitedThreadsDoNotHoldABlockBarrier) {
  std::vector<int> out(64, -1);
  int* data = out.data();
  ASSERT_EQ(emulation::launch(dim3(1), dim3(64), [&] { early_exit_then_barrier(data); }),
            cudaSuccess);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], t < 40 ? 7 : -1);
}

__global__ void divergent_barriers() {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    (void)__shfl_xor_sync(0xffffffffu, 1, 1);
    __syncthreads();
    __syncthreads();
  }
}

TEST(CudaEmulator, ReportsBarriersThatCanNeverReleaseInsteadOfHanging) {
  // Warp 1 shuffles, then waits at two barriers while warp 0 waits at one: after the first
  // barrier releases, warp 0 exits and warp 1's second barrier is reached by all live threads,
  // which is fine; a shuffle in half a warp is not.
  EXPECT_EQ(emulation::launch(dim3(1), dim3(64), [] { divergent_barriers(); }), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  const auto half_warp_shuffle = [] {
    if (threadIdx.x % 32 < 16) (void)__shfl_xor_sync(0xffffffffu, 1, 1);
    __syncthreads();
  };
  EXPECT_EQ(emulation::launch(dim3(2), dim3(64), half_warp_shuffle), cudaErrorLaunchFailure);
  EXPECT_NE(emulation::failure_message().find("deadlock"), std::string::npos)
      << emulation::failure_message();
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);  // sticky until read
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  const auto shuffle_after_lane_exit = [] {
    if (threadIdx.x == 3) return;
    (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
  };
  EXPECT_EQ(emulation::launch(dim3(1), dim3(32), shuffle_after_lane_exit), cudaErrorLaunchFailure);
  EXPECT_NE(emulation::failure_message().find("thread 3 exited"), std::string::npos)
      << emulation::failure_message();
  (void)cudaGetLastError();

  const auto partial_mask = [] { (void)__shfl_xor_sync(0x0000ffffu, 1, 1); };
  EXPECT_EQ(emulation::launch(dim3(1), dim3(32), partial_mask), cudaErrorLaunchFailure);
  EXPECT_NE(emulation::failure_message().find("mask"), std::string::npos);
  (void)cudaGetLastError();
}

TEST(CudaEmulator, RejectsLaunchConfigurationsTheDriverRejects) {
  int runs = 0;
  const auto count = [&] { ++runs; };
  EXPECT_EQ(emulation::launch(dim3(1), dim3(1025), count), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emulation::launch(dim3(0), dim3(32), count), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emulation::launch(dim3(1, 65536), dim3(32), count), cudaErrorInvalidConfiguration);
  EXPECT_EQ(emulation::launch(dim3(1), dim3(1, 1, 65), count), cudaErrorInvalidConfiguration);
  EXPECT_EQ(runs, 0);
  (void)cudaGetLastError();
  EXPECT_EQ(emulation::launch(dim3(2), dim3(1024), count), cudaSuccess);
  EXPECT_EQ(runs, 2048);
}

TEST(CudaEmulator, CopiesAreCheckedAgainstDeviceAllocations) {
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 100), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(device) % 256, 0u);
  std::vector<char> host(200, 1);
  EXPECT_EQ(cudaMemcpy(device, host.data(), 100, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), 101, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), static_cast<char*>(device) + 50, 60, cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(host.data(), host.data() + 100, 10, cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);  // not device memory at all
  EXPECT_EQ(cudaMemset(device, 0, 100), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFree(device), cudaErrorInvalidValue);  // double free
}

}  // namespace
}  // namespace kvlab
