#include "kvlab/model_config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numbers>
#include <sstream>

#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

using nlohmann::json;

bool ModelConfig::is_eos(std::int32_t token) const {
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end();
}

std::optional<std::int64_t> ModelConfig::layer_window(std::int64_t layer) const {
  if (is_local_layer(layer)) return local_window;
  return sliding_window;
}

double ModelConfig::layer_rope_theta(std::int64_t layer) const {
  return is_local_layer(layer) && rope_local_theta > 0 ? rope_local_theta : rope_theta;
}

std::int64_t ModelConfig::attention_parameter_count() const {
  if (!is_mla()) return hidden_size * q_dim() * 2 + hidden_size * kv_dim() * 2;
  const std::int64_t q =
      q_lora_rank > 0 ? hidden_size * q_lora_rank + q_lora_rank * q_dim() : hidden_size * q_dim();
  const std::int64_t kv_b = kv_lora_rank * num_attention_heads * (qk_nope_head_dim + v_head_dim);
  return q + hidden_size * latent_dim() + kv_b + attention_output_dim() * hidden_size;
}

std::int64_t ModelConfig::mlp_parameter_count(std::int64_t layer, bool active_only) const {
  if (!is_expert_layer(layer)) return 3 * hidden_size * intermediate_size;
  const std::int64_t experts_used =
      (active_only ? experts.per_token : experts.routed) + experts.shared;
  return experts_used * 3 * hidden_size * experts.intermediate_size + hidden_size * experts.routed;
}

std::int64_t ModelConfig::matmul_parameter_count() const {
  std::int64_t layers = 0;
  for (std::int64_t l = 0; l < num_hidden_layers; ++l)
    layers += attention_parameter_count() + mlp_parameter_count(l, true);
  return layers + vocab_size * hidden_size;
}

std::int64_t ModelConfig::parameter_count() const {
  const std::int64_t mla_norms = is_mla() ? kv_lora_rank + q_lora_rank : 0;
  const std::int64_t layer_norms =
      (post_norms ? 4 : 2) * hidden_size + (qk_norm ? 2 * head_dim : 0) + mla_norms;
  const std::int64_t norms = num_hidden_layers * layer_norms + hidden_size;
  const std::int64_t embedding = vocab_size * hidden_size;
  std::int64_t layers = 0;
  for (std::int64_t l = 0; l < num_hidden_layers; ++l)
    layers += attention_parameter_count() + mlp_parameter_count(l, false);
  // The output projection, and the embedding unless the two are one matrix.
  return layers + embedding + norms + (tie_word_embeddings ? 0 : embedding);
}

double forward_flops(const ModelConfig& c, std::int64_t tokens, std::int64_t logit_positions) {
  const double lm_head_parameters = static_cast<double>(c.vocab_size * c.hidden_size);
  const double layer_matmuls =  // every layer's, a token
      2.0 * (static_cast<double>(c.matmul_parameter_count()) - lm_head_parameters);
  double attended_keys = 0;  // sum over positions of the keys each query sees
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::optional<std::int64_t> window = c.layer_window(l);
    for (std::int64_t t = 0; t < tokens; ++t)
      attended_keys += static_cast<double>(window ? std::min(t + 1, *window) : t + 1);
  }
  // QK^T over head_dim and PV over the value heads: 2 FLOPs a value per (query head, key),
  // summed over the layers (MLA: the plain form, K and V rebuilt per head).
  const double attention =
      2.0 * static_cast<double>(c.q_dim() + c.attention_output_dim()) * attended_keys;
  return layer_matmuls * static_cast<double>(tokens) + attention +
         2.0 * lm_head_parameters * static_cast<double>(logit_positions);
}

const char* rope_type_name(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::linear:
      return "linear";
    case RopeScaling::Type::llama3:
      return "llama3";
    case RopeScaling::Type::none:
      break;
  }
  return "default";
}

std::vector<double> rope_inverse_frequencies(const ModelConfig& c) {
  const RopeScaling& r = c.rope_scaling;
  const std::int64_t rotated = c.rope_dim();
  std::vector<double> inverse(static_cast<std::size_t>(rotated / 2));
  for (std::size_t i = 0; i < inverse.size(); ++i)
    inverse[i] =
        std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotated));
  if (r.type == RopeScaling::Type::linear)
    for (double& f : inverse) f /= r.factor;
  if (r.type == RopeScaling::Type::llama3) {
    const auto original = static_cast<double>(r.original_max_position_embeddings);
    const double low_freq_wavelength = original / r.low_freq_factor;    // longer: divided
    const double high_freq_wavelength = original / r.high_freq_factor;  // shorter: kept
    for (double& f : inverse) {
      const double wavelength = 2.0 * std::numbers::pi / f;
      if (wavelength > low_freq_wavelength) {
        f /= r.factor;
      } else if (wavelength >= high_freq_wavelength) {
        const double smooth =
            (original / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = (1.0 - smooth) * f / r.factor + smooth * f;
      }
    }
  }
  return inverse;
}

