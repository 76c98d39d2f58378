#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "kvlab/error.hpp"
#include "kvlab/model/safetensors.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using nlohmann::json;
using test::error_of;
using test::TempDir;

std::span<const std::byte> as_bytes_of(const std::vector<float>& v) {
  return std::as_bytes(std::span(v));
}

// A safetensors file written by hand: 8-byte length + header text + data.
std::string raw_file(const std::string& header, const std::string& data,
                     std::uint64_t header_length_override = 0) {
  std::string out(8, '\0');
  const std::uint64_t length = header_length_override ? header_length_override : header.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string open_error(const std::filesystem::path& path) {
  return error_of<Error>([&] { SafetensorsFile::open(path); });
}

TEST(Safetensors, RoundTripF32F16BF16) {
  TempDir dir;
  const std::vector<float> a{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, -7.0f};
  const std::vector<float> b{0.1f, 0.2f, 0.3f};
  std::vector<std::byte> a_half(a.size() * 2), b_bf16(b.size() * 2);
  convert_from_f32(DType::dtype_f16, a, a_half);
  convert_from_f32(DType::dtype_bf16, b, b_bf16);
  const std::vector<TensorToWrite> tensors{
      {"z.f32", DType::dtype_f32, {2, 3}, as_bytes_of(a)},
      {"a.f16", DType::dtype_f16, {3, 2}, a_half},
      {"m.bf16", DType::dtype_bf16, {3}, b_bf16},
  };
  write_safetensors(dir / "t.safetensors", tensors, {{"format", "pt"}});

  const SafetensorsFile file = SafetensorsFile::open(dir / "t.safetensors");
  ASSERT_EQ(file.tensors().size(), 3u);
  EXPECT_EQ(file.tensors()[0].name, "a.f16");  // sorted by name
  EXPECT_EQ(file.metadata().at("format"), "pt");
  const TensorInfo* f32 = file.find("z.f32");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32->shape, (std::vector<std::int64_t>{2, 3}));
  std::vector<float> back(6);
  convert_to_f32(f32->dtype, file.bytes(*f32), back);
  EXPECT_EQ(back, a);  // f32 is exact

  const TensorInfo* f16 = file.find("a.f16");
  convert_to_f32(f16->dtype, file.bytes(*f16), back);
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(back[i], a[i], std::abs(a[i]) * 1e-3 + 1e-7) << i;
  EXPECT_EQ(back[1], -2.5f);  // exactly representable values survive

  const TensorInfo* bf16 = file.find("m.bf16");
  std::vector<float> back3(3);
  convert_to_f32(bf16->dtype, file.bytes(*bf16), back3);
  for (std::size_t i = 0; i < b.size(); ++i)
    EXPECT_NEAR(back3[i], b[i], std::abs(b[i]) * 8e-3) << i;
  EXPECT_EQ(file.find("nope"), nullptr);
}

TEST(Safetensors, HeaderIsPaddedAndDeterministic) {
  TempDir dir;
  const std::vector<float> a{1, 2, 3};
  const std::vector<TensorToWrite> tensors{{"x", DType::dtype_f32, {3}, as_bytes_of(a)}};
  write_safetensors(dir / "1.safetensors", tensors);
  write_safetensors(dir / "2.safetensors", tensors);
  const std::string bytes = test::read_file(dir / "1.safetensors");
  EXPECT_EQ(bytes, test::read_file(dir / "2.safetensors"));
  std::uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_length + 12);
}

