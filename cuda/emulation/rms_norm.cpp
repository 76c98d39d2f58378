// The CPU-emulated build of cuda/src/rms_norm.cu (see kvlab/cuda/emulation.hpp).
#include "../src/rms_norm.cu"
