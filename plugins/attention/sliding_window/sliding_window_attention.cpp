// sliding_window: each position attends to the last `window` positions only (Mistral), so
// older KV can be released to the allocator (the paged allocator frees whole blocks).
#include "kvlab/plugin.hpp"

namespace {

class SlidingWindowAttention final : public kvlab::AttentionVariant {
 public:
  SlidingWindowAttention(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : window_(params.integer("window")) {}
  std::string check(const kvlab::ModelConfig&) const override { return {}; }
  std::int64_t kv_heads(const kvlab::ModelConfig& model) const override {
    return model.num_key_value_heads;
  }
  std::optional<std::int64_t> window() const override { return window_; }
  bool caches_kv() const override { return true; }

 private:
  std::int64_t window_;
};

const kvlab::ParamSpec kParams[] = {
    {"window", kvlab::ParamType::param_integer, "positions each query attends to (itself included)",
     "4096", 1, 1 << 30},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::attention_variant, SlidingWindowAttention, "sliding_window",
             "attend to the last `window` positions; older KV is released to the allocator",
             kParams)
