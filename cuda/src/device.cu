#include <cuda_runtime_api.h>

#include "kvlab/cuda/device.hpp"

namespace kvlab::cuda {

DeviceProbe probe_device(int device) {
  DeviceProbe probe;
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    probe.reason =
        std::string("no CUDA device: cudaGetDeviceCount failed: ") + cudaGetErrorString(status);
    return probe;
  }
  if (count <= device) {
    probe.reason = "no CUDA device: " + std::to_string(count) +
                   " device(s) visible, wanted index " + std::to_string(device);
    return probe;
  }
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, device) != cudaSuccess) {
    probe.reason = "cudaGetDeviceProperties failed";
    return probe;
  }
  probe.available = true;
  probe.name = properties.name;
  probe.compute_major = properties.major;
  probe.compute_minor = properties.minor;
  probe.memory_bytes = properties.totalGlobalMem;
  return probe;
}

}  // namespace kvlab::cuda
