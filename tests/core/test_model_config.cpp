#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "kvlab/error.hpp"
#include "kvlab/model_config.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using nlohmann::json;
using test::error_of;

json valid_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", 1000},
          {"hidden_size", 128},
          {"intermediate_size", 344},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 2},
          {"max_position_embeddings", 256},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 500000.0},
          {"tie_word_embeddings", true},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

std::string parse_error(const json& config) {
  return error_of<Error>([&] { parse_model_config(config.dump(), "cfg.json"); });
}

TEST(ModelConfig, ParsesHuggingFaceFields) {
  const ModelConfig c = parse_model_config(valid_config().dump(), "cfg.json");
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 344);
  EXPECT_EQ(c.num_hidden_layers, 3);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 16);  // hidden / heads when head_dim is absent
  EXPECT_EQ(c.group_size(), 4);
  EXPECT_EQ(c.max_position_embeddings, 256);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<std::int32_t>{2});
}

TEST(ModelConfig, ExplicitHeadDimAndEosList) {
  json config = valid_config();
  config["head_dim"] =
      32;  // q_dim (8 x 32) differs from hidden_size: allowed, as in Gemma/Llama-3.2
  config["eos_token_id"] = {2, 7};
  const ModelConfig c = parse_model_config(config.dump(), "cfg.json");
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.q_dim(), 256);
  EXPECT_TRUE(c.is_eos(7));
  EXPECT_TRUE(c.is_eos(2));
  EXPECT_FALSE(c.is_eos(1));
}

TEST(ModelConfig, KvHeadsDefaultToAttentionHeads) {
  json config = valid_config();
  config.erase("num_key_value_heads");
  EXPECT_EQ(parse_model_config(config.dump(), "cfg.json").num_key_value_heads, 8);
}

TEST(ModelConfig, HeadsNotDivisibleByKvHeads) {
  json config = valid_config();
  config["num_key_value_heads"] = 3;
  const std::string message = parse_error(config);
  EXPECT_NE(message.find("cfg.json"), std::string::npos) << message;
  EXPECT_NE(message.find("num_attention_heads (8) must be divisible by num_key_value_heads (3)"),
            std::string::npos)
      << message;
}

TEST(ModelConfig, MissingRequiredField) {
  json config = valid_config();
  config.erase("hidden_size");
  EXPECT_NE(parse_error(config).find("missing required field \"hidden_size\""), std::string::npos);
}

TEST(ModelConfig, WrongType) {
  json config = valid_config();
  config["num_hidden_layers"] = "three";
  EXPECT_NE(
      parse_error(config).find("field \"num_hidden_layers\" must be an integer, got \"three\""),
      std::string::npos);
}

TEST(ModelConfig, NonPositiveSizes) {
  json config = valid_config();
  config["vocab_size"] = 0;
  config["num_hidden_layers"] = -1;
  const std::string message = parse_error(config);
  EXPECT_NE(message.find("\"vocab_size\" must be positive, got 0"), std::string::npos) << message;
  EXPECT_NE(message.find("\"num_hidden_layers\" must be positive, got -1"), std::string::npos)
      << message;
}

TEST(ModelConfig, HiddenNotDivisibleByHeads) {
  json config = valid_config();
  config["hidden_size"] = 130;
  EXPECT_NE(
      parse_error(config).find("hidden_size (130) must be divisible by num_attention_heads (8)"),
      std::string::npos);
}

TEST(ModelConfig, OddHeadDimForRope) {
  json config = valid_config();
  config["head_dim"] = 15;
  EXPECT_NE(parse_error(config).find("head_dim (15) must be even"), std::string::npos);
}

