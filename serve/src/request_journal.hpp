#pragma once
// kvlab serve's journal: each choice's end appended as one JSON line the moment it ends, so a
// served run's record survives the process dying (kvlab serve otherwise writes its results
// folder at shutdown, from memory). Thread-safe; a line is one write(2) to a file opened for
// appending. Internal to kvlab_serve.
#include <filesystem>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

namespace kvlab::serve {

class RequestJournal {
 public:
  RequestJournal() = default;  // off: append() does nothing
  // Opens (creates) `path` for appending; throws kvlab::Error naming it when it cannot.
  explicit RequestJournal(const std::filesystem::path& path);
  ~RequestJournal();
  RequestJournal(const RequestJournal&) = delete;
  RequestJournal& operator=(const RequestJournal&) = delete;
  // The line as JSON (strings with bad UTF-8 replaced). A failed write is said once on stderr:
  // the answers go on.
  void append(const nlohmann::json& line);

 private:
  std::mutex mutex_;
  std::filesystem::path path_;
  int fd_ = -1;
  bool failed_ = false;
};

}  // namespace kvlab::serve
