// gqa: query heads share K/V heads in groups (Ainslie et al. 2023). group_size 0 keeps the
// checkpoint's own num_key_value_heads; otherwise heads / group_size K/V heads are cached and
// a checkpoint with more K/V heads is converted by mean-pooling each group.
#include "kvlab/plugin.hpp"

namespace {

class GqaAttention final : public kvlab::AttentionVariant {
 public:
  GqaAttention(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : group_size_(params.integer("group_size")) {}
  std::string check(const kvlab::ModelConfig& model) const override {
    if (group_size_ > 0 && model.num_attention_heads % group_size_ != 0)
      return "group_size " + std::to_string(group_size_) + " does not divide the " +
             std::to_string(model.num_attention_heads) + " query heads";
    return {};
  }
  std::int64_t kv_heads(const kvlab::ModelConfig& model) const override {
    return group_size_ == 0 ? model.num_key_value_heads : model.num_attention_heads / group_size_;
  }
  std::optional<std::int64_t> window() const override { return std::nullopt; }
  bool caches_kv() const override { return true; }

 private:
  std::int64_t group_size_;
};

const kvlab::ParamSpec kParams[] = {
    {"group_size", kvlab::ParamType::param_integer,
     "query heads per K/V head (0 = the checkpoint's num_key_value_heads)", "0", 0, 1 << 16},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, GqaAttention, "gqa",
             "grouped-query attention: each K/V head serves group_size query heads", kParams)
