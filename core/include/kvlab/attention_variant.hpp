#pragma once
// AttentionVariant: how query heads map to cached K/V heads and what is cached. A plugin kind.
// The backend asks it once, when it loads the model, and converts the checkpoint to match
// (mean-pooling K/V heads into groups, as in the GQA paper; cpu::convert_kv_heads).
#include <boost/config.hpp>
#include <cstdint>
#include <optional>
#include <string>

#include "kvlab/model_config.hpp"

namespace kvlab {

class BOOST_SYMBOL_VISIBLE AttentionVariant {
 public:
  virtual ~AttentionVariant() = default;
  // Empty when the variant can run `model`; otherwise why not (e.g. group size not dividing heads).
  virtual std::string check(const ModelConfig& model) const = 0;
  // K/V heads cached per layer for `model` (MHA: query heads; GQA: heads / group; MQA: 1).
  virtual std::int64_t kv_heads(const ModelConfig& model) const = 0;
  // Attend to the last `window` positions only; the rest may be released to the allocator.
  virtual std::optional<std::int64_t> window() const = 0;
  // false: no KV survives a step; every step recomputes K/V of the whole sequence (O(S^2)).
  virtual bool caches_kv() const = 0;
};

}  // namespace kvlab
