#include "kvlab/model/safetensors.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/mapped_file.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

using nlohmann::json;

std::int64_t TensorInfo::element_count() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shape_to_string(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

namespace {
// The reference implementation refuses headers over 100 MB; so do we.
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

using Fail = std::function<Error(const std::string&)>;

// The little-endian u64 that opens the file: the JSON header's length, within the file and limit.
std::uint64_t read_header_length(std::span<const std::byte> file, const Fail& fail) {
  const auto file_size = static_cast<std::uint64_t>(file.size());
  if (file_size < 8)
    throw fail(fmt::format(
        "truncated: {} bytes, but the file must start with an 8-byte header length", file_size));
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i)
    header_length = (header_length << 8) | std::to_integer<std::uint64_t>(file[i]);
  if (header_length > file_size - 8)
    throw fail(
        fmt::format("header length {} runs past the end of the file ({} bytes): truncated or not a "
                    "safetensors file",
                    header_length, file_size));
  if (header_length > kMaxHeaderBytes)
    throw fail(
        fmt::format("header length {} exceeds the {}-byte limit", header_length, kMaxHeaderBytes));
  return header_length;
}

json parse_header(std::span<const std::byte> text, const Fail& fail) {
  json header;
  try {
    const auto* begin = reinterpret_cast<const char*>(text.data());
    header = json::parse(begin, begin + text.size());
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw fail(fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!header.is_object()) throw fail("header must be a JSON object");
  return header;
}

void read_metadata(const json& entry, std::map<std::string, std::string>& metadata,
                   const Fail& fail) {
  if (!entry.is_object()) throw fail("\"__metadata__\" must be an object of strings");
  for (const auto& [key, value] : entry.items()) {
    if (!value.is_string())
      throw fail(fmt::format("\"__metadata__\" value for \"{}\" must be a string", key));
    metadata[key] = value.get<std::string>();
  }
}

// The "shape" field: non-negative dimensions whose product a 63-bit count holds.
std::vector<std::int64_t> read_shape(const json& entry, const Fail& tensor_fail) {
  const auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array())
    throw tensor_fail("missing array field \"shape\"");
  std::vector<std::int64_t> shape;
  std::optional<std::uint64_t> elements = 1;  // checked: a shape from input may overflow
  for (const auto& d : *shape_it) {
    if (!d.is_number_unsigned())
      throw tensor_fail(fmt::format("shape {} must hold non-negative integers", shape_it->dump()));
    const auto dim = narrow_integer<std::int64_t>(d.get<std::uint64_t>());
    if (dim && elements) elements = checked_mul<std::uint64_t>(*elements, *dim);
    if (!dim || !elements || !narrow_integer<std::int64_t>(*elements))
      throw tensor_fail(
          fmt::format("shape {} has more elements than a 63-bit count can hold", shape_it->dump()));
    shape.push_back(*dim);
  }
  return shape;
}

// The "data_offsets" field: [begin, end) inside the data section, exactly the bytes that the
// dtype and shape need.
void read_data_offsets(const json& entry, TensorInfo& info, std::uint64_t data_bytes,
                       const Fail& tensor_fail) {
  const auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned())
    throw tensor_fail("\"data_offsets\" must be [begin, end] with non-negative integers");
  info.data_begin = (*offsets_it)[0].get<std::uint64_t>();
  info.data_end = (*offsets_it)[1].get<std::uint64_t>();
  if (info.data_end < info.data_begin)
    throw tensor_fail(
        fmt::format("data_offsets [{}, {}] end before they begin", info.data_begin, info.data_end));
  const std::string dtype = entry.at("dtype").get<std::string>();
  const auto needed = checked_mul<std::uint64_t>(static_cast<std::uint64_t>(info.element_count()),
                                                 dtype_size(info.dtype));
  if (!needed)
    throw tensor_fail(fmt::format("{} x {} needs more bytes than 64 bits can count", dtype,
                                  shape_to_string(info.shape)));
  if (info.data_end - info.data_begin != *needed)
    throw tensor_fail(fmt::format("data_offsets [{}, {}] hold {} bytes but {} x {} needs {}",
                                  info.data_begin, info.data_end, info.data_end - info.data_begin,
                                  dtype, shape_to_string(info.shape), *needed));
  if (info.data_end > data_bytes)
    throw tensor_fail(
        fmt::format("data_offsets [{}, {}] are out of bounds: the data section has {} bytes "
                    "(truncated file?)",
                    info.data_begin, info.data_end, data_bytes));
}

