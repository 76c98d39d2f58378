// recompute: no KV cache survives a step — every step recomputes K and V of the whole
// sequence (the seed's O(S^2) baseline that the KV cache exists to avoid).
#include "kvlab/plugin.hpp"

namespace {

class RecomputeAttention final : public kvlab::AttentionVariant {
 public:
  RecomputeAttention(const kvlab::PluginParams&, const kvlab::PluginContext&) {}
  std::string check(const kvlab::ModelConfig&) const override { return {}; }
  std::int64_t kv_heads(const kvlab::ModelConfig& model) const override {
    return model.num_key_value_heads;
  }
  std::optional<std::int64_t> window() const override { return std::nullopt; }
  bool caches_kv() const override { return false; }
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, RecomputeAttention, "recompute",
             "no cache: recompute K/V of the whole sequence every step (O(S^2) baseline)",
             kvlab::kNoParams)
