#pragma once
// A LLaMA-architecture model stored as GGUF (llama.cpp's convert_hf_to_gguf.py layout): its
// metadata as a kvlab ModelConfig, and its tensors under the Hugging Face names kvlab's loaders
// use, dequantized to fp32 and in Hugging Face's row order.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/model/gguf.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

// general.architecture must be "llama" or "gemma3"; its ARCH.* keys give the shape, RoPE base and
// RMSNorm eps (gemma3: the local window and its RoPE base, as llama.cpp reads them),
// tokenizer.ggml.* the vocabulary size and BOS/EOS; no output.weight means tied embeddings.
// Every missing or ill-typed key is listed in one kvlab::Error; then validate_model_config.
ModelConfig gguf_model_config(const GgufFile& file);

// The GGUF tensor that holds Hugging Face tensor `hf_name` (e.g. model.layers.3.self_attn.q_proj
// .weight -> blk.3.attn_q.weight); nullopt for a name neither LLaMA nor Gemma 3 has.
// `post_norms` (Gemma 3): post_attention_layernorm is the norm after the attention
// (blk.N.post_attention_norm), not LLaMA's before the MLP (blk.N.ffn_norm).
std::optional<std::string> gguf_tensor_name(const std::string& hf_name, bool post_norms = false);

// Tensor `hf_name` as fp32 in Hugging Face layout (row-major (out, in)), checked against
// `shape`. llama.cpp's conversion interleaves the two RoPE halves of every Q and K head
// (permute(): rows (2, head_dim/2) -> (head_dim/2, 2)); they are put back, so the same RoPE
// code serves safetensors and GGUF. Throws kvlab::Error naming file and tensor.
void read_gguf_tensor(const GgufFile& file, const ModelConfig& config, const std::string& hf_name,
                      std::span<const std::int64_t> shape, std::span<float> destination);

}  // namespace kvlab
