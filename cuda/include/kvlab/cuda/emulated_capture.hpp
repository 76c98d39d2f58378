#pragma once
// Stream capture in the CPU emulator (KVLAB_CUDA_EMULATION), for the emulated runtime's CUDA
// graph subset and its cuBLAS subset: while cudaStreamBeginCapture's capture is open on this
// thread, record() keeps `work` for the graph and returns true (emulated launches and GEMMs
// record themselves); otherwise it returns false and the caller runs the work now.
#include <functional>

namespace kvlab::cuda::emulation {

bool record(std::function<void()> work);
bool capturing();

}  // namespace kvlab::cuda::emulation