TEST(ModelConfig, TokenIdsOutsideVocabulary) {
  json config = valid_config();
  config["bos_token_id"] = 1000;
  config["eos_token_id"] = {2, -1};
  const std::string message = parse_error(config);
  EXPECT_NE(message.find("bos_token_id 1000 is outside the vocabulary [0, 1000)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("eos_token_id -1 is outside"), std::string::npos) << message;
}

TEST(ModelConfig, BadEosType) {
  json config = valid_config();
  config["eos_token_id"] = "</s>";
  EXPECT_NE(parse_error(config).find("\"eos_token_id\" must be an integer or a list of integers"),
            std::string::npos);
}

TEST(ModelConfig, UnsupportedArchitecture) {
  json config = valid_config();
  config["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_NE(parse_error(config).find("architecture \"GPT2LMHeadModel\" is not supported"),
            std::string::npos);
}

TEST(ModelConfig, FeaturesThatWouldChangeTheMathAreRefused) {
  json config = valid_config();
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 8.0}};
  config["hidden_act"] = "gelu";
  config["attention_bias"] = true;
  const std::string message = parse_error(config);
  EXPECT_NE(message.find("RoPE type \"yarn\""), std::string::npos) << message;
  EXPECT_NE(message.find("hidden_act \"gelu\""), std::string::npos) << message;
  EXPECT_NE(message.find("\"attention_bias\": true"), std::string::npos) << message;
}

// transformers >= 5 keeps theta inside rope_parameters; reading only the top level would give
// theta 1e4 silently.
TEST(ModelConfig, TransformersFiveRopeParameters) {
  json config = valid_config();
  config.erase("rope_theta");
  config["rope_parameters"] = {{"rope_theta", 250000.0}, {"rope_type", "default"}};
  ModelConfig c = parse_model_config(config.dump(), "cfg.json");
  EXPECT_DOUBLE_EQ(c.rope_theta, 250000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::none);

  config["rope_parameters"] = {
      {"rope_theta", 500000.0},  {"rope_type", "llama3"},
      {"factor", 32.0},          {"low_freq_factor", 1.0},
      {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  c = parse_model_config(config.dump(), "cfg.json");
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
}

TEST(ModelConfig, TransformersFourRopeScaling) {
  json config = valid_config();
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};  // the pre-4.45 key "type"
  const ModelConfig c = parse_model_config(config.dump(), "cfg.json");
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::linear);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 2.0);
  const auto inverse = rope_inverse_frequencies(c);
  EXPECT_DOUBLE_EQ(inverse[0], 0.5);  // theta^0 / factor
}

TEST(ModelConfig, RopeProblemsAreNamed) {
  auto with_rope = [](json rope_parameters) {
    json config = valid_config();
    config["rope_parameters"] = std::move(rope_parameters);
    return parse_error(config);
  };
  EXPECT_NE(with_rope({{"rope_type", "dynamic"}, {"factor", 2.0}}).find("RoPE type \"dynamic\""),
            std::string::npos);
  EXPECT_NE(with_rope({{"rope_type", "llama3"}, {"factor", 8.0}})
                .find("missing required field \"rope_parameters.low_freq_factor\""),
            std::string::npos);
  EXPECT_NE(with_rope({{"rope_type", "default"}, {"rope_theta", 1e4}})  // top level says 5e5
                .find("disagree"),
            std::string::npos);
  EXPECT_NE(with_rope({{"rope_type", "default"}, {"mscale", 1.0}})
                .find("\"rope_parameters.mscale\" is not supported"),
            std::string::npos);
  EXPECT_NE(with_rope({{"rope_type", "linear"}, {"factor", -1.0}}).find("factor must be positive"),
            std::string::npos);
  EXPECT_NE(with_rope(json::array()).find("must be an object"), std::string::npos);
}

TEST(ModelConfig, RopeScalingRoundTrips) {
  ModelConfig c = model_preset("tiny");
  c.rope_scaling = {RopeScaling::Type::llama3, 8.0, 1.0, 4.0, 256};
  const ModelConfig parsed = parse_model_config(model_config_to_json(c), "tiny");
  EXPECT_EQ(parsed.rope_scaling.type, RopeScaling::Type::llama3);
  EXPECT_EQ(rope_inverse_frequencies(parsed), rope_inverse_frequencies(c));
}

// A JSON integer that does not fit the field's type is an error, never a wrapped value.
TEST(ModelConfig, IntegersThatDoNotFitAreErrors) {
  json config = valid_config();
  config["bos_token_id"] = 4294967297LL;  // 2^32 + 1 would wrap to 1
  EXPECT_NE(parse_error(config).find("\"bos_token_id\" = 4294967297 does not fit in 32 bits"),
            std::string::npos);
  config = valid_config();
  config["eos_token_id"] = {2, 4294967298LL};
  EXPECT_NE(parse_error(config).find("eos_token_id"), std::string::npos);
  config = valid_config();
  config["vocab_size"] = 18446744073709551615ULL;  // 2^64 - 1: fits no int64
  EXPECT_NE(parse_error(config).find("\"vocab_size\""), std::string::npos);
}

