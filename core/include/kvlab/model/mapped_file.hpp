#pragma once
// A whole file mapped read-only (checkpoints: safetensors, GGUF). Move-only; unmaps on
// destruction. Readers bounds-check every offset against bytes().size() themselves.
#include <cstddef>
#include <filesystem>
#include <span>
#include <string_view>

namespace kvlab {

class MappedFile {
 public:
  // Throws kvlab::Error "cannot open <kind> file PATH: why" (kind: "safetensors", "GGUF").
  MappedFile(const std::filesystem::path& path, std::string_view kind);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {address_, size_}; }

 private:
  const std::byte* address_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace kvlab
