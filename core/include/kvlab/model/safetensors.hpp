#pragma once
// safetensors files (Hugging Face's format): an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the
// raw little-endian tensor bytes. Files are memory-mapped; every malformed file ends in one
// kvlab::Error naming the file and the tensor.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/dtype.hpp"

namespace kvlab {

struct TensorInfo {
  std::string name;
  DType dtype = DType::dtype_f32;
  std::vector<std::int64_t> shape;
  std::uint64_t data_begin = 0;  // offsets into the data section (after the header)
  std::uint64_t data_end = 0;

  std::int64_t element_count() const;
};

std::string shape_to_string(std::span<const std::int64_t> shape);  // "[64, 32]"

class SafetensorsFile {
 public:
  // Maps and validates the whole header. Throws kvlab::Error.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // sorted by name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(std::string_view name) const;
  std::span<const std::byte> bytes(const TensorInfo& tensor) const;

 private:
  SafetensorsFile() = default;
  struct Mapping;
  std::filesystem::path path_;
  std::unique_ptr<Mapping> mapping_;
  std::span<const std::byte> data_;  // the data section
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A model folder's weights: model.safetensors, or the shards listed by
// model.safetensors.index.json ({"weight_map": {tensor: file}}).
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& directory);  // throws kvlab::Error

  const std::filesystem::path& directory() const { return directory_; }
  bool contains(std::string_view name) const;
  std::vector<std::string> tensor_names() const;  // sorted
  // Checks that the tensor exists, has `expected_shape` and a dtype kvlab reads
  // (F32/F16/BF16/F64), without reading it. Throws kvlab::Error naming file and tensor.
  void check_tensor(std::string_view name, std::span<const std::int64_t> expected_shape) const;
  // Converts the tensor to fp32 after check_tensor. Throws kvlab::Error naming file and tensor.
  std::vector<float> read_f32(std::string_view name,
                              std::span<const std::int64_t> expected_shape) const;
  // The same, into caller memory of exactly the expected element count.
  void read_f32_into(std::string_view name, std::span<const std::int64_t> expected_shape,
                     std::span<float> destination) const;

 private:
  struct Location {
    std::size_t file_index;
    const TensorInfo* info;
  };
  Location locate(std::string_view name) const;

  std::filesystem::path directory_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Location, std::less<>> tensors_;
};

struct TensorToWrite {
  std::string name;
  DType dtype = DType::dtype_f32;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> bytes;  // exactly element_count x dtype_size bytes
};

// Writes a safetensors file: header keys sorted, data in name order, header padded with
// spaces to a multiple of 8 bytes (as the reference implementation does). Deterministic:
// the same tensors give the same bytes. Throws kvlab::Error on bad input or I/O failure.
void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kvlab