namespace {

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> names{"LlamaForCausalLM", "MistralForCausalLM",
                                              "Gemma3ForCausalLM", "DeepseekV2ForCausalLM",
                                              "DeepseekV3ForCausalLM"};
  return names;
}

// An integer JSON value as T when it fits (json's get<T> would silently wrap).
template <typename T>
std::optional<T> json_integer_as(const json& value) {
  if (value.is_number_unsigned()) return narrow_integer<T>(value.get<std::uint64_t>());
  return narrow_integer<T>(value.get<std::int64_t>());
}

// Reads config.json fields with their type checked; collects problems instead of stopping at
// the first so one run shows everything that is wrong.
class FieldReader {
 public:
  // `prefix` names the object read ("rope_parameters.") in messages; empty for the root.
  FieldReader(const json& root, std::vector<std::string>& problems, std::string prefix = "")
      : root_(root), problems_(problems), prefix_(std::move(prefix)) {}

  template <typename T>
  std::optional<T> get(const char* key, bool required) {
    auto it = root_.find(key);
    if (it == root_.end() || it->is_null()) {
      if (required)
        problems_.push_back(fmt::format("missing required field \"{}{}\"", prefix_, key));
      return std::nullopt;
    }
    return convert<T>(key, *it);
  }

  // `value` as T, or a problem naming `key`: integers must fit T (2^32 + 1 is not an int32).
  template <typename T>
  std::optional<T> convert(const char* key, const json& value) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!value.is_boolean()) return wrong_type<T>(key, "a boolean", value);
    } else if constexpr (std::is_integral_v<T>) {
      if (!value.is_number_integer()) return wrong_type<T>(key, "an integer", value);
      if (auto fitted = json_integer_as<T>(value)) return fitted;
      problems_.push_back(fmt::format("field \"{}{}\" = {} does not fit in {} bits", prefix_, key,
                                      value.dump(), sizeof(T) * 8));
      return std::nullopt;
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!value.is_number()) return wrong_type<T>(key, "a number", value);
    } else {
      if (!value.is_string()) return wrong_type<T>(key, "a string", value);
    }
    return value.get<T>();
  }

 private:
  template <typename T>
  std::optional<T> wrong_type(const char* key, const char* expected, const json& value) {
    problems_.push_back(
        fmt::format("field \"{}{}\" must be {}, got {}", prefix_, key, expected, value.dump()));
    return std::nullopt;
  }
  const json& root_;
  std::vector<std::string>& problems_;
  std::string prefix_;
};

// The object that holds RoPE's parameters: "rope_parameters" (transformers >= 5: theta, type
// and scaling together) or "rope_scaling" (before: type and scaling, theta at the top level).
// Both may appear only when they agree. nullptr when neither is set.
const json* rope_section(const json& root, std::vector<std::string>& problems) {
  const json* found = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) continue;
    if (!it->is_object()) {
      problems.push_back(fmt::format("\"{}\" must be an object, got {}", key, it->dump()));
      return nullptr;
    }
    if (found && *found != *it) {
      problems.push_back(fmt::format("\"rope_parameters\" {} and \"rope_scaling\" {} disagree",
                                     found->dump(), it->dump()));
      return nullptr;
    }
    found = &*it;
  }
  return found;
}

// RoPE theta and scaling from either config style; an unknown type or key is refused by name,
// since computing plain RoPE for a scaled checkpoint gives a different model.
void read_rope(const json& root, ModelConfig& c, std::vector<std::string>& problems) {
  FieldReader top(root, problems);
  const auto top_theta = top.get<double>("rope_theta", false);
  c.rope_theta = top_theta.value_or(10000.0);
  const json* section = rope_section(root, problems);
  if (!section) return;
  const bool is_parameters = root.contains("rope_parameters") && !root["rope_parameters"].is_null();
  const std::string prefix = is_parameters ? "rope_parameters." : "rope_scaling.";
  static const std::vector<std::string> known{"rope_type",
                                              "type",
                                              "rope_theta",
                                              "factor",
                                              "low_freq_factor",
                                              "high_freq_factor",
                                              "original_max_position_embeddings"};
  for (const auto& [key, value] : section->items())
    if (std::find(known.begin(), known.end(), key) == known.end())
      problems.push_back(fmt::format("\"{}{}\" is not supported (kvlab reads {})", prefix, key,
                                     join_names(known)));
  FieldReader read(*section, problems, prefix);
  if (auto theta = read.get<double>("rope_theta", false)) {
    if (top_theta && *top_theta != *theta)
      problems.push_back(fmt::format("\"rope_theta\" {} and \"{}rope_theta\" {} disagree",
                                     *top_theta, prefix, *theta));
    c.rope_theta = *theta;
  }
  auto type = read.get<std::string>("rope_type", false);
  if (!type) type = read.get<std::string>("type", false);
  const std::string name = type.value_or("default");
  RopeScaling& r = c.rope_scaling;
  if (name == "default") {
    r.type = RopeScaling::Type::none;
  } else if (name == "linear") {
    r.type = RopeScaling::Type::linear;
    r.factor = read.get<double>("factor", true).value_or(1.0);
  } else if (name == "llama3") {
    r.type = RopeScaling::Type::llama3;
    r.factor = read.get<double>("factor", true).value_or(1.0);
    r.low_freq_factor = read.get<double>("low_freq_factor", true).value_or(1.0);
    r.high_freq_factor = read.get<double>("high_freq_factor", true).value_or(4.0);
    r.original_max_position_embeddings =
        read.get<std::int64_t>("original_max_position_embeddings", true).value_or(8192);
  } else {
    problems.push_back(fmt::format(
        "RoPE type \"{}\" ({}rope_type) is not supported: kvlab implements default, linear and "
        "llama3",
        name, prefix));
  }
}

