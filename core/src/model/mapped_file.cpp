#include "kvlab/model/mapped_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab {

MappedFile::MappedFile(const std::filesystem::path& path, std::string_view kind) {
  auto fail = [&](const char* what) {
    return Error(
        fmt::format("cannot {} {} file {}: {}", what, kind, path.string(), std::strerror(errno)));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail("open");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const Error error = fail("stat");
    ::close(fd);
    throw error;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("cannot read {} file {}: not a regular file", kind, path.string()));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* address = mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) {
      const Error error = fail("map");
      ::close(fd);
      throw error;
    }
    address_ = static_cast<const std::byte*>(address);
  }
  ::close(fd);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : address_(std::exchange(other.address_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (address_ != nullptr) munmap(const_cast<std::byte*>(address_), size_);
    address_ = std::exchange(other.address_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (address_ != nullptr) munmap(const_cast<std::byte*>(address_), size_);
}

}  // namespace kvlab
