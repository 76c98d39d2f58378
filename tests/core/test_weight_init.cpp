#include <gtest/gtest.h>

#include <cmath>

#include "kvlab/error.hpp"
#include "kvlab/model/safetensors.hpp"
#include "kvlab/model/weight_init.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using test::TempDir;

std::uint64_t fnv1a(const std::string& bytes) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

TEST(WeightInit, SameSeedSameBytes) {
  TempDir dir;
  const ModelConfig tiny = model_preset("tiny");
  write_random_model(tiny, 42, DType::dtype_f32, dir / "a");
  write_random_model(tiny, 42, DType::dtype_f32, dir / "b");
  write_random_model(tiny, 43, DType::dtype_f32, dir / "c");
  const std::string a = test::read_file(dir / "a/model.safetensors");
  EXPECT_EQ(a, test::read_file(dir / "b/model.safetensors"));
  EXPECT_NE(a, test::read_file(dir / "c/model.safetensors"));
  EXPECT_EQ(test::read_file(dir / "a/config.json"), test::read_file(dir / "b/config.json"));
}

TEST(WeightInit, GoldenChecksumHoldsOnEveryMachine) {
  // The init uses only integer hashing and exactly rounded IEEE operations, so these bytes are
  // the same on any conforming machine. If the init scheme is changed on purpose, update the
  // constant (and say so in the change); an accidental change must fail here.
  TempDir dir;
  write_random_model(model_preset("tiny"), 0, DType::dtype_f32, dir.path());
  EXPECT_EQ(fnv1a(test::read_file(dir / "model.safetensors")), 0xb2ab5732c54d0d95ULL)
      << std::hex << fnv1a(test::read_file(dir / "model.safetensors"));
}

TEST(WeightInit, ValuesHaveTheRequestedSpread) {
  const WeightSpec spec{"model.layers.0.mlp.up_proj.weight", {512, 256}, false};
  const auto values = random_tensor_values(spec, 7, 0.02);
  double sum = 0, sum_squares = 0, max_abs = 0;
  for (float v : values) {
    sum += v;
    sum_squares += static_cast<double>(v) * v;
    max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
  }
  const double n = static_cast<double>(values.size());
  const double mean = sum / n;
  const double stddev = std::sqrt(sum_squares / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 5 * 0.02 / std::sqrt(n));  // 5 standard errors
  EXPECT_NEAR(stddev, 0.02, 0.02 * 0.01);
  EXPECT_LE(max_abs, 0.02 * 2 * std::sqrt(3.0));  // Irwin-Hall(4) is bounded at 2 sqrt(3) sigma
}

TEST(WeightInit, TensorsAreIndependentOfEachOther) {
  const auto a = random_tensor_values({"x.weight", {64}, false}, 1);
  const auto b = random_tensor_values({"y.weight", {64}, false}, 1);
  EXPECT_NE(a, b);
  EXPECT_EQ(random_tensor_values({"n.weight", {4}, true}, 1), std::vector<float>(4, 1.0f));
}

TEST(WeightInit, SpecsFollowHuggingFaceNames) {
  ModelConfig c = model_preset("tiny");
  auto specs = llama_weight_specs(c);
  ASSERT_EQ(specs.size(), 1 + 9 * 2 + 1 + 1u);  // embed, 9 per layer, norm, lm_head
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(specs[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(specs[3].shape,
            (std::vector<std::int64_t>{c.kv_dim(), c.hidden_size}));  // k_proj (out, in)
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  c.tie_word_embeddings = true;
  EXPECT_EQ(llama_weight_specs(c).back().name, "model.norm.weight");
}

TEST(WeightInit, HalfPrecisionFilesHoldRoundedValues) {
  TempDir dir;
  const ModelConfig tiny = model_preset("tiny");
  write_random_model(tiny, 5, DType::dtype_bf16, dir.path());
  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  const std::vector<std::int64_t> shape{tiny.vocab_size, tiny.hidden_size};
  const auto loaded = checkpoint.read_f32("model.embed_tokens.weight", shape);
  const auto exact = random_tensor_values({"model.embed_tokens.weight", shape, false}, 5);
  const auto closeness = test::compare(loaded, exact);
  EXPECT_FALSE(closeness.has_nan);
  EXPECT_LE(closeness.max_rel, 1.0 / 256);  // bf16 keeps 8 significant bits
  EXPECT_GT(closeness.max_abs, 0.0);        // and did round
  EXPECT_NE(test::read_file(dir / "config.json").find("\"torch_dtype\": \"bfloat16\""),
            std::string::npos);
}

TEST(WeightInit, SizeOnlyPresetIsRefused) {
  TempDir dir;
  const std::string message = test::error_of<Error>(
      [&] { write_random_model(model_preset("llama-7b"), 0, DType::dtype_f16, dir.path()); });
  EXPECT_NE(message.find("size-only"), std::string::npos) << message;
}

}  // namespace
}  // namespace kvlab
