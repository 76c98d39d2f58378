#pragma once
// RMSNorm on the GPU from host memory: a convenience over launch_rms_norm (kernels.hpp) for
// tests that compare one kernel with cpu_reference.
#include <cstdint>
#include <string>

namespace kvlab::cuda {

// Host-side convenience: copies x (rows, dim) and weight (dim) to the device, runs the kernel,
// copies the result into out (rows, dim). Returns an empty string on success, else the CUDA
// error text (no exceptions: this is called from tests that must report, not crash).
// (Pointers, not std::span: this header is also compiled by nvcc in C++17 mode.)
std::string rms_norm_host(const float* x, const float* weight, std::int64_t rows, std::int64_t dim,
                          float eps, float* out);

}  // namespace kvlab::cuda
