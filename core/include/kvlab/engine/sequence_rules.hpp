#pragma once
// The rules every sequence of a run obeys, derived in one place from the model and the attention
// variant: the context, the stop tokens, the attention window, whether K/V are cached. The
// engine, the backends and `kvlab check` all take them from sequence_rules().
#include <cstdint>
#include <optional>
#include <vector>

#include "kvlab/attention_variant.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

struct SequenceRules {
  std::int64_t context = 0;  // tokens a sequence may hold: prompt + output
  std::vector<std::int32_t> eos_token_ids;
  // Attention reads only the last `window` positions; older KV may be released.
  std::optional<std::int64_t> window;
  // (model layers) each layer's window: `window` when set, else the model's own per layer
  // (Gemma 3's local layers). Empty: every layer reads `window`.
  std::vector<std::optional<std::int64_t>> layer_windows;
  bool caches_kv = true;  // false: the no-cache variant recomputes every sequence every step

  bool is_eos(std::int32_t token) const;
};

// context and EOS from the model; the window is the variant's when it sets one (the
// experiment's choice), else the model's own (config.json sliding_window, as Mistral's).
SequenceRules sequence_rules(const ModelConfig& model, const AttentionVariant& attention);

}  // namespace kvlab
