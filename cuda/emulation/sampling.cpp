// The CPU-emulated build of cuda/src/sampling.cu (see kvlab/cuda/emulation.hpp).
#include "../src/sampling.cu"
