#!/usr/bin/env python3
"""Writes a copy of a GGUF model with every tensor widened to F32 (gguf-py's dequantizers), the
metadata unchanged: llama.cpp then multiplies in fp32 too (no 8-bit activations), so kvlab's
perplexity and llama.cpp's on the copy differ by summation order only, which separates the
architecture's semantics (windows, RoPE bases, norms) from the two tools' rounding
(docs/benchmarks.md, "Gemma 3 against llama.cpp").

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install gguf numpy
    /tmp/venv/bin/python tests/bench/dequantize_gguf.py MODEL.gguf OUT.f32.gguf
"""
import sys

import gguf
import numpy as np


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    reader = gguf.GGUFReader(sys.argv[1])
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(sys.argv[2], arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    widened = []
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        widened.append((tensor.name, values))
        writer.add_tensor_info(tensor.name, values.shape, values.dtype, values.nbytes,
                               gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, values in widened:
        writer.write_tensor_data(values)
    writer.close()
    print(f"wrote {sys.argv[2]}: {len(widened)} tensors in F32")


if __name__ == "__main__":
    main()
