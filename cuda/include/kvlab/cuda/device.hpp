#pragma once
// CUDA device discovery. Never throws: no driver or no device is a normal answer here, and
// GPU tests skip with the reason this returns.
#include <cstdint>
#include <string>

namespace kvlab::cuda {

struct DeviceProbe {
  bool available = false;
  std::string reason;  // why not available ("no CUDA device: cudaGetDeviceCount returned ...")
  std::string name;    // e.g. "NVIDIA H200"
  int compute_major = 0;
  int compute_minor = 0;
  std::uint64_t memory_bytes = 0;
};

DeviceProbe probe_device(int device = 0);

}  // namespace kvlab::cuda