void throw_problems(std::string_view source, const std::vector<std::string>& problems) {
  if (problems.empty()) return;
  std::string message = fmt::format("invalid model config {}:", source);
  for (const auto& problem : problems) message += "\n  - " + problem;
  throw Error(message);
}

}  // namespace

namespace {

constexpr double kMaxParameters = 1125899906842624.0;  // 2^50: 1,000x the largest models

// parameter_count() in doubles, which cannot overflow, to check it before using integers.
double approximate_parameter_count(const ModelConfig& c) {
  const auto d = [](std::int64_t v) { return static_cast<double>(std::max<std::int64_t>(v, 0)); };
  const double q_dim = d(c.num_attention_heads) * d(c.head_dim);
  const double kv_dim = d(c.num_key_value_heads) * d(c.head_dim);
  const double mla = d(c.hidden_size) * (d(c.q_lora_rank) + d(c.kv_lora_rank)) +
                     (d(c.q_lora_rank) + d(c.kv_lora_rank)) * d(c.num_attention_heads) *
                         (d(c.head_dim) + d(c.v_head_dim));
  const double experts = (d(c.experts.routed) + d(c.experts.shared)) * 3 * d(c.hidden_size) *
                         d(c.experts.intermediate_size);
  const double layer =
      d(c.hidden_size) * (2 * q_dim + 2 * kv_dim + 3 * d(c.intermediate_size)) + mla + experts;
  return d(c.num_hidden_layers) * layer + 2 * d(c.vocab_size) * d(c.hidden_size);
}

using Reported = std::function<bool(const char* key)>;  // the key's reading already failed

// The dimensions: positive, each and their product within what 64-bit sizes hold, heads that
// group evenly, a head_dim RoPE can rotate.
void dimension_problems(const ModelConfig& c, const Reported& reported,
                        std::vector<std::string>& problems) {
  const std::pair<const char*, std::int64_t> dims[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings}};
  for (auto [key, value] : dims)
    if (value <= 0 && !reported(key))
      problems.push_back(fmt::format("\"{}\" must be positive, got {}", key, value));
  // Every size kvlab derives from a config (parameter and FLOP counts, KV bytes per token, pool
  // offsets) is a product of these dims in 64-bit integers: bound each dim, and the total.
  constexpr std::int64_t kMaxDim = std::int64_t{1} << 31;
  for (auto [key, value] : dims)
    if (value > kMaxDim)
      problems.push_back(
          fmt::format("\"{}\" = {} is larger than kvlab's limit of 2^31", key, value));
  if (approximate_parameter_count(c) > kMaxParameters)
    problems.push_back(fmt::format(
        "the shape describes {:.3g} parameters, more than kvlab's limit of {:.3g} (2^50)",
        approximate_parameter_count(c), kMaxParameters));
  if (c.num_attention_heads > 0 && c.num_key_value_heads > 0 &&
      c.num_attention_heads % c.num_key_value_heads != 0)
    problems.push_back(fmt::format(
        "num_attention_heads ({}) must be divisible by num_key_value_heads ({}): each KV head "
        "serves a whole group of query heads",
        c.num_attention_heads, c.num_key_value_heads));
  if (c.head_dim > 0 && c.head_dim % 2 != 0)
    problems.push_back(
        fmt::format("head_dim ({}) must be even: RoPE rotates pairs of dimensions", c.head_dim));
}

