// The CPU-emulated build of cuda/src/attention.cu (see kvlab/cuda/emulation.hpp).
#include "../src/attention.cu"
