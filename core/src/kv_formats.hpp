#pragma once
// The KV-only formats behind convert_to_f32 / convert_from_f32 (dtype.cpp): fp8 e4m3 and the
// grouped rows (int8 with a per-row scale, llama.cpp's q8_0 and q4_0 blocks).
#include <cstddef>

#include "kvlab/dtype.hpp"

namespace kvlab {

// fp8 e4m3 and the grouped formats: the dtypes these two functions convert.
bool is_kv_format(DType dtype);
// One row of n values: dtype_row_bytes(dtype, n) bytes <-> n floats.
void kv_row_to_f32(DType dtype, const std::byte* row, std::size_t n, float* out);
void kv_row_from_f32(DType dtype, const float* values, std::size_t n, std::byte* row);

}  // namespace kvlab