// RMSNorm's epsilon, RoPE's base and its scaling.
void norm_and_rope_problems(const ModelConfig& c, const Reported& reported,
                            std::vector<std::string>& problems) {
  if (!(c.rms_norm_eps > 0 && std::isfinite(c.rms_norm_eps)) && !reported("rms_norm_eps"))
    problems.push_back(
        fmt::format("\"rms_norm_eps\" must be positive and finite, got {}", c.rms_norm_eps));
  if (!(c.rope_theta > 0 && std::isfinite(c.rope_theta)) && !reported("rope_theta"))
    problems.push_back(
        fmt::format("\"rope_theta\" must be positive and finite, got {}", c.rope_theta));
  const RopeScaling& rope = c.rope_scaling;
  if (rope.type != RopeScaling::Type::none && !(rope.factor > 0 && std::isfinite(rope.factor)))
    problems.push_back(fmt::format("RoPE scaling factor must be positive, got {}", rope.factor));
  if (rope.type == RopeScaling::Type::llama3) {
    if (!(rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor &&
          std::isfinite(rope.high_freq_factor)))
      problems.push_back(
          fmt::format("llama3 RoPE needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                      rope.low_freq_factor, rope.high_freq_factor));
    if (rope.original_max_position_embeddings <= 0)
      problems.push_back(
          fmt::format("llama3 RoPE original_max_position_embeddings must be "
                      "positive, got {}",
                      rope.original_max_position_embeddings));
  }
}

// A latent-attention model's heads and cached row.
void latent_shape_problems(const ModelConfig& c, std::vector<std::string>& problems) {
  const std::int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  const bool heads_fit = nope > 0 && rope > 0 && rope % 2 == 0 && c.v_head_dim > 0;
  if (!heads_fit || c.head_dim != nope + rope)
    problems.push_back(fmt::format(
        "latent attention needs positive qk_nope_head_dim, an even qk_rope_head_dim, a "
        "positive v_head_dim and head_dim = qk_nope_head_dim + qk_rope_head_dim; got {}, {}, "
        "{}, head_dim {}",
        nope, rope, c.v_head_dim, c.head_dim));
  if (c.latent_dim() % 2 != 0)
    problems.push_back(fmt::format(
        "latent attention's cached row, kv_lora_rank + qk_rope_head_dim = {}, must be even "
        "(its halves are a slot's K and V rows)",
        c.latent_dim()));
  if (c.num_key_value_heads != c.num_attention_heads)
    problems.push_back(
        "latent attention rebuilds K and V for every query head: "
        "num_key_value_heads must equal num_attention_heads");
  if (c.qk_norm || c.post_norms || c.global_layer_every > 0 || c.sliding_window)
    problems.push_back("latent attention with Q/K norms, post norms or windows is not computed");
}

// Latent attention's dims (MLA): consistent with each other and with what kvlab computes.
void latent_problems(const ModelConfig& c, std::vector<std::string>& problems) {
  const std::int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim;
  if (c.kv_lora_rank < 0 || c.q_lora_rank < 0 || nope < 0 || rope < 0 || c.v_head_dim < 0)
    problems.push_back("latent attention's ranks and head dims must be non-negative");
  if (!c.is_mla()) {
    if (c.q_lora_rank > 0 || nope > 0 || rope > 0 || c.v_head_dim > 0)
      problems.push_back(
          "q_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim describe latent "
          "attention: they need kv_lora_rank > 0");
    return;
  }
  latent_shape_problems(c, problems);
}

// A mixture of experts' sizes, and what kvlab runs: q_proj direct (DeepSeek-V2-Lite's
// attention) and dense MLPs.
void expert_problems(const ModelConfig& c, std::vector<std::string>& problems) {
  const ModelConfig::Experts& e = c.experts;
  const bool sized = e.per_token >= 1 && e.per_token <= e.routed && e.intermediate_size > 0 &&
                     e.shared >= 0 && e.first_dense_layers >= 0 &&
                     e.first_dense_layers <= c.num_hidden_layers;
  if (e.routed < 0 || (e.routed > 0 && !sized))
    problems.push_back(fmt::format(
        "a mixture of experts needs 1 <= experts a token <= {} routed experts, a positive "
        "expert width and first dense layers within the {} layers",
        e.routed, c.num_hidden_layers));
  if (!c.size_only && (c.q_lora_rank > 0 || c.has_experts()))
    problems.push_back(
        "kvlab computes latent attention with q_proj direct (q_lora_rank 0) and dense MLPs: a "
        "compressed query or a mixture of experts is described for memory and the simulator "
        "only (a size-only preset: deepseek-v3)");
}

// Every problem with `c`, skipping fields whose reading already failed (`already_reported`).
std::vector<std::string> config_problems(const ModelConfig& c,
                                         const std::vector<std::string>& already_reported) {
  std::vector<std::string> problems;
  const Reported reported = [&](const char* key) {
    const std::string quoted = fmt::format("\"{}\"", key);
    return std::any_of(already_reported.begin(), already_reported.end(),
                       [&](const std::string& p) { return p.find(quoted) != std::string::npos; });
  };
  dimension_problems(c, reported, problems);
  norm_and_rope_problems(c, reported, problems);
  latent_problems(c, problems);
  expert_problems(c, problems);
  if (c.vocab_size > 0) {
    if (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size)
      problems.push_back(fmt::format("bos_token_id {} is outside the vocabulary [0, {})",
                                     c.bos_token_id, c.vocab_size));
    for (auto eos : c.eos_token_ids)
      if (eos < 0 || eos >= c.vocab_size)
        problems.push_back(
            fmt::format("eos_token_id {} is outside the vocabulary [0, {})", eos, c.vocab_size));
  }
  if (c.global_layer_every < 0 || (c.global_layer_every > 0 && c.local_window <= 0))
    problems.push_back(fmt::format(
        "local:global layers need a positive local window and layer period, got window {} "
        "every {}",
        c.local_window, c.global_layer_every));
  if (c.embedding_scale <= 0 || !std::isfinite(c.embedding_scale) || c.query_scale < 0 ||
      !std::isfinite(c.query_scale) || c.rope_local_theta < 0)
    problems.push_back(
        "the embedding scale must be positive and the query scale and local RoPE "
        "base non-negative, all finite");
  if (c.sliding_window && *c.sliding_window <= 0)
    problems.push_back(
        fmt::format("\"sliding_window\" must be positive, got {}", *c.sliding_window));
  const auto& architectures = supported_architectures();
  if (std::find(architectures.begin(), architectures.end(), c.architecture) == architectures.end())
    problems.push_back(fmt::format("architecture \"{}\" is not supported (kvlab runs {})",
                                   c.architecture, join_names(architectures)));
  return problems;
}

// "architectures": one name; or, without it, the name model_type implies.
void read_architecture(const json& root, FieldReader& read, ModelConfig& c,
                       std::vector<std::string>& problems) {
  if (auto it = root.find("architectures"); it != root.end()) {
    if (!it->is_array() || it->size() != 1 || !(*it)[0].is_string())
      problems.push_back(
          "\"architectures\" must be a list with one name, e.g. [\"LlamaForCausalLM\"]");
    else
      c.architecture = (*it)[0].get<std::string>();
  } else if (auto model_type = read.get<std::string>("model_type", false)) {
    c.architecture = *model_type == "mistral" ? "MistralForCausalLM"
                     : *model_type == "llama" ? "LlamaForCausalLM"
                                              : *model_type;
  }
}

// head_dim, or hidden_size / num_attention_heads when it is not set.
void read_head_dim(FieldReader& read, ModelConfig& c, std::vector<std::string>& problems) {
  if (auto head_dim = read.get<std::int64_t>("head_dim", false)) {
    c.head_dim = *head_dim;
  } else if (c.num_attention_heads > 0) {
    if (c.hidden_size % c.num_attention_heads != 0)
      problems.push_back(fmt::format(
          "hidden_size ({}) must be divisible by num_attention_heads ({}) when head_dim is not set",
          c.hidden_size, c.num_attention_heads));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
}

// eos_token_id: one id or a list of them (null: the default).
void read_eos(const json& root, FieldReader& read, ModelConfig& c,
              std::vector<std::string>& problems) {
  if (auto it = root.find("eos_token_id"); it != root.end() && !it->is_null()) {
    c.eos_token_ids.clear();
    if (it->is_number_integer()) {
      if (auto id = read.convert<std::int32_t>("eos_token_id", *it)) c.eos_token_ids.push_back(*id);
    } else if (it->is_array() &&
               std::all_of(it->begin(), it->end(),
                           [](const json& v) { return v.is_number_integer(); }) &&
               !it->empty()) {
      for (const auto& v : *it)
        if (auto id = read.convert<std::int32_t>("eos_token_id", v)) c.eos_token_ids.push_back(*id);
    } else {
      problems.push_back(fmt::format(
          "\"eos_token_id\" must be an integer or a list of integers, got {}", it->dump()));
    }
  }
}

// Features that would change the math: refuse them rather than compute something else.
void refuse_other_math(FieldReader& read, std::vector<std::string>& problems) {
  if (auto act = read.get<std::string>("hidden_act", false); act && *act != "silu")
    problems.push_back(fmt::format(
        "hidden_act \"{}\" is not supported (kvlab implements SwiGLU with silu)", *act));
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (read.get<bool>(key, false).value_or(false))
      problems.push_back(
          fmt::format("\"{}\": true is not supported (LLaMA projections have no bias)", key));
}

}  // namespace

void validate_model_config(const ModelConfig& c, std::string_view source) {
  throw_problems(source, config_problems(c, {}));
}

ModelConfig parse_model_config(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(fmt::format("invalid model config {}: not valid JSON: {}", source, e.what()));
  }
  if (!root.is_object())
    throw Error(fmt::format("invalid model config {}: expected a JSON object", source));

  std::vector<std::string> problems;
  FieldReader read(root, problems);
  ModelConfig c;
  c.name = std::string(source);
  read_architecture(root, read, c, problems);
  c.vocab_size = read.get<std::int64_t>("vocab_size", true).value_or(0);
  c.hidden_size = read.get<std::int64_t>("hidden_size", true).value_or(0);
  c.intermediate_size = read.get<std::int64_t>("intermediate_size", true).value_or(0);
  c.num_hidden_layers = read.get<std::int64_t>("num_hidden_layers", true).value_or(0);
  c.num_attention_heads = read.get<std::int64_t>("num_attention_heads", true).value_or(0);
  c.num_key_value_heads =
      read.get<std::int64_t>("num_key_value_heads", false).value_or(c.num_attention_heads);
  c.max_position_embeddings = read.get<std::int64_t>("max_position_embeddings", true).value_or(0);
  c.rms_norm_eps = read.get<double>("rms_norm_eps", false).value_or(1e-6);
  read_rope(root, c, problems);
  c.tie_word_embeddings = read.get<bool>("tie_word_embeddings", false).value_or(false);
  c.bos_token_id = read.get<std::int32_t>("bos_token_id", false).value_or(1);
  read_head_dim(read, c, problems);
  read_eos(root, read, c, problems);
  c.sliding_window = read.get<std::int64_t>("sliding_window", false);
  if (c.architecture.starts_with("Deepseek"))
    problems.push_back(fmt::format(
        "a {} folder is not read (its experts and compressed queries are not computed): "
        "DeepSeek's shapes are presets (mla-tiny runs; deepseek-v2-lite and deepseek-v3 are "
        "size-only)",
        c.architecture));
  if (c.is_gemma3())
    problems.push_back(
        "a Gemma3ForCausalLM folder is not read: run Gemma 3 from its GGUF file (`kvlab model "
        "info` reads it; scripts/get_model.sh gemma3 fetches one), whose norms hold Gemma's 1 + w "
        "already");
  refuse_other_math(read, problems);
  for (auto& problem : config_problems(c, problems)) problems.push_back(std::move(problem));
  throw_problems(source, problems);
  return c;
}

ModelConfig load_model_config(const std::filesystem::path& path) {
  const auto file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw Error(
        fmt::format("cannot read model config {}: file not found or not readable", file.string()));
  std::stringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), file.string());
}

