#include "kvlab/model/gguf.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "kvlab/checked_math.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/mapped_file.hpp"

namespace kvlab {
namespace {

constexpr std::uint32_t kMaxArrayDepth = 4;  // nested arrays: the spec allows them, no model
                                             // uses more than one level
constexpr std::uint64_t kMaxDims = 4;        // GGML_MAX_DIMS
constexpr std::uint64_t kMaxAlignment = 1 << 20;

// Reads little-endian values from the mapped file, each read checked against its end. Errors
// name the byte offset, so a truncated or corrupt file says where it broke.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, std::string file)
      : bytes_(bytes), file_(std::move(file)) {}

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }
  std::string read_string(const char* what) {
    const auto length = read<std::uint64_t>(what);
    need(length, what);
    std::string text(reinterpret_cast<const char*>(bytes_.data() + position_),
                     static_cast<std::size_t>(length));
    position_ += static_cast<std::size_t>(length);
    return text;
  }
  // Fails unless `count` items of at least `item_bytes` each can still follow: checked before a
  // vector is sized from a count in the file.
  void need_items(std::uint64_t count, std::uint64_t item_bytes, const char* what) const {
    const auto total = checked_mul(count, item_bytes);
    if (!total || *total > remaining())
      throw fail(
          fmt::format("{} claims {} items, more than the {} bytes left", what, count, remaining()));
  }
  std::uint64_t position() const { return position_; }
  // "GGUF file F, at byte N: <what>", for messages that are not about a malformed file.
  std::string where(const std::string& what) const {
    return fmt::format("GGUF file {}, at byte {}: {}", file_, position_, what);
  }
  std::uint64_t remaining() const { return bytes_.size() - position_; }
  Error fail(const std::string& why) const {
    return Error(fmt::format("bad GGUF file {}: at byte {}: {}", file_, position_, why));
  }

 private:
  void need(std::uint64_t count, const char* what) const {
    if (count > remaining())
      throw fail(fmt::format("truncated: {} needs {} bytes, {} left", what, count, remaining()));
  }
  std::span<const std::byte> bytes_;
  std::string file_;
  std::size_t position_ = 0;
};

// Smallest encoded size of a value of `type` (for need_items): strings are at least their
// 8-byte length, arrays their 12-byte header.
std::uint64_t min_value_bytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::uint8:
    case GgufValueType::int8:
    case GgufValueType::boolean:
      return 1;
    case GgufValueType::uint16:
    case GgufValueType::int16:
      return 2;
    case GgufValueType::uint32:
    case GgufValueType::int32:
    case GgufValueType::float32:
      return 4;
    case GgufValueType::string:
    case GgufValueType::uint64:
    case GgufValueType::int64:
    case GgufValueType::float64:
      return 8;
    case GgufValueType::array:
      return 12;
  }
  return 1;
}

GgufValue read_value(Cursor& in, std::uint32_t raw_type, std::uint32_t depth) {
  GgufValue v;
  v.type = static_cast<GgufValueType>(raw_type);
  switch (v.type) {
    case GgufValueType::uint8:
      v.value = std::uint64_t{in.read<std::uint8_t>("a uint8")};
      break;
    case GgufValueType::int8:
      v.value = std::int64_t{in.read<std::int8_t>("an int8")};
      break;
    case GgufValueType::uint16:
      v.value = std::uint64_t{in.read<std::uint16_t>("a uint16")};
      break;
    case GgufValueType::int16:
      v.value = std::int64_t{in.read<std::int16_t>("an int16")};
      break;
    case GgufValueType::uint32:
      v.value = std::uint64_t{in.read<std::uint32_t>("a uint32")};
      break;
    case GgufValueType::int32:
      v.value = std::int64_t{in.read<std::int32_t>("an int32")};
      break;
    case GgufValueType::uint64:
      v.value = in.read<std::uint64_t>("a uint64");
      break;
    case GgufValueType::int64:
      v.value = in.read<std::int64_t>("an int64");
      break;
    case GgufValueType::float32:
      v.value = double{in.read<float>("a float32")};
      break;
    case GgufValueType::float64:
      v.value = in.read<double>("a float64");
      break;
    case GgufValueType::boolean: {
      const auto byte = in.read<std::uint8_t>("a bool");
      if (byte > 1) throw in.fail(fmt::format("bool value {} is neither 0 nor 1", byte));
      v.value = byte == 1;
      break;
    }
    case GgufValueType::string:
      v.value = in.read_string("a string");
      break;
    case GgufValueType::array: {
      if (depth >= kMaxArrayDepth)
        throw in.fail(fmt::format("arrays nested deeper than {}", kMaxArrayDepth));
      const auto element_type = in.read<std::uint32_t>("an array's element type");
      if (element_type > static_cast<std::uint32_t>(GgufValueType::float64))
        throw in.fail(fmt::format("unknown array element type {}", element_type));
      const auto count = in.read<std::uint64_t>("an array's length");
      in.need_items(count, min_value_bytes(static_cast<GgufValueType>(element_type)), "an array");
      check_allocation(count * sizeof(GgufValue),
                       in.where(fmt::format("a metadata array of {} items (held as {} bytes each)",
                                            count, sizeof(GgufValue))));
      GgufArray elements;
      elements.reserve(static_cast<std::size_t>(count));
      for (std::uint64_t i = 0; i < count; ++i)
        elements.push_back(read_value(in, element_type, depth + 1));
      v.value = std::move(elements);
      break;
    }
    default:
      throw in.fail(fmt::format("unknown metadata value type {}", raw_type));
  }
  return v;
}