// One tensor's header entry: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}.
TensorInfo read_tensor_entry(const std::string& name, const json& entry, std::uint64_t data_bytes,
                             const std::string& where) {
  const Fail tensor_fail = [&](const std::string& why) -> Error {
    return Error(fmt::format("bad safetensors file {}: tensor \"{}\": {}", where, name, why));
  };
  if (!entry.is_object())
    throw tensor_fail("entry must be an object with dtype, shape, data_offsets");
  TensorInfo info;
  info.name = name;
  const auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string())
    throw tensor_fail("missing string field \"dtype\"");
  const auto dtype = dtype_from_safetensors_name(dtype_it->get<std::string>());
  if (!dtype) throw tensor_fail(fmt::format("unknown dtype \"{}\"", dtype_it->get<std::string>()));
  info.dtype = *dtype;
  info.shape = read_shape(entry, tensor_fail);
  read_data_offsets(entry, info, data_bytes, tensor_fail);
  return info;
}

// No two tensors may share bytes.
void check_no_overlap(const std::vector<TensorInfo>& tensors, const Fail& fail) {
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data_begin < b->data_begin; });
  const TensorInfo* furthest = nullptr;  // the tensor reaching furthest so far
  for (const TensorInfo* current : by_offset) {
    if (current->data_end == current->data_begin) continue;  // empty tensors own no bytes
    if (furthest != nullptr && current->data_begin < furthest->data_end)
      throw fail(fmt::format("tensors \"{}\" [{}, {}] and \"{}\" [{}, {}] overlap", furthest->name,
                             furthest->data_begin, furthest->data_end, current->name,
                             current->data_begin, current->data_end));
    if (furthest == nullptr || current->data_end > furthest->data_end) furthest = current;
  }
}
}  // namespace

struct SafetensorsFile::Mapping : MappedFile {
  using MappedFile::MappedFile;
};

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  const std::string where = path.string();
  auto fail = [&](const std::string& why) -> Error {
    return Error(fmt::format("bad safetensors file {}: {}", where, why));
  };

  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ = std::make_unique<Mapping>(path, "safetensors");
  const std::span<const std::byte> bytes = file.mapping_->bytes();
  const std::uint64_t header_length = read_header_length(bytes, fail);
  const json header = parse_header(bytes.subspan(8, header_length), fail);
  file.data_ = bytes.subspan(8 + header_length);
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__")
      read_metadata(item.value(), file.metadata_, fail);
    else
      file.tensors_.push_back(
          read_tensor_entry(item.key(), item.value(), file.data_.size(), where));
  }
  check_no_overlap(file.tensors_, fail);
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return file;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& tensor) const {
  return data_.subspan(tensor.data_begin, tensor.data_end - tensor.data_begin);
}

Checkpoint Checkpoint::open(const std::filesystem::path& directory) {
  Checkpoint checkpoint;
  checkpoint.directory_ = directory;
  const auto single = directory / "model.safetensors";
  const auto index = directory / "model.safetensors.index.json";
  if (std::filesystem::exists(index)) {
    std::ifstream in(index, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    json root;
    try {
      root = json::parse(text.str());
    } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
      throw Error(
          fmt::format("bad checkpoint index {}: not valid JSON: {}", index.string(), e.what()));
    }
    const auto map_it = root.find("weight_map");
    if (!root.is_object() || map_it == root.end() || !map_it->is_object())
      throw Error(
          fmt::format("bad checkpoint index {}: missing object \"weight_map\"", index.string()));
    std::map<std::string, std::size_t> file_indices;
    for (const auto& [tensor, shard] : map_it->items()) {
      if (!shard.is_string())
        throw Error(fmt::format("bad checkpoint index {}: tensor \"{}\" must map to a file name",
                                index.string(), tensor));
      const auto shard_name = shard.get<std::string>();
      if (shard_name.find('/') != std::string::npos)
        throw Error(
            fmt::format("bad checkpoint index {}: shard \"{}\" must be a file in the same folder",
                        index.string(), shard_name));
      auto [it, inserted] = file_indices.try_emplace(shard_name, checkpoint.files_.size());
      if (inserted) checkpoint.files_.push_back(SafetensorsFile::open(directory / shard_name));
      const auto& file = checkpoint.files_[it->second];
      const TensorInfo* info = file.find(tensor);
      if (info == nullptr)
        throw Error(
            fmt::format("bad checkpoint index {}: tensor \"{}\" is listed in {} but that file does "
                        "not contain it",
                        index.string(), tensor, file.path().string()));
      checkpoint.tensors_.emplace(tensor, Location{it->second, info});
    }
  } else if (std::filesystem::exists(single)) {
    checkpoint.files_.push_back(SafetensorsFile::open(single));
    for (const auto& info : checkpoint.files_[0].tensors())
      checkpoint.tensors_.emplace(info.name, Location{0, &info});
  } else {
    throw Error(
        fmt::format("no weights in {}: expected model.safetensors or model.safetensors.index.json",
                    directory.string()));
  }
  return checkpoint;
}