TEST(ModelConfig, NullRopeScalingIsPlainRope) {
  json config = valid_config();
  config["rope_scaling"] = nullptr;
  EXPECT_NO_THROW(parse_model_config(config.dump(), "cfg.json"));
}

TEST(ModelConfig, AllProblemsReportedAtOnce) {
  json config = valid_config();
  config.erase("vocab_size");
  config["rms_norm_eps"] = -1.0;
  const std::string message = parse_error(config);
  EXPECT_NE(message.find("vocab_size"), std::string::npos) << message;
  EXPECT_NE(message.find("rms_norm_eps"), std::string::npos) << message;
}

TEST(ModelConfig, BadJson) {
  const std::string message =
      error_of<Error>([] { parse_model_config("{\"vocab_size\": 12,", "broken.json"); });
  EXPECT_NE(message.find("broken.json"), std::string::npos);
  EXPECT_NE(message.find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of<Error>([] {
              parse_model_config("[1, 2]", "list.json");
            }).find("expected a JSON object"),
            std::string::npos);
  // A number beyond double's range is json::out_of_range, not parse_error (found by fuzzing:
  // it used to escape as an internal error).
  EXPECT_NE(error_of<Error>([] {
              parse_model_config("{\"rms_norm_eps\": 333.3e333}", "huge.json");
            }).find("not valid JSON"),
            std::string::npos);
}

TEST(ModelConfig, MissingFileNamesThePath) {
  const std::string message =
      error_of<Error>([] { load_model_config("/nonexistent/kvlab/config.json"); });
  EXPECT_NE(message.find("/nonexistent/kvlab/config.json"), std::string::npos) << message;
}

TEST(ModelConfig, JsonRoundTrip) {
  for (const auto& name : model_preset_names()) {
    const ModelConfig preset = model_preset(name);
    if (preset.is_gemma3() || preset.is_mla()) {  // presets or GGUF only: their config is refused
      EXPECT_THROW(parse_model_config(model_config_to_json(preset), name), Error) << name;
      continue;
    }
    const ModelConfig parsed = parse_model_config(model_config_to_json(preset), name);
    EXPECT_EQ(parsed.vocab_size, preset.vocab_size) << name;
    EXPECT_EQ(parsed.hidden_size, preset.hidden_size) << name;
    EXPECT_EQ(parsed.intermediate_size, preset.intermediate_size) << name;
    EXPECT_EQ(parsed.num_hidden_layers, preset.num_hidden_layers) << name;
    EXPECT_EQ(parsed.num_attention_heads, preset.num_attention_heads) << name;
    EXPECT_EQ(parsed.num_key_value_heads, preset.num_key_value_heads) << name;
    EXPECT_EQ(parsed.head_dim, preset.head_dim) << name;
    EXPECT_EQ(parsed.max_position_embeddings, preset.max_position_embeddings) << name;
    EXPECT_EQ(parsed.tie_word_embeddings, preset.tie_word_embeddings) << name;
    EXPECT_EQ(parsed.sliding_window, preset.sliding_window) << name;
    EXPECT_EQ(parsed.architecture, preset.architecture) << name;
    EXPECT_DOUBLE_EQ(parsed.rms_norm_eps, preset.rms_norm_eps) << name;
    EXPECT_DOUBLE_EQ(parsed.rope_theta, preset.rope_theta) << name;
  }
}