TEST(Safetensors, BitExactHalfConversions) {
  // Round to nearest even at the f16/bf16 boundary, as IEEE and PyTorch do.
  const std::vector<float> values{1.0f + 1.0f / 2048.0f, 1.0f + 3.0f / 2048.0f, 65504.0f,
                                  1.0f + 1.0f / 256.0f};
  std::vector<std::byte> half(8), bf16(8);
  convert_from_f32(DType::dtype_f16, values, half);
  convert_from_f32(DType::dtype_bf16, values, bf16);
  std::vector<float> back(4);
  convert_to_f32(DType::dtype_f16, half, back);
  EXPECT_EQ(back[0], 1.0f);                   // tie -> even (down)
  EXPECT_EQ(back[1], 1.0f + 4.0f / 2048.0f);  // tie -> even (up)
  EXPECT_EQ(back[2], 65504.0f);               // largest finite half
  convert_to_f32(DType::dtype_bf16, bf16, back);
  EXPECT_EQ(back[3], 1.0f);  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7 in bf16 -> even
}

TEST(Safetensors, TruncatedBelowEightBytes) {
  TempDir dir;
  test::write_file(dir / "short.safetensors", "abc");
  const std::string message = open_error(dir / "short.safetensors");
  EXPECT_NE(message.find("short.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("truncated: 3 bytes"), std::string::npos) << message;
}

TEST(Safetensors, HeaderLengthPastEndOfFile) {
  TempDir dir;
  test::write_file(dir / "h.safetensors", raw_file("{}", "", 4096));
  const std::string message = open_error(dir / "h.safetensors");
  EXPECT_NE(message.find("header length 4096 runs past the end of the file"), std::string::npos)
      << message;
}

TEST(Safetensors, BadJson) {
  TempDir dir;
  test::write_file(dir / "j.safetensors", raw_file("{\"x\": {\"dtype\": ", ""));
  EXPECT_NE(open_error(dir / "j.safetensors").find("header is not valid JSON"), std::string::npos);
}

TEST(Safetensors, NumberBeyondDoubleRangeIsBadJson) {
  TempDir dir;
  test::write_file(dir / "h.safetensors", raw_file("{\"w\": 1e999}", ""));
  EXPECT_NE(open_error(dir / "h.safetensors").find("header is not valid JSON"), std::string::npos);
}

TEST(Safetensors, UnknownDtype) {
  TempDir dir;
  const json header = {{"w", {{"dtype", "F12"}, {"shape", {2}}, {"data_offsets", {0, 3}}}}};
  test::write_file(dir / "d.safetensors", raw_file(header.dump(), "abc"));
  const std::string message = open_error(dir / "d.safetensors");
  EXPECT_NE(message.find("tensor \"w\": unknown dtype \"F12\""), std::string::npos) << message;
}

TEST(Safetensors, OffsetsOutOfBounds) {
  TempDir dir;
  const json header = {{"w", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}};
  test::write_file(dir / "o.safetensors", raw_file(header.dump(), std::string(8, '\0')));
  const std::string message = open_error(dir / "o.safetensors");
  EXPECT_NE(message.find("o.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("tensor \"w\": data_offsets [0, 16] are out of bounds"), std::string::npos)
      << message;
}

TEST(Safetensors, OffsetsDisagreeWithShape) {
  TempDir dir;
  const json header = {{"w", {{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}}};
  test::write_file(dir / "s.safetensors", raw_file(header.dump(), std::string(8, '\0')));
  const std::string message = open_error(dir / "s.safetensors");
  EXPECT_NE(message.find("tensor \"w\": data_offsets [0, 8] hold 8 bytes but F32 x [3] needs 12"),
            std::string::npos)
      << message;
}

TEST(Safetensors, OverlappingTensors) {
  TempDir dir;
  const json header = {{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
                       {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}}};
  test::write_file(dir / "ov.safetensors", raw_file(header.dump(), std::string(12, '\0')));
  const std::string message = open_error(dir / "ov.safetensors");
  EXPECT_NE(message.find("tensors \"a\" [0, 8] and \"b\" [4, 12] overlap"), std::string::npos)
      << message;
}

TEST(Safetensors, MalformedEntries) {
  TempDir dir;
  const std::vector<std::pair<json, std::string>> cases{
      {{{"w", 5}}, "entry must be an object"},
      {{{"w", {{"shape", {1}}, {"data_offsets", {0, 4}}}}}, "missing string field \"dtype\""},
      {{{"w", {{"dtype", "F32"}, {"data_offsets", {0, 4}}}}}, "missing array field \"shape\""},
      {{{"w", {{"dtype", "F32"}, {"shape", {-1}}, {"data_offsets", {0, 4}}}}},
       "non-negative integers"},
      {{{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4}}}}},
       "\"data_offsets\" must be [begin, end]"},
      {{{"w", {{"dtype", "F32"}, {"shape", {0}}, {"data_offsets", {4, 0}}}}},
       "end before they begin"},
      {{{"__metadata__", {{"k", 1}}}}, "\"__metadata__\" value for \"k\" must be a string"},
      // Sizes that overflow: [2^32, 2^32] with 0 bytes used to pass (the count wrapped to 0).
      {{{"w",
         {{"dtype", "F32"}, {"shape", {4294967296ULL, 4294967296ULL}}, {"data_offsets", {0, 0}}}}},
       "more elements than a 63-bit count can hold"},
      {{{"w", {{"dtype", "F32"}, {"shape", {18446744073709551615ULL}}, {"data_offsets", {0, 0}}}}},
       "more elements than a 63-bit count can hold"},
      {{{"w", {{"dtype", "F64"}, {"shape", {4611686018427387904ULL}}, {"data_offsets", {0, 0}}}}},
       "needs more bytes than 64 bits can count"},
  };
  for (const auto& [header, expected] : cases) {
    test::write_file(dir / "m.safetensors", raw_file(header.dump(), std::string(4, '\0')));
    const std::string message = open_error(dir / "m.safetensors");
    EXPECT_NE(message.find(expected), std::string::npos) << header.dump() << " -> " << message;
  }
}

