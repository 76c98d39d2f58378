// The GGUF reader: every metadata value type, tensor infos and alignment, each tensor type kvlab
// reads dequantized exactly as llama.cpp's gguf-py does (tests/fixtures/gguf/make_fixture.py),
// and malformed files ending in one clear error.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using test::error_of;

const std::filesystem::path kFixture =
    std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" / "quant_types.gguf";

TEST(Gguf, ReadsEveryMetadataValueType) {
  const GgufFile file = GgufFile::open(kFixture);
  EXPECT_EQ(file.version(), 3u);
  EXPECT_EQ(file.alignment(), 32u);
  auto integer = [&](const char* key) { return file.find_metadata(key)->as_int(); };
  EXPECT_EQ(integer("test.u8"), 200);
  EXPECT_EQ(integer("test.i8"), -100);
  EXPECT_EQ(integer("test.u16"), 60000);
  EXPECT_EQ(integer("test.i16"), -30000);
  EXPECT_EQ(integer("test.u32"), 4000000000LL);
  EXPECT_EQ(integer("test.i32"), -2000000000);
  EXPECT_EQ(integer("test.i64"), -9000000000000000000LL);
  EXPECT_EQ(integer("test.u64"), std::nullopt);  // 1.8e19 fits no int64: not silently wrapped
  EXPECT_EQ(std::get<std::uint64_t>(file.find_metadata("test.u64")->value),
            18000000000000000000ULL);
  EXPECT_EQ(file.find_metadata("test.f32")->as_double(), 0.25);
  EXPECT_EQ(file.find_metadata("test.f64")->as_double(), 1e-300);
  EXPECT_EQ(std::get<bool>(file.find_metadata("test.bool")->value), true);
  EXPECT_EQ(*file.find_metadata("test.string")->as_string(), "kvlab \u2713");
  const GgufArray& strings = *file.find_metadata("test.strings")->as_array();
  ASSERT_EQ(strings.size(), 3u);
  EXPECT_EQ(*strings[1].as_string(), "bc");
  EXPECT_EQ(*strings[2].as_string(), "");
  EXPECT_EQ(file.find_metadata("test.ints")->to_string(), "[1, 2, 3]");
  EXPECT_EQ(*file.find_metadata("general.architecture")->as_string(), "llama");
  EXPECT_EQ(file.find_metadata("no.such.key"), nullptr);
}

class GgufTypes : public ::testing::TestWithParam<const char*> {};

// Tolerance: the same float32 operations as gguf-py in the same order, so at most one rounding
// apart (a fused multiply-add under -march=native): |a - b| <= 2 eps max(1, |b|).
TEST_P(GgufTypes, DequantizesAsLlamaCpp) {
  const GgufFile file = GgufFile::open(kFixture);
  const GgufTensorInfo* quantized = file.find_tensor(std::string("q.") + GetParam());
  const GgufTensorInfo* expected = file.find_tensor(std::string("expected.") + GetParam());
  ASSERT_NE(quantized, nullptr);
  ASSERT_NE(expected, nullptr);
  EXPECT_EQ(gguf_type_name(quantized->type), GetParam());
  EXPECT_EQ(quantized->row_major_shape(), (std::vector<std::int64_t>{2, 512}));
  const std::vector<float> values = file.dequantize(*quantized);
  const std::vector<float> reference = file.dequantize(*expected);
  ASSERT_EQ(values.size(), reference.size());
  double worst = 0;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_TRUE(std::isfinite(values[i])) << i;
    const double error = std::abs(static_cast<double>(values[i]) - reference[i]);
    worst = std::max(worst, error);
    if (error > 2 * FLT_EPSILON * std::max(1.0f, std::abs(reference[i]))) ++bad;
  }
  EXPECT_EQ(bad, 0u) << "max abs error " << worst;
  // Not vacuous: the values are spread, not all zero.
  EXPECT_GT(*std::max_element(reference.begin(), reference.end()), 0.01f);
}

INSTANTIATE_TEST_SUITE_P(Fixture, GgufTypes,
                         ::testing::Values("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0",
                                           "Q5_1", "Q4_K", "Q6_K"));

