// Rung 4 of the correctness ladder: checkpoints saved by Hugging Face transformers load, and
// the reference reproduces transformers' own logits (tests/fixtures/hf/make_fixture.py).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

class HfInterop : public ::testing::TestWithParam<const char*> {};

TEST_P(HfInterop, LogitsMatchTransformers) {
  const std::filesystem::path folder =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "hf" / GetParam();
  const auto fixture = nlohmann::json::parse(test::read_file(folder / "logits.json"));
  const auto prompt = fixture["prompt"].get<std::vector<std::int32_t>>();
  const auto expected = fixture["logits"].get<std::vector<std::vector<float>>>();

  const ReferenceModel model(load_llama_weights(folder));
  const RowMatrix logits = model.forward(prompt);
  ASSERT_EQ(logits.rows(), static_cast<Eigen::Index>(expected.size()));
  ASSERT_EQ(logits.cols(), static_cast<Eigen::Index>(expected[0].size()));
  test::Closeness worst;
  for (std::size_t t = 0; t < expected.size(); ++t) {
    const auto c =
        test::compare(std::span<const float>(logits.row(static_cast<Eigen::Index>(t)).data(),
                                             static_cast<std::size_t>(logits.cols())),
                      expected[t]);
    worst.max_abs = std::max(worst.max_abs, c.max_abs);
    worst.max_rel = std::max(worst.max_rel, c.max_rel);
    worst.has_nan |= c.has_nan;
  }
  RecordProperty("max_abs_error", std::to_string(worst.max_abs));
  EXPECT_FALSE(worst.has_nan);
  EXPECT_LT(worst.max_abs, 1e-4) << "max rel " << worst.max_rel << " (transformers "
                                 << fixture["made_by"]["transformers"] << ")";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfInterop,
                         ::testing::Values("tiny_llama_gqa", "tiny_llama_sharded",
                                           "tiny_llama_v4_llama3", "tiny_llama_v5_theta5e5",
                                           "tiny_llama_v5_llama3", "tiny_llama_v5_linear"));

// Each RoPE setting the fixtures exercise must matter for their logits, or the match above
// would not show that kvlab reads it: the same weights with plain RoPE at theta 1e4 (what a
// loader that ignores rope_parameters computes) are far from transformers.
class HfRopeMatters : public ::testing::TestWithParam<const char*> {};

TEST_P(HfRopeMatters, PlainRopeWouldNotMatch) {
  const std::filesystem::path folder =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "hf" / GetParam();
  const auto fixture = nlohmann::json::parse(test::read_file(folder / "logits.json"));
  const auto prompt = fixture["prompt"].get<std::vector<std::int32_t>>();
  const auto expected = fixture["logits"].get<std::vector<std::vector<float>>>();
  LlamaWeights weights = load_llama_weights(folder);
  ASSERT_TRUE(weights.config.rope_theta != 10000.0 ||
              weights.config.rope_scaling.type != RopeScaling::Type::none);
  weights.config.rope_theta = 10000.0;
  weights.config.rope_scaling = {};
  const RowMatrix logits = ReferenceModel(std::move(weights)).forward(prompt);
  float worst = 0;
  for (std::size_t t = 0; t < expected.size(); ++t)
    for (std::size_t v = 0; v < expected[t].size(); ++v)
      worst = std::max(worst,
                       std::abs(logits(static_cast<Eigen::Index>(t), static_cast<Eigen::Index>(v)) -
                                expected[t][v]));
  EXPECT_GT(worst, 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfRopeMatters,
                         ::testing::Values("tiny_llama_v4_llama3", "tiny_llama_v5_theta5e5",
                                           "tiny_llama_v5_llama3", "tiny_llama_v5_linear"));

// llama3 scaling's three bands, against transformers' _compute_llama3_parameters worked by hand
// for head_dim 8, theta 5e5, factor 8, low/high 0.25/4, original context 64 (the fixture's).
TEST(RopeScaling, Llama3BandsMatchTheFormula) {
  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 500000.0;
  c.rope_scaling = {RopeScaling::Type::llama3, 8.0, 0.25, 4.0, 64};
  const auto inverse = rope_inverse_frequencies(c);
  ASSERT_EQ(inverse.size(), 4u);
  const double base1 = std::pow(500000.0, -0.25);  // wavelength 167: between 16 and 256
  const double smooth = (64.0 / (2 * std::numbers::pi / base1) - 0.25) / (4.0 - 0.25);
  EXPECT_DOUBLE_EQ(inverse[0], 1.0);  // wavelength 2 pi < 64 / 4: kept
  EXPECT_NEAR(inverse[1], (1 - smooth) * base1 / 8.0 + smooth * base1, 1e-15);
  EXPECT_NEAR(inverse[2], std::pow(500000.0, -0.5) / 8.0, 1e-15);  // > 64 / 0.25: divided
  EXPECT_NEAR(inverse[3], std::pow(500000.0, -0.75) / 8.0, 1e-15);
}

}  // namespace
}  // namespace kvlab::cpu

