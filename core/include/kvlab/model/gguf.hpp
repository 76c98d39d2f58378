#pragma once
// GGUF files (llama.cpp's format, versions 2 and 3): a header, typed metadata key/values, tensor
// infos, then the tensor data at offsets aligned to general.alignment. The file is memory-mapped
// and every count, length and offset is checked against its size before it is used; every
// malformed file ends in one kvlab::Error naming the file, the byte offset and what was read.
// Tensors of the types kvlab reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) dequantize to
// fp32 with gguf_dequantize: the same arithmetic as llama.cpp's dequantize_row_* (ggml-quants.c).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvlab {

// ggml_type values (ggml.h); only the ones kvlab dequantizes have a name here.
enum class GgufTensorType : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q4_k = 12,
  q6_k = 14,
  bf16 = 30,
};

// Elements per block and bytes per block of a tensor type (1 and 4 for F32); nullopt for a type
// kvlab does not read.
struct GgufBlockLayout {
  std::int64_t elements = 0;
  std::int64_t bytes = 0;
};
std::optional<GgufBlockLayout> gguf_block_layout(std::uint32_t type);
// "F32", "Q4_K", ...; "type 7" for one kvlab does not read.
std::string gguf_type_name(std::uint32_t type);

// Metadata value types (gguf.h, gguf_type).
enum class GgufValueType : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};

struct GgufValue;
using GgufArray = std::vector<GgufValue>;
// A metadata value: integers widened to 64 bits (signedness kept), floats to double.
struct GgufValue {
  GgufValueType type = GgufValueType::uint8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, GgufArray> value;

  // The value as an integer when it is one and fits; nullopt otherwise.
  std::optional<std::int64_t> as_int() const;
  std::optional<double> as_double() const;  // integers and floats
  const std::string* as_string() const;
  const GgufArray* as_array() const;
  std::string to_string(std::size_t max_elements = 8) const;  // for `kvlab model info`
};

struct GgufTensorInfo {
  std::string name;
  // ggml order: dims[0] is the fastest-varying (a row's length); the row-major shape is the
  // reverse ([rows, row_length] for a matrix).
  std::vector<std::int64_t> dims;
  std::uint32_t type = 0;
  std::uint64_t offset = 0;  // from the start of the data section, a multiple of the alignment
  std::int64_t elements = 0;
  std::uint64_t bytes = 0;  // elements / block elements x block bytes
  std::vector<std::int64_t> row_major_shape() const;
};

class GgufFile {
 public:
  // Maps and validates the header, metadata and tensor infos. Throws kvlab::Error.
  static GgufFile open(const std::filesystem::path& path);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  const std::filesystem::path& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }
  const GgufValue* find_metadata(std::string_view key) const;
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }  // in file order
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  std::span<const std::byte> bytes(const GgufTensorInfo& tensor) const;
  // The tensor as fp32, in ggml order (row-major with dims reversed). Throws kvlab::Error for a
  // type kvlab does not read.
  std::vector<float> dequantize(const GgufTensorInfo& tensor) const;

 private:
  GgufFile() = default;
  struct Mapping;
  std::filesystem::path path_;
  std::unique_ptr<Mapping> mapping_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::span<const std::byte> data_;  // the data section
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> tensor_index_;  // name -> tensors_ index
};

// Dequantizes whole blocks of `type` from `source` into `destination` (elements, a multiple of
// the block's elements; source holds exactly their bytes). Throws kvlab::Error for a type kvlab
// does not read or mismatched sizes.
void gguf_dequantize(std::uint32_t type, std::span<const std::byte> source,
                     std::span<float> destination);

}  // namespace kvlab
