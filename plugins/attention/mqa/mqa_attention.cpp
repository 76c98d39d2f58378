// mqa: all query heads share one cached K/V head (Shazeer 2019): KV memory 1/heads of MHA.
// A checkpoint with more K/V heads is converted by mean-pooling them all into one.
#include "kvlab/plugin.hpp"

namespace {

class MqaAttention final : public kvlab::AttentionVariant {
 public:
  MqaAttention(const kvlab::PluginParams&, const kvlab::PluginContext&) {}
  std::string check(const kvlab::ModelConfig&) const override { return {}; }
  std::int64_t kv_heads(const kvlab::ModelConfig&) const override { return 1; }
  std::optional<std::int64_t> window() const override { return std::nullopt; }
  bool caches_kv() const override { return true; }
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, MqaAttention, "mqa",
             "multi-query attention: one cached K/V head shared by all query heads",
             kvlab::kNoParams)