std::string model_config_to_json(const ModelConfig& c, std::string_view torch_dtype) {
  json root = {
      {"architectures", {c.architecture}},
      {"model_type", c.architecture == "MistralForCausalLM" ? "mistral" : "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"bos_token_id", c.bos_token_id},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"torch_dtype", torch_dtype},
  };
  if (c.eos_token_ids.size() == 1)
    root["eos_token_id"] = c.eos_token_ids[0];
  else
    root["eos_token_id"] = c.eos_token_ids;
  if (c.sliding_window) root["sliding_window"] = *c.sliding_window;
  const RopeScaling& r = c.rope_scaling;
  if (r.type == RopeScaling::Type::linear)
    root["rope_scaling"] = {{"rope_type", "linear"}, {"factor", r.factor}};
  if (r.type == RopeScaling::Type::llama3)
    root["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", r.factor},
        {"low_freq_factor", r.low_freq_factor},
        {"high_freq_factor", r.high_freq_factor},
        {"original_max_position_embeddings", r.original_max_position_embeddings}};
  return root.dump(2) + "\n";
}

namespace {

struct PresetSpec {
  const char* name;
  std::int64_t vocab, dim, ffn, layers, heads, kv_heads, context;
  double eps, theta;
  bool tied, size_only;
  std::optional<std::int64_t> sliding_window;
  RopeScaling rope_scaling = {};
};

// Published shapes: LLaMA (Touvron et al. 2023, Table 2), Llama 2 7B/13B/70B, Mistral 7B v0.1
// and Llama 3.1 8B config.json, llama2.c's TinyStories models (stories15M/110M), TinyLlama-1.1B
// (GQA 32/4: the 1B-class model of the GPU benchmarks; runnable with random weights).
const PresetSpec kPresets[] = {
    {"tiny", 512, 64, 176, 2, 4, 2, 512, 1e-5, 10000.0, false, false, std::nullopt},
    {"stories15m", 32000, 288, 768, 6, 6, 6, 256, 1e-5, 10000.0, true, false, std::nullopt},
    {"stories110m", 32000, 768, 2048, 12, 12, 12, 1024, 1e-5, 10000.0, true, false, std::nullopt},
    {"tinyllama-1.1b", 32000, 2048, 5632, 22, 32, 4, 2048, 1e-5, 10000.0, false, false,
     std::nullopt},
    {"llama-7b", 32000, 4096, 11008, 32, 32, 32, 2048, 1e-6, 10000.0, false, true, std::nullopt},
    {"llama-13b", 32000, 5120, 13824, 40, 40, 40, 2048, 1e-6, 10000.0, false, true, std::nullopt},
    {"llama-65b", 32000, 8192, 22016, 80, 64, 64, 2048, 1e-5, 10000.0, false, true, std::nullopt},
    {"llama2-7b", 32000, 4096, 11008, 32, 32, 32, 4096, 1e-5, 10000.0, false, true, std::nullopt},
    {"llama2-13b", 32000, 5120, 13824, 40, 40, 40, 4096, 1e-5, 10000.0, false, true, std::nullopt},
    {"llama2-70b", 32000, 8192, 28672, 80, 64, 8, 4096, 1e-5, 10000.0, false, true, std::nullopt},
    {"mistral-7b", 32000, 4096, 14336, 32, 32, 8, 32768, 1e-5, 10000.0, false, true, 4096},
    // Llama 3.1 8B config.json: 128K context through llama3 RoPE scaling (factor 8 over 8192).
    {"llama3.1-8b", 128256, 4096, 14336, 32, 32, 8, 131072, 1e-5, 500000.0, false, true,
     std::nullopt, RopeScaling{RopeScaling::Type::llama3, 8.0, 1.0, 4.0, 8192}},
    // Llama 3.2 1B config.json (tied embeddings, llama3 RoPE factor 32): Llama 3.1's vocabulary,
    // the usual draft model for it in speculative decoding.
    {"llama3.2-1b", 128256, 2048, 8192, 16, 32, 8, 131072, 1e-5, 500000.0, true, true, std::nullopt,
     RopeScaling{RopeScaling::Type::llama3, 32.0, 1.0, 4.0, 8192}},
    // OPT-13B (Zhang et al. 2022; DistServe's model) as a LLaMA-shaped stand-in with OPT's
    // sizes: hidden 5120, 40 layers, 40 heads (MHA), vocab 50,272, context 2,048, tied
    // embeddings. OPT's MLP is two 5120 x 20480 matrices (8 h^2 a layer); three of 5120 x 13,653
    // hold the same weights and FLOPs to 0.01%. Biases, LayerNorm and learned positions (~0.1% of
    // the parameters) are left out: 12.84B against OPT's 12.85B.
    {"opt-13b", 50272, 5120, 13653, 40, 40, 40, 2048, 1e-5, 10000.0, true, true, std::nullopt},
};

// Gemma 3 (local:global attention): the published config.json shapes. One global layer in
// every 6, the local layers' RoPE base 10,000, the global layers' 1,000,000 (from 4B on with
// linear RoPE scaling 8, to 128K context). gemma3-tiny: the same architecture at the size of
// `tiny`, with an 8-token window, so that short tests cross windows (runnable, random weights).
struct GemmaPresetSpec {
  const char* name;
  std::int64_t vocab, dim, ffn, layers, heads, kv_heads, head_dim, window, context;
  double query_pre_attention_scalar, rope_factor;
  bool size_only;
};
const GemmaPresetSpec kGemmaPresets[] = {
    {"gemma3-tiny", 512, 64, 176, 6, 4, 1, 16, 8, 512, 16, 1.0, false},
    {"gemma3-1b", 262144, 1152, 6912, 26, 4, 1, 256, 512, 32768, 256, 1.0, true},
    {"gemma3-4b", 262208, 2560, 10240, 34, 8, 4, 256, 1024, 131072, 256, 8.0, true},
    {"gemma3-12b", 262208, 3840, 15360, 48, 16, 8, 256, 1024, 131072, 256, 8.0, true},
    {"gemma3-27b", 262208, 5376, 21504, 62, 32, 16, 128, 1024, 131072, 168, 8.0, true},
};

// A preset's shape: name, sizes and context (the rest ModelConfig's defaults).
ModelConfig preset_shape(const char* name, std::int64_t vocab, std::int64_t dim, std::int64_t ffn,
                         std::int64_t layers, std::int64_t heads, std::int64_t kv_heads,
                         std::int64_t head_dim, std::int64_t context) {
  ModelConfig c;
  c.name = name;
  c.vocab_size = vocab;
  c.hidden_size = dim;
  c.intermediate_size = ffn;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.max_position_embeddings = context;
  return c;
}

ModelConfig gemma3_preset(const GemmaPresetSpec& p) {
  ModelConfig c = preset_shape(p.name, p.vocab, p.dim, p.ffn, p.layers, p.heads, p.kv_heads,
                               p.head_dim, p.context);
  c.architecture = "Gemma3ForCausalLM";
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  if (p.rope_factor != 1.0) c.rope_scaling = {RopeScaling::Type::linear, p.rope_factor};
  c.tie_word_embeddings = true;
  c.size_only = p.size_only;
  c.global_layer_every = 6;
  c.local_window = p.window;
  c.rope_local_theta = 10000.0;
  c.embedding_scale = std::sqrt(static_cast<double>(p.dim));
  c.query_scale = 1.0 / std::sqrt(p.query_pre_attention_scalar);
  c.qk_norm = true;
  c.post_norms = true;
  c.activation = ModelConfig::Activation::gelu_tanh;
  c.bos_token_id = 2;
  c.eos_token_ids = {1};
  return c;
}

// DeepSeek's latent attention (MLA), config.json shapes: DeepSeek-V2-Lite (15.7B, q_proj direct,
// 64 routed experts of which 6 a token, 2 shared, layer 0 dense) and DeepSeek-V3 (671B, a
// compressed query of rank 1536, 256 routed experts of which 8, 1 shared, layers 0-2 dense); both
// size-only (their YaRN RoPE scaling is left out: it changes no size). mla-tiny: V2-Lite's
// attention at the size of `tiny` (kv_lora_rank = hidden / 4, nope = v = 2 rope, heads x nope =
// hidden), dense MLPs, runnable with random weights. llama2-7b-mla: Llama 2 7B with V2's
// attention in every layer (kv_lora_rank 512), for MHA / GQA / MLA at one model size (size-only).
struct LatentPresetSpec {
  const char* name;
  const char* architecture;
  std::int64_t vocab, dim, ffn, layers, heads, context;
  std::int64_t q_lora, kv_lora, nope, rope, v;
  ModelConfig::Experts experts;
  bool size_only;
};
const LatentPresetSpec kLatentPresets[] = {
    {"mla-tiny", "DeepseekV2ForCausalLM", 512, 128, 352, 4, 4, 512, 0, 32, 32, 16, 32, {}, false},
    {"deepseek-v2-lite",
     "DeepseekV2ForCausalLM",
     102400,
     2048,
     10944,
     27,
     16,
     163840,
     0,
     512,
     128,
     64,
     128,
     {64, 6, 2, 1408, 1},
     true},
    {"deepseek-v3",
     "DeepseekV3ForCausalLM",
     129280,
     7168,
     18432,
     61,
     128,
     163840,
     1536,
     512,
     128,
     64,
     128,
     {256, 8, 1, 2048, 3},
     true},
    {"llama2-7b-mla",
     "DeepseekV2ForCausalLM",
     32000,
     4096,
     11008,
     32,
     32,
     4096,
     0,
     512,
     128,
     64,
     128,
     {},
     true},
};

ModelConfig latent_preset(const LatentPresetSpec& p) {
  ModelConfig c = preset_shape(p.name, p.vocab, p.dim, p.ffn, p.layers, p.heads, p.heads,
                               p.nope + p.rope, p.context);
  c.architecture = p.architecture;
  c.rms_norm_eps = 1e-6;
  c.q_lora_rank = p.q_lora;
  c.kv_lora_rank = p.kv_lora;
  c.qk_nope_head_dim = p.nope;
  c.qk_rope_head_dim = p.rope;
  c.v_head_dim = p.v;
  c.experts = p.experts;
  c.size_only = p.size_only;
  return c;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  for (const auto& p : kGemmaPresets) names.emplace_back(p.name);
  for (const auto& p : kLatentPresets) names.emplace_back(p.name);
  return names;
}

ModelConfig model_preset(std::string_view name) {
  for (const auto& p : kGemmaPresets)
    if (name == p.name) return gemma3_preset(p);
  for (const auto& p : kLatentPresets)
    if (name == p.name) return latent_preset(p);
  for (const auto& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig c = preset_shape(p.name, p.vocab, p.dim, p.ffn, p.layers, p.heads, p.kv_heads,
                                 p.dim / p.heads, p.context);
    c.architecture = p.sliding_window ? "MistralForCausalLM" : "LlamaForCausalLM";
    c.rms_norm_eps = p.eps;
    c.rope_theta = p.theta;
    c.tie_word_embeddings = p.tied;
    c.size_only = p.size_only;
    c.sliding_window = p.sliding_window;
    c.rope_scaling = p.rope_scaling;
    return c;
  }
  const auto names = model_preset_names();
  std::string message = fmt::format("unknown model preset \"{}\"", name);
  if (auto near = nearest_name(name, names))
    message += fmt::format(" (did you mean \"{}\"?)", *near);
  message += "; presets: " + join_names(names);
  throw Error(message);
}

}  // namespace kvlab