// DeepSeek's published shapes: V3 671B of which ~37B a token (its MTP module's 14B left out, as
// the paper's 671B does), V2-Lite 15.7B of which 2.4B; mla-tiny runnable, the rest size-only; a
// latent-attention config whose dims disagree, or a runnable one with experts, is refused.
TEST(ModelPresets, DeepSeekLatentAttentionShapesAsPublished) {
  const ModelConfig v3 = model_preset("deepseek-v3");
  EXPECT_TRUE(v3.is_mla());
  EXPECT_EQ(v3.latent_dim(), 576);
  EXPECT_EQ(v3.head_dim, 192);
  EXPECT_NEAR(static_cast<double>(v3.parameter_count()) / 1e9, 671.0, 0.5);
  EXPECT_NEAR(static_cast<double>(v3.matmul_parameter_count()) / 1e9, 36.6, 0.5);
  const ModelConfig lite = model_preset("deepseek-v2-lite");
  EXPECT_NEAR(static_cast<double>(lite.parameter_count()) / 1e9, 15.7, 0.1);
  EXPECT_NEAR(static_cast<double>(lite.matmul_parameter_count()) / 1e9, 2.4, 0.2);
  EXPECT_FALSE(model_preset("mla-tiny").size_only);
  ModelConfig bad = model_preset("mla-tiny");
  bad.head_dim = 40;
  test::expect_error_containing([&] { validate_model_config(bad, "bad"); },
                                {"head_dim = qk_nope_head_dim + qk_rope_head_dim"});
  bad = model_preset("mla-tiny");
  bad.experts = {8, 2, 0, 64, 1};
  test::expect_error_containing([&] { validate_model_config(bad, "bad"); }, {"size-only preset"});
  bad = model_preset("tiny");
  bad.qk_rope_head_dim = 8;
  test::expect_error_containing([&] { validate_model_config(bad, "bad"); },
                                {"need kv_lora_rank > 0"});
  test::expect_error_containing(
      [] {
        parse_model_config(
            R"({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                "max_position_embeddings": 16})",
            "v3.json");
      },
      {"DeepseekV3ForCausalLM folder is not read"});
}

// Gemma 3's published config.json shapes: every sixth layer global, the local ones a window
// with RoPE base 10,000; 27B's query scale from its width over heads (168), not head_dim (128).
TEST(ModelPresets, Gemma3ShapesAsPublished) {
  const ModelConfig g27 = model_preset("gemma3-27b");
  EXPECT_TRUE(g27.is_gemma3());
  EXPECT_EQ(g27.num_hidden_layers, 62);
  EXPECT_EQ(g27.head_dim, 128);
  EXPECT_EQ(g27.layer_window(0), 1024);
  EXPECT_EQ(g27.layer_window(5), std::nullopt);
  EXPECT_DOUBLE_EQ(g27.layer_rope_theta(0), 10000.0);
  EXPECT_DOUBLE_EQ(g27.layer_rope_theta(5), 1e6);
  EXPECT_DOUBLE_EQ(g27.query_scale, 1.0 / std::sqrt(168.0));
  EXPECT_NEAR(static_cast<double>(g27.parameter_count()) / 1e9, 27.0, 0.1);
  EXPECT_EQ(model_preset("gemma3-1b").layer_window(0), 512);
  const ModelConfig tiny = model_preset("gemma3-tiny");
  EXPECT_FALSE(tiny.size_only);
  EXPECT_EQ(tiny.layer_window(4), 8);
  EXPECT_EQ(tiny.layer_window(5), std::nullopt);
}

