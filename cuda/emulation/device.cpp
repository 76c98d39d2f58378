// The CPU-emulated build of cuda/src/device.cu (see kvlab/cuda/emulation.hpp).
#include "../src/device.cu"