GgufTensorInfo read_tensor_info(Cursor& in) {
  GgufTensorInfo t;
  t.name = in.read_string("a tensor name");
  const auto n_dims = in.read<std::uint32_t>("a tensor's dimension count");
  if (n_dims == 0 || n_dims > kMaxDims)
    throw in.fail(
        fmt::format("tensor \"{}\" has {} dimensions (1 to {})", t.name, n_dims, kMaxDims));
  std::optional<std::int64_t> elements = 1;
  for (std::uint32_t d = 0; d < n_dims; ++d) {
    const auto dim = narrow_integer<std::int64_t>(in.read<std::uint64_t>("a tensor dimension"));
    if (dim && elements) elements = checked_mul(*elements, *dim);
    if (!dim || !elements)
      throw in.fail(fmt::format("tensor \"{}\" has more elements than a 63-bit count", t.name));
    t.dims.push_back(*dim);
  }
  t.elements = *elements;
  t.type = in.read<std::uint32_t>("a tensor type");
  t.offset = in.read<std::uint64_t>("a tensor offset");
  const auto layout = gguf_block_layout(t.type);
  if (!layout)
    throw in.fail(
        fmt::format("tensor \"{}\" is {}, which kvlab does not read (it reads F32, F16, "
                    "BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K)",
                    t.name, gguf_type_name(t.type)));
  if (t.dims[0] % layout->elements != 0)
    throw in.fail(fmt::format("tensor \"{}\": rows of {} elements are not whole {} blocks of {}",
                              t.name, t.dims[0], gguf_type_name(t.type), layout->elements));
  const auto bytes = checked_mul(t.elements / layout->elements, layout->bytes);
  if (!bytes) throw in.fail(fmt::format("tensor \"{}\" has more bytes than 64 bits count", t.name));
  t.bytes = static_cast<std::uint64_t>(*bytes);
  return t;
}

// Two tensors whose bytes share the data section would alias each other's weights (the
// safetensors reader refuses the same); sorted by offset, each must end where the next begins
// or before.
template <typename Reader>
void check_no_overlap(const std::vector<GgufTensorInfo>& tensors, Reader& in) {
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : tensors)
    if (t.bytes > 0) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto* a, const auto* b) { return a->offset < b->offset; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& a = *by_offset[i - 1];
    const GgufTensorInfo& b = *by_offset[i];
    if (a.offset + a.bytes > b.offset)
      throw in.fail(fmt::format("tensors \"{}\" (data bytes {}..{}) and \"{}\" (from {}) overlap",
                                a.name, a.offset, a.offset + a.bytes, b.name, b.offset));
  }
}

}  // namespace

std::optional<GgufBlockLayout> gguf_block_layout(std::uint32_t type) {
  switch (static_cast<GgufTensorType>(type)) {
    case GgufTensorType::f32:
      return GgufBlockLayout{1, 4};
    case GgufTensorType::f16:
    case GgufTensorType::bf16:
      return GgufBlockLayout{1, 2};
    case GgufTensorType::q4_0:
      return GgufBlockLayout{32, 2 + 16};
    case GgufTensorType::q4_1:
      return GgufBlockLayout{32, 2 + 2 + 16};
    case GgufTensorType::q5_0:
      return GgufBlockLayout{32, 2 + 4 + 16};
    case GgufTensorType::q5_1:
      return GgufBlockLayout{32, 2 + 2 + 4 + 16};
    case GgufTensorType::q8_0:
      return GgufBlockLayout{32, 2 + 32};
    case GgufTensorType::q4_k:
      return GgufBlockLayout{256, 2 + 2 + 12 + 128};
    case GgufTensorType::q6_k:
      return GgufBlockLayout{256, 128 + 64 + 16 + 2};
  }
  return std::nullopt;
}

std::string gguf_type_name(std::uint32_t type) {
  // ggml_type names (ggml.h), so a refusal names what the file holds.
  static const char* const kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  nullptr,  nullptr, "Q5_0",  "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",   "Q5_K",  "Q6_K",  "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",   "F64",    "IQ1_M", "BF16"};
  if (type < std::size(kNames) && kNames[type] != nullptr) return kNames[type];
  return fmt::format("type {}", type);
}

std::optional<std::int64_t> GgufValue::as_int() const {
  if (const auto* u = std::get_if<std::uint64_t>(&value)) return narrow_integer<std::int64_t>(*u);
  if (const auto* i = std::get_if<std::int64_t>(&value)) return *i;
  return std::nullopt;
}

