#pragma once
// libFuzzer hands bytes; kvlab's readers take paths. One scratch file per fuzzing process,
// rewritten for every input (a tmpfs-backed /tmp keeps this cheap).
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace kvlab::fuzz {

inline std::filesystem::path write_input(std::string_view bytes, std::string_view extension) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("kvlab_fuzz_" + std::to_string(getpid()) + std::string(extension));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace kvlab::fuzz