namespace kvlab::cpu {
namespace {

// A config that claims a far larger model than its checkpoint holds fails on the first tensor
// whose shape disagrees, before any weight memory is allocated (it would need ~800 GB here).
TEST(HfCheckpoint, ConfigDimsAreCheckedAgainstTensorShapesFirst) {
  const std::filesystem::path fixture =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "hf" / "tiny_llama_gqa";
  test::TempDir dir;
  std::filesystem::copy_file(fixture / "model.safetensors", dir / "model.safetensors");
  auto config = nlohmann::json::parse(test::read_file(fixture / "config.json"));
  config["intermediate_size"] = std::int64_t{1} << 30;
  test::write_file(dir / "config.json", config.dump());
  const std::string message = test::error_of<Error>([&] { load_llama_weights(dir.path()); });
  EXPECT_NE(message.find("has shape [88, 32] but the model config needs [1073741824, 32]"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace kvlab::cpu

namespace kvlab::cpu {
namespace {

// Rung 4 for GGUF: a LLaMA written as llama.cpp's converter writes it (Q8_0 matrices, Q/K rows
// permuted) gives transformers' logits for the same file (tests/fixtures/gguf/
// make_model_fixture.py: transformers dequantizes and un-permutes it itself). Tolerance as for
// the safetensors fixtures: 1e-4 max abs on O(5) logits.
TEST(GgufInterop, LogitsMatchTransformersReadingTheSameFile) {
  const std::filesystem::path folder = std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf";
  const auto fixture =
      nlohmann::json::parse(test::read_file(folder / "tiny_llama_q8_0.logits.json"));
  const auto prompt = fixture["prompt"].get<std::vector<std::int32_t>>();
  const auto expected = fixture["logits"].get<std::vector<std::vector<float>>>();
  const LlamaWeights weights = load_llama_weights(folder / "tiny_llama_q8_0.gguf");
  EXPECT_EQ(weights.config.num_key_value_heads, 2);
  EXPECT_FALSE(weights.config.tie_word_embeddings);
  const RowMatrix logits = ReferenceModel(weights).forward(prompt);
  ASSERT_EQ(logits.rows(), static_cast<Eigen::Index>(expected.size()));
  double worst = 0;
  for (std::size_t t = 0; t < expected.size(); ++t)
    for (std::size_t v = 0; v < expected[t].size(); ++v) {
      const float value = logits(static_cast<Eigen::Index>(t), static_cast<Eigen::Index>(v));
      ASSERT_TRUE(std::isfinite(value));
      worst = std::max(worst, static_cast<double>(std::abs(value - expected[t][v])));
    }
  RecordProperty("max_abs_error", std::to_string(worst));
  EXPECT_LT(worst, 1e-4);
}

// The Q/K rows must be put back in Hugging Face order: read without undoing the permutation,
// the same file gives other logits (so the match above cannot pass by accident).
TEST(GgufInterop, QkPermutationIsUndone) {
  const std::filesystem::path file =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "tiny_llama_q8_0.gguf";
  const GgufFile gguf = GgufFile::open(file);
  const ModelConfig config = gguf_model_config(gguf);
  const std::vector<std::int64_t> shape{config.q_dim(), config.hidden_size};
  std::vector<float> unpermuted(static_cast<std::size_t>(config.q_dim() * config.hidden_size));
  read_gguf_tensor(gguf, config, "model.layers.0.self_attn.q_proj.weight", shape, unpermuted);
  const std::vector<float> stored = gguf.dequantize(*gguf.find_tensor("blk.0.attn_q.weight"));
  // Head 0, HF row 1 (first half, pair 1) is stored at GGUF row 2; HF row hd/2 at GGUF row 1.
  const std::int64_t columns = config.hidden_size, half = config.head_dim / 2;
  for (std::int64_t c = 0; c < columns; ++c) {
    EXPECT_EQ(unpermuted[static_cast<std::size_t>(1 * columns + c)],
              stored[static_cast<std::size_t>(2 * columns + c)]);
    EXPECT_EQ(unpermuted[static_cast<std::size_t>(half * columns + c)],
              stored[static_cast<std::size_t>(1 * columns + c)]);
  }
  EXPECT_NE(unpermuted, stored);
}

TEST(GgufInterop, MetadataBecomesTheModelConfig) {
  const GgufFile gguf =
      GgufFile::open(std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "tiny_llama_q8_0.gguf");
  const ModelConfig c = gguf_model_config(gguf);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 88);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_NEAR(c.rms_norm_eps, 1e-5, 1e-12);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<std::int32_t>{2});
  // The type fixture is "llama" but has no llama.* keys: every missing one is listed.
  const GgufFile types =
      GgufFile::open(std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "quant_types.gguf");
  const std::string message = test::error_of<Error>([&] { gguf_model_config(types); });
  for (const char* key : {"llama.embedding_length", "llama.block_count", "llama.context_length"})
    EXPECT_NE(message.find(fmt::format("missing metadata key \"{}\"", key)), std::string::npos)
        << message;
}

}  // namespace
}  // namespace kvlab::cpu