TEST(ModelPresets, ShapesAsPublished) {
  const ModelConfig tiny = model_preset("tiny");
  EXPECT_EQ(tiny.vocab_size, 512);
  EXPECT_EQ(tiny.hidden_size, 64);
  EXPECT_EQ(tiny.num_hidden_layers, 2);
  EXPECT_EQ(tiny.num_attention_heads, 4);
  EXPECT_EQ(tiny.num_key_value_heads, 2);

  const ModelConfig s15 = model_preset("stories15m");
  EXPECT_EQ(s15.hidden_size, 288);
  EXPECT_EQ(s15.num_hidden_layers, 6);
  EXPECT_EQ(s15.num_attention_heads, 6);
  EXPECT_EQ(s15.intermediate_size, 768);
  EXPECT_EQ(s15.vocab_size, 32000);
  EXPECT_EQ(s15.max_position_embeddings, 256);

  const ModelConfig s110 = model_preset("stories110m");
  EXPECT_EQ(s110.hidden_size, 768);
  EXPECT_EQ(s110.num_hidden_layers, 12);
  EXPECT_EQ(s110.num_attention_heads, 12);
  EXPECT_EQ(s110.intermediate_size, 2048);
  EXPECT_EQ(s110.max_position_embeddings, 1024);

  EXPECT_EQ(model_preset("llama-7b").num_attention_heads, 32);
  EXPECT_EQ(model_preset("llama-13b").num_attention_heads, 40);
  EXPECT_EQ(model_preset("llama-65b").num_attention_heads, 64);
  EXPECT_EQ(model_preset("llama-65b").num_hidden_layers, 80);
  EXPECT_EQ(model_preset("llama2-70b").num_key_value_heads, 8);
  EXPECT_EQ(model_preset("mistral-7b").num_key_value_heads, 8);
  EXPECT_TRUE(model_preset("llama-7b").size_only);
  const ModelConfig llama31 = model_preset("llama3.1-8b");  // the Mooncake trace's whole replays
  EXPECT_TRUE(llama31.size_only);
  EXPECT_EQ(llama31.max_position_embeddings, 131072);
  EXPECT_EQ(llama31.num_key_value_heads, 8);
  EXPECT_EQ(llama31.head_dim, 128);
  EXPECT_EQ(llama31.vocab_size, 128256);
  EXPECT_EQ(llama31.rope_theta, 500000.0);
  EXPECT_EQ(llama31.rope_scaling.type, RopeScaling::Type::llama3);
  EXPECT_EQ(llama31.rope_scaling.factor, 8.0);
  EXPECT_EQ(llama31.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(model_preset("stories15m").size_only);
}

TEST(ModelPresets, ParameterCountsMatchThePublishedModels) {
  // Exact parameter counts of the Hugging Face checkpoints.
  EXPECT_EQ(model_preset("llama-7b").parameter_count(), 6'738'415'616);
  EXPECT_EQ(model_preset("llama-13b").parameter_count(), 13'015'864'320);
  EXPECT_EQ(model_preset("llama2-70b").parameter_count(), 68'976'648'192);
  EXPECT_EQ(model_preset("mistral-7b").parameter_count(), 7'241'732'096);
  EXPECT_EQ(model_preset("llama3.1-8b").parameter_count(), 8'030'261'248);
  EXPECT_EQ(model_preset("llama3.2-1b").parameter_count(), 1'235'814'400);  // tied: 1.24B
  // opt-13b, a LLaMA-shaped stand-in: OPT-13B's 12.85B within 0.1% (no biases, LayerNorm or
  // learned positions), its matrices' FLOPs a token within 0.01% (8 h^2 MLP + 4 h^2 attention).
  const ModelConfig opt = model_preset("opt-13b");
  EXPECT_NEAR(static_cast<double>(opt.parameter_count()), 12.85e9, 0.001 * 12.85e9);
  const double h = 5120, opt_layer_matmuls = 12 * h * h;
  EXPECT_NEAR(static_cast<double>(opt.matmul_parameter_count() - opt.vocab_size * opt.hidden_size),
              40 * opt_layer_matmuls, 1e-4 * 40 * opt_layer_matmuls);
  // llama2.c's stories15M: 15.19M with the classifier shared with the embedding.
  EXPECT_EQ(model_preset("stories15m").parameter_count(), 15'191'712);
}

TEST(ModelPresets, UnknownPresetSuggestsTheNearest) {
  const std::string message = error_of<Error>([] { model_preset("llama-7"); });
  EXPECT_NE(message.find("did you mean \"llama-7b\""), std::string::npos) << message;
  EXPECT_NE(message.find("stories110m"), std::string::npos) << message;
}

TEST(ForwardFlops, CountsMatmulsAttentionAndHead) {
  const ModelConfig c = model_preset("tiny");
  // One token: every matmul weight once (x2), attention over 1 key, logits once.
  const double dense = 2.0 * static_cast<double>(c.matmul_parameter_count());
  const double attention_one_key =
      4.0 * static_cast<double>(c.num_attention_heads * c.head_dim * c.num_hidden_layers);
  EXPECT_DOUBLE_EQ(forward_flops(c, 1, 1), dense + attention_one_key);
  // T tokens see 1 + 2 + ... + T keys.
  const double layer_dense = dense - 2.0 * static_cast<double>(c.vocab_size * c.hidden_size);
  EXPECT_DOUBLE_EQ(forward_flops(c, 4, 1),
                   4 * layer_dense + 10 * attention_one_key + 2.0 * c.vocab_size * c.hidden_size);
}

}  // namespace
}  // namespace kvlab