std::optional<double> GgufValue::as_double() const {
  if (const auto* d = std::get_if<double>(&value)) return *d;
  if (const auto* u = std::get_if<std::uint64_t>(&value)) return static_cast<double>(*u);
  if (const auto* i = std::get_if<std::int64_t>(&value)) return static_cast<double>(*i);
  return std::nullopt;
}

const std::string* GgufValue::as_string() const {
  return std::get_if<std::string>(&value);
}
const GgufArray* GgufValue::as_array() const {
  return std::get_if<GgufArray>(&value);
}

std::string GgufValue::to_string(std::size_t max_elements) const {
  return std::visit(
      [&](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v.size() > 64 ? fmt::format("\"{}...\" ({} bytes)", v.substr(0, 64), v.size())
                               : fmt::format("\"{}\"", v);
        } else if constexpr (std::is_same_v<T, GgufArray>) {
          std::string text = "[";
          for (std::size_t i = 0; i < std::min(v.size(), max_elements); ++i)
            text += (i ? ", " : "") + v[i].to_string(max_elements);
          if (v.size() > max_elements) text += fmt::format(", ... {} in all", v.size());
          return text + "]";
        } else {
          return fmt::format("{}", v);
        }
      },
      value);
}

std::vector<std::int64_t> GgufTensorInfo::row_major_shape() const {
  return {dims.rbegin(), dims.rend()};
}

struct GgufFile::Mapping : MappedFile {
  using MappedFile::MappedFile;
};

GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::filesystem::path& path) {
  GgufFile file;
  file.path_ = path;
  file.mapping_ = std::make_unique<Mapping>(path, "GGUF");
  const std::span<const std::byte> bytes = file.mapping_->bytes();
  Cursor in(bytes, path.string());
  if (bytes.size() < 4 || std::memcmp(bytes.data(), "GGUF", 4) != 0)
    throw in.fail("not a GGUF file (it does not start with \"GGUF\")");
  in.read<std::uint32_t>("the magic");
  file.version_ = in.read<std::uint32_t>("the version");
  if (file.version_ != 2 && file.version_ != 3)
    throw in.fail(fmt::format("GGUF version {}; kvlab reads versions 2 and 3", file.version_));
  const auto tensor_count = in.read<std::uint64_t>("the tensor count");
  const auto metadata_count = in.read<std::uint64_t>("the metadata count");
  in.need_items(metadata_count, 8 + 4 + 1, "the metadata");
  for (std::uint64_t i = 0; i < metadata_count; ++i) {
    std::string key = in.read_string("a metadata key");
    const auto type = in.read<std::uint32_t>("a metadata value type");
    GgufValue value = read_value(in, type, 0);
    if (!file.metadata_.emplace(key, std::move(value)).second)
      throw in.fail(fmt::format("metadata key \"{}\" appears twice", key));
  }
  if (const GgufValue* alignment = file.find_metadata("general.alignment")) {
    const auto a = alignment->as_int();
    if (!a || *a <= 0 || *a > static_cast<std::int64_t>(kMaxAlignment) || (*a & (*a - 1)) != 0)
      throw in.fail(fmt::format("general.alignment {} is not a power of two up to {}",
                                alignment->to_string(), kMaxAlignment));
    file.alignment_ = static_cast<std::uint64_t>(*a);
  }
  in.need_items(tensor_count, 8 + 4 + 8 + 4 + 8, "the tensor infos");
  file.tensors_.reserve(static_cast<std::size_t>(tensor_count));
  for (std::uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo tensor = read_tensor_info(in);
    if (!file.tensor_index_.emplace(tensor.name, file.tensors_.size()).second)
      throw in.fail(fmt::format("tensor \"{}\" appears twice", tensor.name));
    file.tensors_.push_back(std::move(tensor));
  }
  const std::uint64_t data_start =
      (in.position() + file.alignment_ - 1) / file.alignment_ * file.alignment_;
  if (data_start > bytes.size() && !file.tensors_.empty())
    throw in.fail("truncated: the data section is missing");
  file.data_ = bytes.subspan(std::min<std::uint64_t>(data_start, bytes.size()));
  for (const auto& t : file.tensors_) {
    if (t.offset % file.alignment_ != 0)
      throw in.fail(fmt::format("tensor \"{}\" at data offset {} is not aligned to {}", t.name,
                                t.offset, file.alignment_));
    if (t.offset > file.data_.size() || t.bytes > file.data_.size() - t.offset)
      throw in.fail(
          fmt::format("tensor \"{}\" ({} bytes at data offset {}) runs past the end of "
                      "the file (the data section has {} bytes: truncated?)",
                      t.name, t.bytes, t.offset, file.data_.size()));
  }
  check_no_overlap(file.tensors_, in);
  return file;
}

const GgufValue* GgufFile::find_metadata(std::string_view key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> GgufFile::bytes(const GgufTensorInfo& tensor) const {
  return data_.subspan(tensor.offset, tensor.bytes);
}

std::vector<float> GgufFile::dequantize(const GgufTensorInfo& tensor) const {
  std::vector<float> values(static_cast<std::size_t>(tensor.elements));
  gguf_dequantize(tensor.type, bytes(tensor), values);
  return values;
}

}  // namespace kvlab