// A GGUF file written by hand, field by field (little-endian).
class GgufBytes {
 public:
  GgufBytes& u32(std::uint32_t v) { return raw(&v, 4); }
  GgufBytes& u64(std::uint64_t v) { return raw(&v, 8); }
  GgufBytes& str(const std::string& s) {
    u64(s.size());
    bytes_ += s;
    return *this;
  }
  GgufBytes& header(std::uint32_t version, std::uint64_t tensors, std::uint64_t metadata) {
    bytes_ += "GGUF";
    return u32(version).u64(tensors).u64(metadata);
  }
  GgufBytes& tensor(const std::string& name, std::vector<std::uint64_t> dims, std::uint32_t type,
                    std::uint64_t offset) {
    str(name).u32(static_cast<std::uint32_t>(dims.size()));
    for (auto d : dims) u64(d);
    return u32(type).u64(offset);
  }
  GgufBytes& pad_to(std::size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_ += '\0';
    return *this;
  }
  GgufBytes& zeros(std::size_t n) {
    bytes_.append(n, '\0');
    return *this;
  }
  const std::string& text() const { return bytes_; }

 private:
  GgufBytes& raw(const void* p, std::size_t n) {
    bytes_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string bytes_;
};

std::string open_error(const test::TempDir& dir, const std::string& bytes) {
  test::write_file(dir / "f.gguf", bytes);
  return error_of<Error>([&] { GgufFile::open(dir / "f.gguf"); });
}

TEST(Gguf, HandWrittenFileWithAlignment) {
  test::TempDir dir;
  GgufBytes b;
  b.header(2, 1, 1).str("general.alignment").u32(4).u32(64);  // uint32 value 64
  b.tensor("w", {4, 2}, 0, 0).pad_to(64);
  for (int i = 0; i < 8; ++i) {
    const float v = static_cast<float>(i) * 0.5f;
    std::uint32_t bits;
    std::memcpy(&bits, &v, 4);
    b.u32(bits);
  }
  test::write_file(dir / "f.gguf", b.text());
  const GgufFile file = GgufFile::open(dir / "f.gguf");
  EXPECT_EQ(file.version(), 2u);
  EXPECT_EQ(file.alignment(), 64u);
  const auto values = file.dequantize(file.tensors().at(0));
  EXPECT_EQ(values, (std::vector<float>{0, 0.5f, 1, 1.5f, 2, 2.5f, 3, 3.5f}));
}

// A tensor with a zero dimension holds nothing and dequantizes to nothing (found by fuzzing:
// memcpy was handed a null pointer for it, undefined behaviour even for 0 bytes).
TEST(Gguf, EmptyTensorsDequantizeToNothing) {
  test::TempDir dir;
  GgufBytes b;
  b.header(3, 2, 0).tensor("empty", {4, 0}, 0, 0).tensor("q", {32, 0}, 8, 0).pad_to(32);
  test::write_file(dir / "f.gguf", b.text());
  const GgufFile file = GgufFile::open(dir / "f.gguf");
  for (const auto& tensor : file.tensors()) {
    EXPECT_EQ(tensor.elements, 0);
    EXPECT_TRUE(file.dequantize(tensor).empty());
  }
}

// Every malformed file ends in one kvlab::Error that says what is wrong (and where).
TEST(Gguf, MalformedFilesAreClearErrors) {
  test::TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases{
      {"", "not a GGUF file"},
      {"GGML and more", "not a GGUF file"},
      {GgufBytes().header(1, 0, 0).text(), "GGUF version 1; kvlab reads versions 2 and 3"},
      {GgufBytes().header(3, 0, 1).text(), "claims 1 items"},
      {GgufBytes().header(3, 0, 1).str("k").u32(8).u64(1ULL << 40).text(),
       "truncated: a string needs 1099511627776 bytes"},
      {GgufBytes().header(3, 0, 1).str("k").u32(99).zeros(8).text(),
       "unknown metadata value type 99"},
      {GgufBytes().header(3, 0, 1).str("k").u32(9).u32(4).u64(1ULL << 60).zeros(8).text(),
       "an array claims 1152921504606846976 items"},
      {GgufBytes().header(3, 0, 1).str("k").u32(7).text() + "\x02", "bool value 2"},
      {GgufBytes().header(3, 0, 2).str("k").u32(4).u32(1).str("k").u32(4).u32(2).text(),
       "metadata key \"k\" appears twice"},
      {GgufBytes().header(3, 0, 1).str("general.alignment").u32(4).u32(48).text(),
       "general.alignment 48 is not a power of two"},
      {GgufBytes().header(3, 1, 0).tensor("w", {1, 1, 1, 1, 1}, 0, 0).pad_to(32).zeros(4).text(),
       "has 5 dimensions"},
      {GgufBytes().header(3, 1, 0).tensor("w", {256}, 13, 0).pad_to(32).zeros(176).text(),
       "is Q5_K, which kvlab does not read"},
      {GgufBytes().header(3, 1, 0).tensor("w", {16}, 2, 0).pad_to(32).zeros(18).text(),
       "rows of 16 elements are not whole Q4_0 blocks of 32"},
      {GgufBytes().header(3, 1, 0).tensor("w", {4}, 0, 8).pad_to(32).zeros(64).text(),
       "at data offset 8 is not aligned to 32"},
      {GgufBytes().header(3, 1, 0).tensor("w", {64}, 0, 0).pad_to(32).zeros(100).text(),
       "runs past the end of the file"},
      {GgufBytes().header(3, 1, 0).tensor("w", {1ULL << 62, 4}, 0, 0).pad_to(32).text(),
       "more elements than a 63-bit count"},
      {GgufBytes()
           .header(3, 2, 0)
           .tensor("w", {4}, 0, 0)
           .tensor("w", {4}, 0, 32)
           .pad_to(32)
           .zeros(64)
           .text(),
       "tensor \"w\" appears twice"},
      {GgufBytes()  // 16 floats at 0 and 16 at 32: bytes 32..64 belong to both
           .header(3, 2, 0)
           .tensor("a", {16}, 0, 0)
           .tensor("b", {16}, 0, 32)
           .pad_to(32)
           .zeros(96)
           .text(),
       "tensors \"a\" (data bytes 0..64) and \"b\" (from 32) overlap"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string message = open_error(dir, cases[i].first);
    EXPECT_NE(message.find("f.gguf"), std::string::npos) << i << ": " << message;
    EXPECT_NE(message.find(cases[i].second), std::string::npos) << i << ": " << message;
  }
  // Arrays nested past the limit (a fuzzer's way to exhaust the stack).
  GgufBytes nested;
  nested.header(3, 0, 1).str("k").u32(9);
  for (int depth = 0; depth < 6; ++depth) nested.u32(9).u64(1);
  EXPECT_NE(open_error(dir, nested.text()).find("nested deeper than 4"), std::string::npos);
  EXPECT_NE(error_of<Error>([] {
              GgufFile::open("/nonexistent/m.gguf");
            }).find("cannot open GGUF file /nonexistent/m.gguf"),
            std::string::npos);
}

// A llama GGUF's hyperparameters and `extra` keys (each written by `write`), no tensors.
std::string llama_metadata(int extra, const std::function<void(GgufBytes&)>& write) {
  GgufBytes b;
  b.header(3, 0, 8 + static_cast<std::uint64_t>(extra));
  b.str("general.architecture").u32(8).str("llama");
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::uint32_t>>{{"llama.embedding_length", 32},
                                                          {"llama.feed_forward_length", 64},
                                                          {"llama.block_count", 1},
                                                          {"llama.attention.head_count", 4},
                                                          {"llama.context_length", 64},
                                                          {"llama.vocab_size", 100}})
    b.str(key).u32(4).u32(value);
  const float eps = 1e-5f;
  std::uint32_t bits;
  std::memcpy(&bits, &eps, 4);
  b.str("llama.attention.layer_norm_rms_epsilon").u32(6).u32(bits);
  write(b);
  return b.text();
}

GgufBytes& f32_value(GgufBytes& b, const std::string& key, float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return b.str(key).u32(6).u32(bits);
}

// GGUF metadata is held to what config.json is: RoPE scaling that would change RoPE refused by
// name (never computed as plain RoPE), non-finite numbers and ids past 32 bits refused.
TEST(Gguf, ModelMetadataIsCheckedLikeConfigJson) {
  test::TempDir dir;
  auto config_error = [&](int extra, const std::function<void(GgufBytes&)>& write) {
    test::write_file(dir / "m.gguf", llama_metadata(extra, write));
    const GgufFile file = GgufFile::open(dir / "m.gguf");
    return error_of<Error>([&] { gguf_model_config(file); });
  };
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_NE(config_error(1, [](GgufBytes& b) { f32_value(b, "llama.rope.scaling.factor", 4); })
                .find("\"llama.rope.scaling.factor\" = 4: RoPE scaling is not read from GGUF"),
            std::string::npos);
  EXPECT_NE(config_error(1, [](GgufBytes& b) { f32_value(b, "llama.rope.scale_linear", 2); })
                .find("\"llama.rope.scale_linear\" = 2"),
            std::string::npos);
  EXPECT_NE(
      config_error(1, [](GgufBytes& b) { f32_value(b, "llama.rope.scaling.attn_factor", 0.5f); })
          .find("\"llama.rope.scaling.attn_factor\" = 0.5"),
      std::string::npos);
  // RoPE keys that leave RoPE as it is are fine:
  test::write_file(dir / "ok.gguf", llama_metadata(2, [](GgufBytes& b) {
                     b.str("llama.rope.scaling.type").u32(8).str("none");
                     f32_value(b, "llama.rope.scaling.factor", 1);
                   }));
  EXPECT_EQ(gguf_model_config(GgufFile::open(dir / "ok.gguf")).hidden_size, 32);
  EXPECT_NE(config_error(1, [&](GgufBytes& b) { f32_value(b, "llama.rope.freq_base", inf); })
                .find("\"rope_theta\" must be positive and finite, got inf"),
            std::string::npos);
  EXPECT_NE(config_error(1,
                         [](GgufBytes& b) {
                           b.str("tokenizer.ggml.bos_token_id").u32(10).u64((1ULL << 32) + 1);
                         })
                .find("\"tokenizer.ggml.bos_token_id\" = 4294967297 is not a token id"),
            std::string::npos);
}

// A gemma3 GGUF's metadata as llama.cpp reads it (src/models/gemma3.cpp): one global layer in
// every 6, the others the sliding window with RoPE base 10,000, the embedding scaled by
// sqrt(width), Q/K and post norms, GeGLU; what kvlab does not compute is refused by name.
TEST(Gguf, Gemma3MetadataGivesLocalAndGlobalLayers) {
  test::TempDir dir;
  const auto gemma3 = [&](int extra, const std::function<void(GgufBytes&)>& write) {
    GgufBytes b;
    b.header(3, 0, 11 + static_cast<std::uint64_t>(extra));
    b.str("general.architecture").u32(8).str("gemma3");
    for (const auto& [key, value] :
         std::vector<std::pair<std::string, std::uint32_t>>{{"gemma3.embedding_length", 32},
                                                            {"gemma3.feed_forward_length", 64},
                                                            {"gemma3.block_count", 12},
                                                            {"gemma3.attention.head_count", 4},
                                                            {"gemma3.attention.head_count_kv", 1},
                                                            {"gemma3.attention.key_length", 16},
                                                            {"gemma3.context_length", 64},
                                                            {"gemma3.vocab_size", 100}})
      b.str(key).u32(4).u32(value);
    f32_value(b, "gemma3.attention.layer_norm_rms_epsilon", 1e-6f);
    f32_value(b, "gemma3.rope.freq_base", 1e6f);
    write(b);
    test::write_file(dir / "g.gguf", b.text());
    return GgufFile::open(dir / "g.gguf");
  };
  const ModelConfig c = gguf_model_config(
      gemma3(1, [](GgufBytes& b) { b.str("gemma3.attention.sliding_window").u32(4).u32(8); }));
  EXPECT_EQ(c.architecture, "Gemma3ForCausalLM");
  EXPECT_EQ(c.head_dim, 16);  // key_length, not width / heads (8)
  EXPECT_FALSE(c.sliding_window.has_value());
  for (std::int64_t l = 0; l < 12; ++l) {
    const bool global = l == 5 || l == 11;
    EXPECT_EQ(c.layer_window(l), global ? std::nullopt : std::optional<std::int64_t>(8)) << l;
    EXPECT_EQ(c.layer_rope_theta(l), global ? 1e6 : 1e4) << l;
  }
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.post_norms);
  EXPECT_EQ(c.activation, ModelConfig::Activation::gelu_tanh);
  EXPECT_DOUBLE_EQ(c.embedding_scale, std::sqrt(32.0));
  EXPECT_EQ(c.query_scale, 0);  // 1/sqrt(head_dim), llama.cpp's for every size but 27B
  // Without a window every layer is global; the pattern and local base can be given.
  const ModelConfig dense = gguf_model_config(gemma3(0, [](GgufBytes&) {}));
  EXPECT_FALSE(dense.layer_window(0).has_value());
  const ModelConfig every_third = gguf_model_config(gemma3(3, [](GgufBytes& b) {
    b.str("gemma3.attention.sliding_window").u32(4).u32(8);
    b.str("gemma3.attention.sliding_window_pattern").u32(4).u32(3);
    f32_value(b, "gemma3.rope.freq_base_swa", 5e4f);
  }));
  EXPECT_FALSE(every_third.layer_window(2).has_value());
  EXPECT_EQ(every_third.layer_window(3), 8);
  EXPECT_EQ(every_third.layer_rope_theta(0), 5e4);
  EXPECT_NE(error_of<Error>([&] {
              gguf_model_config(gemma3(
                  1, [](GgufBytes& b) { f32_value(b, "gemma3.final_logit_softcapping", 30); }));
            }).find("logit soft-capping is not implemented"),
            std::string::npos);
  EXPECT_NE(error_of<Error>([&] {
              gguf_model_config(gemma3(
                  1, [](GgufBytes& b) { b.str("gemma3.attention.value_length").u32(4).u32(32); }));
            }).find("value_length 32 differs from key_length 16"),
            std::string::npos);
  // A Gemma3ForCausalLM config.json is refused with the way to run it (its norms would need 1 + w).
  EXPECT_NE(error_of<Error>([] {
              parse_model_config(
                  R"({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 32,
                      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                      "max_position_embeddings": 64})",
                  "config.json");
            }).find("run Gemma 3 from its GGUF file"),
            std::string::npos);
}

