#!/usr/bin/env python3
"""Writes a LLaMA GGUF with random fp32 weights in a preset's shape, for speed comparisons with
llama.cpp on the same file (tests/bench/compare_llamacpp.py quantizes it with llama-quantize).

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install gguf numpy
    /tmp/venv/bin/python tests/bench/make_random_gguf.py stories110m /tmp/stories110m.f32.gguf

No vocabulary (tokenizer.ggml.model = "none"): llama.cpp then runs on token ids, and kvlab takes
the vocabulary size from llama.vocab_size. Q and K rows are stored as convert_hf_to_gguf.py
stores them (permuted); for random weights the order does not change the speed.
"""
import sys

import gguf
import numpy as np

# name: vocab, dim, ffn, layers, heads, kv_heads, context (kvlab's presets, model_config.cpp)
SHAPES = {
    "stories15m": (32000, 288, 768, 6, 6, 6, 256),
    "stories110m": (32000, 768, 2048, 12, 12, 12, 1024),
}


def main(shape_name: str, out: str) -> None:
    vocab, dim, ffn, layers, heads, kv_heads, context = SHAPES[shape_name]
    head_dim = dim // heads
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(f"random {shape_name}")
    writer.add_context_length(context)
    writer.add_embedding_length(dim)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("none")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    def matrix(rows, cols):
        return rng.normal(0.0, 0.02, size=(rows, cols)).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(vocab, dim))  # tied: also the output
    for layer in range(layers):
        p = f"blk.{layer}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(dim, np.float32))
        writer.add_tensor(p + "attn_q.weight", matrix(heads * head_dim, dim))
        writer.add_tensor(p + "attn_k.weight", matrix(kv_heads * head_dim, dim))
        writer.add_tensor(p + "attn_v.weight", matrix(kv_heads * head_dim, dim))
        writer.add_tensor(p + "attn_output.weight", matrix(dim, heads * head_dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(dim, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", matrix(ffn, dim))
        writer.add_tensor(p + "ffn_up.weight", matrix(ffn, dim))
        writer.add_tensor(p + "ffn_down.weight", matrix(dim, ffn))
    writer.add_tensor("output_norm.weight", np.ones(dim, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print("wrote", out)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: make_random_gguf.py {{{','.join(SHAPES)}}} OUT.gguf")
    main(sys.argv[1], sys.argv[2])