bool Checkpoint::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  for (const auto& [name, location] : tensors_) names.push_back(name);
  return names;
}

Checkpoint::Location Checkpoint::locate(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    const auto names = tensor_names();
    std::string message =
        fmt::format("missing tensor \"{}\" in checkpoint {}", name, directory_.string());
    if (auto near = nearest_name(name, names))
      message += fmt::format(" (did you mean \"{}\"?)", *near);
    throw Error(message);
  }
  return it->second;
}

void Checkpoint::check_tensor(std::string_view name,
                              std::span<const std::int64_t> expected_shape) const {
  const Location location = locate(name);
  const SafetensorsFile& file = files_[location.file_index];
  const TensorInfo& info = *location.info;
  if (!std::equal(info.shape.begin(), info.shape.end(), expected_shape.begin(),
                  expected_shape.end()))
    throw Error(fmt::format("tensor \"{}\" in {} has shape {} but the model config needs {}", name,
                            file.path().string(), shape_to_string(info.shape),
                            shape_to_string(expected_shape)));
  if (!dtype_converts_to_f32(info.dtype))
    throw Error(
        fmt::format("tensor \"{}\" in {} has dtype {}; kvlab reads F32, F16, BF16 or F64 weights",
                    name, file.path().string(), dtype_safetensors_name(info.dtype)));
}

void Checkpoint::read_f32_into(std::string_view name, std::span<const std::int64_t> expected_shape,
                               std::span<float> destination) const {
  check_tensor(name, expected_shape);
  const Location location = locate(name);
  const SafetensorsFile& file = files_[location.file_index];
  const TensorInfo& info = *location.info;
  if (destination.size() != static_cast<std::size_t>(info.element_count()))
    throw Error(fmt::format("tensor \"{}\": destination holds {} floats, tensor has {}", name,
                            destination.size(), info.element_count()));
  convert_to_f32(info.dtype, file.bytes(info), destination);
}

std::vector<float> Checkpoint::read_f32(std::string_view name,
                                        std::span<const std::int64_t> expected_shape) const {
  std::int64_t n = 1;
  for (auto d : expected_shape) n *= d;
  std::vector<float> values(static_cast<std::size_t>(n));
  read_f32_into(name, expected_shape, values);
  return values;
}

void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> ordered;
  for (const auto& t : tensors) ordered.push_back(&t);
  std::sort(ordered.begin(), ordered.end(), [](auto* a, auto* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    const TensorToWrite& t = *ordered[i];
    if (t.name.empty() || t.name == "__metadata__")
      throw Error(
          fmt::format("cannot write {}: invalid tensor name \"{}\"", path.string(), t.name));
    if (i > 0 && ordered[i - 1]->name == t.name)
      throw Error(fmt::format("cannot write {}: tensor \"{}\" given twice", path.string(), t.name));
    std::int64_t n = 1;
    for (auto d : t.shape) {
      if (d < 0)
        throw Error(fmt::format("cannot write {}: tensor \"{}\" has a negative dimension",
                                path.string(), t.name));
      n *= d;
    }
    const std::uint64_t size = static_cast<std::uint64_t>(n) * dtype_size(t.dtype);
    if (size != t.bytes.size())
      throw Error(fmt::format("cannot write {}: tensor \"{}\" {} {} needs {} bytes, got {}",
                              path.string(), t.name, dtype_safetensors_name(t.dtype),
                              shape_to_string(t.shape), size, t.bytes.size()));
    header[t.name] = {{"dtype", dtype_safetensors_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno)));
  std::uint64_t length = header_text.size();
  char length_bytes[8];
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  out.write(length_bytes, 8);
  out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
  for (const auto* t : ordered)
    out.write(reinterpret_cast<const char*>(t->bytes.data()),
              static_cast<std::streamsize>(t->bytes.size()));
  out.close();
  if (!out) throw Error(fmt::format("cannot write {}: write failed (disk full?)", path.string()));
}

}  // namespace kvlab
