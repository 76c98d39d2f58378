// fixed_kv_heads: cache exactly `kv_heads` K/V heads, whatever the checkpoint has (the host
// mean-pools or repeats heads to match). An example of a plugin built out of tree.
#include <kvlab/plugin.hpp>

namespace {

class FixedKvHeads final : public kvlab::AttentionVariant {
 public:
  // Called through the plugin's `create`; throwing here becomes a clear error in the host.
  FixedKvHeads(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : kv_heads_(params.integer("kv_heads")) {}

  std::string check(const kvlab::ModelConfig& model) const override {
    if (model.num_attention_heads % kv_heads_ != 0)
      return "kv_heads " + std::to_string(kv_heads_) + " does not divide " +
             std::to_string(model.num_attention_heads);
    return {};
  }
  std::int64_t kv_heads(const kvlab::ModelConfig&) const override { return kv_heads_; }
  std::optional<std::int64_t> window() const override { return std::nullopt; }
  bool caches_kv() const override { return true; }

 private:
  std::int64_t kv_heads_;
};

// The parameter schema: name, type, description, default (TOML syntax), min, max.
const kvlab::ParamSpec kParams[] = {
    {"kv_heads", kvlab::ParamType::param_integer, "K/V heads to cache", "1", 1, 1 << 16},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, FixedKvHeads, "fixed_kv_heads",
             "cache a fixed number of K/V heads (example out-of-tree plugin)", kParams)
