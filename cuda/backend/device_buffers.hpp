#pragma once
// The cuda backend's owners of device memory, pinned host memory and instantiated CUDA graphs:
// each frees what it holds. A failed allocation throws kvlab::Error (the backend's edge).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab::cuda {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(fmt::format("cuda backend: {}: {}", what, cudaGetErrorString(status)));
}

// A device allocation that frees itself.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) { resize(bytes); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      cudaFree(data_);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { cudaFree(data_); }
  // Grows only, contents not kept; true when the allocation moved (a captured graph that
  // reads it is stale).
  bool resize(std::size_t bytes) {
    if (bytes <= bytes_) return false;
    cudaFree(data_);
    data_ = nullptr;
    check(cudaMalloc(&data_, bytes), "cudaMalloc");
    bytes_ = bytes;
    return true;
  }
  std::size_t bytes() const { return bytes_; }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// An instantiated CUDA graph that destroys itself.
class GraphExec {
 public:
  explicit GraphExec(cudaGraphExec_t exec) : exec_(exec) {}
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  GraphExec(GraphExec&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Pinned host staging for one step's uploads and the logits download.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { cudaFreeHost(data_); }
  void resize(std::size_t bytes) {
    if (bytes <= bytes_) return;
    cudaFreeHost(data_);
    data_ = nullptr;
    check(cudaMallocHost(&data_, bytes), "cudaMallocHost");
    bytes_ = bytes;
  }
  template <typename T>
  T* get() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvlab::cuda
