#include "request_journal.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvlab/error.hpp"

namespace kvlab::serve {

RequestJournal::RequestJournal(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0)
    throw Error(
        fmt::format("cannot open the request journal {}: {}", path.string(), std::strerror(errno)));
}

RequestJournal::~RequestJournal() {
  if (fd_ >= 0) ::close(fd_);
}

void RequestJournal::append(const nlohmann::json& line) {
  if (fd_ < 0) return;
  const std::string text =
      line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(mutex_);
  std::size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!failed_)
        fmt::print(stderr, "kvlab serve: cannot write the request journal {}: {}\n", path_.string(),
                   std::strerror(errno));
      failed_ = true;
      return;
    }
    written += static_cast<std::size_t>(n);
  }
}

}  // namespace kvlab::serve
