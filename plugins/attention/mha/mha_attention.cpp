// mha: every query head has its own cached K/V head (Vaswani et al.). On a GQA/MQA checkpoint
// each KV head is repeated for its group, which computes exactly the same function.
#include "kvlab/plugin.hpp"

namespace {

class MhaAttention final : public kvlab::AttentionVariant {
 public:
  MhaAttention(const kvlab::PluginParams&, const kvlab::PluginContext&) {}
  std::string check(const kvlab::ModelConfig&) const override { return {}; }
  std::int64_t kv_heads(const kvlab::ModelConfig& model) const override {
    return model.num_attention_heads;
  }
  std::optional<std::int64_t> window() const override { return std::nullopt; }
  bool caches_kv() const override { return true; }
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, MhaAttention, "mha",
             "multi-head attention: one cached K/V head per query head", kvlab::kNoParams)