// tokenizer.ggml.pre of another type than string was read as "default" (GPT-2 splitting).
TEST(Gguf, APreTokenizerNameOfAnotherTypeIsRefused) {
  test::TempDir dir;
  GgufBytes b;
  b.header(3, 0, 4).str("tokenizer.ggml.model").u32(8).str("gpt2");
  b.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(2).str("a").str("b");
  b.str("tokenizer.ggml.merges").u32(9).u32(8).u64(0);
  b.str("tokenizer.ggml.pre").u32(4).u32(7);  // a uint32 where a name belongs
  test::write_file(dir / "t.gguf", b.text());
  const GgufFile file = GgufFile::open(dir / "t.gguf");
  EXPECT_NE(error_of<Error>([&] {
              gguf_tokenizer(file);
            }).find("tokenizer.ggml.pre must be a string naming the pre-tokenizer, got 7"),
            std::string::npos);
}

TEST(Gguf, DequantizeRefusesMismatchedSizesAndUnknownTypes) {
  std::vector<std::byte> bytes(34);
  std::vector<float> values(31);
  EXPECT_NE(error_of<Error>([&] { gguf_dequantize(8, bytes, values); }).find("do not hold"),
            std::string::npos);
  values.resize(32);
  EXPECT_NO_THROW(gguf_dequantize(8, bytes, values));
  EXPECT_NE(error_of<Error>([&] {
              gguf_dequantize(13, bytes, values);
            }).find("Q5_K is not one kvlab reads"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab
