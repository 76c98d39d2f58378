#pragma once
// Test models with O(1) logits (random weights scaled up), so 1e-4 comparisons mean something.
#include "kvlab/cpu_reference/llama_weights.hpp"

namespace kvlab::test {

inline cpu::LlamaWeights scaled_random_weights(const ModelConfig& config, std::uint64_t seed) {
  cpu::LlamaWeights w = cpu::random_llama_weights(config, seed);
  auto scale = [](cpu::RowMatrix& m) { m *= 10.0f; };
  scale(w.embedding);
  for (auto& layer : w.layers) {
    for (cpu::RowMatrix* m : {&layer.w_qkv, &layer.wo, &layer.w_gate_up, &layer.w_down}) scale(*m);
    layer.attention_norm.setLinSpaced(0.5f, 1.5f);
    layer.mlp_norm.setLinSpaced(1.2f, 0.8f);
    if (config.is_mla()) {  // latent attention: kv_b_proj too, and a latent norm that varies
      scale(layer.w_kv_b);
      layer.kv_a_norm.setLinSpaced(0.7f, 1.3f);
    }
  }
  if (!config.tie_word_embeddings) scale(w.lm_head);
  return w;
}

}  // namespace kvlab::test