TEST(Safetensors, MissingFile) {
  const std::string message = open_error("/nonexistent/model.safetensors");
  EXPECT_NE(message.find("cannot open safetensors file /nonexistent/model.safetensors"),
            std::string::npos)
      << message;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    values_ = {1, 2, 3, 4, 5, 6};
    write_safetensors(
        dir_ / "model.safetensors",
        std::vector<TensorToWrite>{{"w", DType::dtype_f32, {2, 3}, as_bytes_of(values_)},
                                   {"ids", DType::dtype_i32, {2}, std::as_bytes(std::span(ids_))}});
  }
  TempDir dir_;
  std::vector<float> values_;
  std::vector<std::int32_t> ids_{7, 8};
};

TEST_F(CheckpointTest, ReadsWithShapeCheck) {
  const Checkpoint checkpoint = Checkpoint::open(dir_.path());
  const std::vector<std::int64_t> shape{2, 3};
  EXPECT_EQ(checkpoint.read_f32("w", shape), values_);
  EXPECT_TRUE(checkpoint.contains("w"));
  EXPECT_FALSE(checkpoint.contains("v"));
}

TEST_F(CheckpointTest, ShapeMismatchNamesFileAndTensor) {
  const Checkpoint checkpoint = Checkpoint::open(dir_.path());
  const std::vector<std::int64_t> shape{3, 2};
  const std::string message = error_of<Error>([&] { checkpoint.read_f32("w", shape); });
  EXPECT_NE(message.find("tensor \"w\""), std::string::npos) << message;
  EXPECT_NE(message.find("model.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find("has shape [2, 3] but the model config needs [3, 2]"), std::string::npos)
      << message;
}

TEST_F(CheckpointTest, MissingTensorSuggestsNearest) {
  const Checkpoint checkpoint = Checkpoint::open(dir_.path());
  const std::vector<std::int64_t> shape{2};
  const std::string message = error_of<Error>([&] { checkpoint.read_f32("idz", shape); });
  EXPECT_NE(message.find("missing tensor \"idz\""), std::string::npos) << message;
  EXPECT_NE(message.find(dir_.path().string()), std::string::npos) << message;
  EXPECT_NE(message.find("did you mean \"ids\""), std::string::npos) << message;
}

TEST_F(CheckpointTest, NonFloatDtypeIsRefusedForWeights) {
  const Checkpoint checkpoint = Checkpoint::open(dir_.path());
  const std::vector<std::int64_t> shape{2};
  const std::string message = error_of<Error>([&] { checkpoint.read_f32("ids", shape); });
  EXPECT_NE(message.find("tensor \"ids\""), std::string::npos) << message;
  EXPECT_NE(message.find("dtype I32"), std::string::npos) << message;
}

TEST(CheckpointSharded, IndexSpreadsTensorsOverFiles) {
  TempDir dir;
  const std::vector<float> a{1, 2}, b{3, 4, 5};
  write_safetensors(dir / "part-1.safetensors",
                    std::vector<TensorToWrite>{{"a", DType::dtype_f32, {2}, as_bytes_of(a)}});
  write_safetensors(dir / "part-2.safetensors",
                    std::vector<TensorToWrite>{{"b", DType::dtype_f32, {3}, as_bytes_of(b)}});
  const json index = {{"metadata", {{"total_size", 20}}},
                      {"weight_map", {{"a", "part-1.safetensors"}, {"b", "part-2.safetensors"}}}};
  test::write_file(dir / "model.safetensors.index.json", index.dump());
  const Checkpoint checkpoint = Checkpoint::open(dir.path());
  EXPECT_EQ(checkpoint.tensor_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(checkpoint.read_f32("b", std::vector<std::int64_t>{3}), b);
  EXPECT_EQ(checkpoint.read_f32("a", std::vector<std::int64_t>{2}), a);
}

TEST(CheckpointSharded, IndexErrors) {
  TempDir dir;
  const std::vector<float> a{1, 2};
  write_safetensors(dir / "part-1.safetensors",
                    std::vector<TensorToWrite>{{"a", DType::dtype_f32, {2}, as_bytes_of(a)}});
  auto index_error = [&](const std::string& text) {
    test::write_file(dir / "model.safetensors.index.json", text);
    return error_of<Error>([&] { Checkpoint::open(dir.path()); });
  };
  EXPECT_NE(index_error("{oops").find("not valid JSON"), std::string::npos);
  EXPECT_NE(index_error("{}").find("missing object \"weight_map\""), std::string::npos);
  EXPECT_NE(
      index_error(R"({"weight_map": {"a": "part-9.safetensors"}})").find("part-9.safetensors"),
      std::string::npos);
  EXPECT_NE(index_error(R"({"weight_map": {"b": "part-1.safetensors"}})")
                .find("tensor \"b\" is listed in"),
            std::string::npos);
}

TEST(CheckpointSharded, NoWeightsAtAll) {
  TempDir dir;
  const std::string message = error_of<Error>([&] { Checkpoint::open(dir.path()); });
  EXPECT_NE(message.find("expected model.safetensors or model.safetensors.index.json"),
            std::string::npos)
      << message;
}

TEST(SafetensorsWriter, RejectsInconsistentInput) {
  TempDir dir;
  const std::vector<float> a{1, 2, 3};
  EXPECT_NE(error_of<Error>([&] {
              write_safetensors(
                  dir / "x.safetensors",
                  std::vector<TensorToWrite>{{"a", DType::dtype_f32, {2}, as_bytes_of(a)}});
            }).find("needs 8 bytes, got 12"),
            std::string::npos);
  EXPECT_NE(error_of<Error>([&] {
              write_safetensors(
                  dir / "x.safetensors",
                  std::vector<TensorToWrite>{{"a", DType::dtype_f32, {3}, as_bytes_of(a)},
                                             {"a", DType::dtype_f32, {3}, as_bytes_of(a)}});
            }).find("given twice"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab
