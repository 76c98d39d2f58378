// The CPU-emulated build of cuda/src/elementwise.cu (see kvlab/cuda/emulation.hpp).
#include "../src/elementwise.cu"
