#include "kvlab/engine/sequence_rules.hpp"

#include <algorithm>

namespace kvlab {

bool SequenceRules::is_eos(std::int32_t token) const {
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end();
}

SequenceRules sequence_rules(const ModelConfig& model, const AttentionVariant& attention) {
  SequenceRules rules;
  rules.context = model.max_position_embeddings;
  rules.eos_token_ids = model.eos_token_ids;
  rules.window = attention.window() ? attention.window() : model.sliding_window;
  rules.caches_kv = attention.caches_kv();
  for (std::int64_t l = 0; l < model.num_hidden_layers; ++l)
    rules.layer_windows.push_back(attention.window() ? attention.window() : model.layer_window(l));
  return rules;
}

}  // namespace kvlab
