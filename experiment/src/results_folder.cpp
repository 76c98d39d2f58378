#include "kvlab/experiment/results_folder.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "kvlab/json_limits.hpp"

namespace kvlab {
namespace fs = std::filesystem;

namespace {

std::string system_reason(int error) {
  return std::strerror(error);
}

// A marker, manifest or runs list: "" (which no parse takes) for anything but a regular file of
// at most 16 MiB that nests JSON at most 64 deep (json_limits.hpp).
std::string read_small_file(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(path, ec);
  if (ec || !fs::is_regular_file(status) || fs::file_size(path, ec) > (std::uintmax_t{16} << 20))
    return {};
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return json_limit_problem(text.str()).empty() ? text.str() : std::string();
}

// A file as kvlab left it: a user's edit changes its size or modification time.
nlohmann::json file_stamp(const fs::path& path) {
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0) return nullptr;
  return {{"bytes", info.st_size},
          {"mtime_ns", std::int64_t{info.st_mtim.tv_sec} * 1000000000 + info.st_mtim.tv_nsec}};
}

void write_marker(const fs::path& folder, bool complete, const std::vector<std::string>& files) {
  nlohmann::json listed = nlohmann::json::array();
  for (const std::string& file : files)
    listed.push_back({{"path", file}, {"stamp", file_stamp(folder / file)}});
  const nlohmann::json marker = {{"kvlab_results", 1}, {"complete", complete}, {"files", listed}};
  write_file(folder / kResultsMarker, marker.dump(1) + "\n");
}

// The files a marker lists that are still as kvlab wrote them, or why it is not kvlab's.
std::set<std::string> marker_files(const fs::path& folder, std::string& problem) {
  std::set<std::string> files;
  try {
    const auto marker = nlohmann::json::parse(read_small_file(folder / kResultsMarker));
    if (!marker.is_object() || marker.value("kvlab_results", 0) != 1 || !marker.contains("files") ||
        !marker["files"].is_array()) {
      problem = fmt::format("its {} is not one kvlab wrote", kResultsMarker);
      return {};
    }
    for (const auto& file : marker["files"]) {
      const fs::path path = file.at("path").get<std::string>();
      const auto first = path.begin();
      if (path.empty() || path.is_absolute() || (first != path.end() && *first == "..") ||
          path.lexically_normal() != path) {
        problem = fmt::format("its {} lists a path outside it", kResultsMarker);
        return {};
      }
      if (file.at("stamp") == file_stamp(folder / path)) files.insert(path.generic_string());
    }
  } catch (const nlohmann::json::exception& e) {
    problem = fmt::format("its {} cannot be read ({})", kResultsMarker, e.what());
  }
  return files;
}

// A folder an older kvlab wrote (before the marker): its manifest.json names kvlab's version and
// commit, its runs.json lists run folders. kvlab's files in it are the ones it always wrote, by
// name; experiment.toml is left out (without a stamp, an edit cannot be told apart: it is
// carried over, or must equal the new copy). Empty when the folder is not such a one.
std::set<std::string> older_kvlab_files(const fs::path& folder) {
  std::set<std::string> files;
  try {
    const auto manifest = nlohmann::json::parse(read_small_file(folder / "manifest.json"));
    const auto runs = nlohmann::json::parse(read_small_file(folder / "runs.json"));
    if (!manifest.is_object() || !manifest.contains("kvlab_version") ||
        !manifest.contains("kvlab_commit") || !runs.is_array())
      return {};
    for (const char* name : {"manifest.json", "runs.json", "summary.md"}) files.insert(name);
    for (const auto& run : runs) {
      const std::string dir = run.at("dir").get<std::string>();
      if (dir.empty() || dir.find('/') != std::string::npos || dir == "." || dir == "..") return {};
      for (const char* name : {"requests.csv", "steps.csv", "events.jsonl", "summary.json",
                               "outputs.jsonl", "logprobs.jsonl", "config.toml"})
        if (fs::exists(folder / dir / name)) files.insert(dir + "/" + name);
    }
  } catch (const nlohmann::json::exception&) {
    return {};
  }
  return files;
}

// Every regular file under `folder`, relative, the marker left out.
std::vector<std::string> files_under(const fs::path& folder) {
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(folder)) {
    if (entry.is_directory() && !entry.is_symlink()) continue;
    const std::string relative = fs::relative(entry.path(), folder).generic_string();
    if (relative != kResultsMarker) files.push_back(relative);
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string first_entries(const fs::path& folder) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    names.push_back(entry.path().filename().string());
    if (names.size() == 4) break;
  }
  std::sort(names.begin(), names.end());
  std::string text;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) text += (i ? ", " : "") + names[i];
  return names.size() > 3 ? text + ", ..." : text;
}

bool same_bytes(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (!fs::is_regular_file(a, ec) || !fs::is_regular_file(b, ec) ||
      fs::file_size(a, ec) != fs::file_size(b, ec))
    return false;
  return read_small_file(a) == read_small_file(b);
}

// Takes an exclusive flock on `path` (created); the path must still name the locked file
// afterwards, or another process removed it between our open and flock: try again.
int lock_file(const fs::path& path, const fs::path& folder) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      throw Error(fmt::format("cannot lock results folder {}: cannot create {}: {}",
                              folder.string(), path.string(), system_reason(errno)));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int error = errno;
      const std::string holder = read_small_file(path);
      close(fd);
      if (error == EWOULDBLOCK)
        throw Error(fmt::format(
            "results folder {} is being written by another kvlab run ({}): wait for it to "
            "finish, or --out another folder",
            folder.string(), holder.empty() ? "a process" : "pid " + holder));
      throw Error(
          fmt::format("cannot lock results folder {}: {}", folder.string(), system_reason(error)));
    }
    struct stat held {
    }, named{};
    if (fstat(fd, &held) == 0 && stat(path.c_str(), &named) == 0 && held.st_ino == named.st_ino &&
        held.st_dev == named.st_dev) {
      const std::string pid = std::to_string(getpid());
      if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
      }  // the pid is only for the message above
      return fd;
    }
    close(fd);
  }
  throw Error(fmt::format("cannot lock results folder {}: its lock file keeps being replaced",
                          folder.string()));
}

}  // namespace

bool marker_lists(const fs::path& folder, const std::string& file) {
  std::string problem;
  const std::set<std::string> files = marker_files(folder, problem);
  return problem.empty() && files.contains(file);
}

bool add_to_marker(const fs::path& folder, const std::string& file) {
  std::string problem;
  std::set<std::string> files = marker_files(folder, problem);
  nlohmann::json marker;
  try {
    marker = nlohmann::json::parse(read_small_file(folder / kResultsMarker));
  } catch (const nlohmann::json::exception&) {
    return false;
  }
  if (!problem.empty() || !marker.is_object() || !marker.value("complete", false)) return false;
  files.insert(file);
  write_marker(folder, true, {files.begin(), files.end()});
  return true;
}

FileWriter::FileWriter(const fs::path& path)
    : path_(path), fd_(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) {
  if (fd_ < 0)
    throw WriteError(fmt::format("cannot write {}: {}", path.string(), system_reason(errno)));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(std::string_view contents) {
  std::size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd_, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      throw WriteError(fmt::format("cannot write {}: {} ({} of {} bytes written)", path_.string(),
                                   system_reason(error), written_ + done,
                                   written_ + contents.size()));
    }
    done += static_cast<std::size_t>(n);
  }
  written_ += done;
}

void FileWriter::close() {
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0)
    throw WriteError(fmt::format("cannot write {}: {}", path_.string(), system_reason(errno)));
}

void write_file(const fs::path& path, std::string_view contents) {
  FileWriter file(path);
  file.write(contents);
  file.close();
}

ResultsFolder::ResultsFolder(const fs::path& folder, const Options& options) {
  std::error_code ec;
  folder_ = fs::absolute(folder).lexically_normal();
  if (!folder_.has_filename()) folder_ = folder_.parent_path();  // "r/" names r
  std::error_code missing;  // set when nothing is there yet: not an error
  if (fs::is_symlink(fs::symlink_status(folder_, missing)))
    folder_ = fs::canonical(folder_, ec);  // replace what the link names, not the link
  if (ec || folder_.filename().empty() || folder_ == folder_.root_path())
    throw Error(fmt::format("{} cannot be a results folder{}", folder.string(),
                            ec ? ": " + ec.message() : ""));
  const fs::path parent = folder_.parent_path();
  fs::create_directories(parent, ec);
  if (ec)
    throw Error(fmt::format("cannot create {} for results folder {}: {}", parent.string(),
                            folder_.string(), ec.message()));
  for (const auto& input : options.inputs) inputs_.push_back(fs::weakly_canonical(input, ec));
  const std::string name = folder_.filename().string();
  lock_path_ = parent / fmt::format(".{}.kvlab-lock", name);
  lock_fd_ = lock_file(lock_path_, folder_);
  try {
    check_existing(options);
    remove_stale_staging();
    staging_ = parent / fmt::format(".{}.kvlab-staging-{}", name, getpid());
    fs::remove_all(staging_, ec);
    if (!fs::create_directory(staging_, ec) || ec)
      throw Error(fmt::format("cannot create {} beside results folder {}: {}", staging_.string(),
                              folder_.string(), ec.message()));
    write_marker(staging_, false, {});  // first: a staging folder is always recognisably kvlab's
  } catch (...) {
    unlink(lock_path_.c_str());
    close(lock_fd_);
    throw;
  }
}

ResultsFolder::~ResultsFolder() {
  std::error_code ec;
  if (!committed_ && !keep_staging_ && !staging_.empty()) fs::remove_all(staging_, ec);
  unlink(lock_path_.c_str());  // before close: a waiting process then sees a fresh file
  close(lock_fd_);
}

// Nothing, an empty folder, or an earlier kvlab run (with --force) may be replaced.
void ResultsFolder::check_existing(const Options& options) {
  std::error_code ec;
  if (!fs::exists(folder_, ec)) return;
  if (!fs::is_directory(folder_, ec))
    throw Error(fmt::format("results folder {} is a file", folder_.string()));
  if (fs::is_empty(folder_, ec)) return;
  std::string problem;
  if (!fs::exists(folder_ / kResultsMarker, ec)) {
    earlier_files_ = older_kvlab_files(folder_);
    if (earlier_files_.empty())
      throw Error(fmt::format(
          "results folder {} is not empty and holds no {} (it is not a kvlab results folder; "
          "it holds {}): nothing was changed; choose another with --out",
          folder_.string(), kResultsMarker, first_entries(folder_)));
  } else {
    earlier_files_ = marker_files(folder_, problem);
  }
  if (!problem.empty())
    throw Error(fmt::format("results folder {}: {}; nothing was changed: choose another with --out",
                            folder_.string(), problem));
  if (!options.force)
    throw Error(fmt::format(
        "results folder {} holds an earlier run: pass --force to replace it, or --out another "
        "folder",
        folder_.string()));
  replaces_ = true;
}

// Staging folders of runs that died (their lock is gone: we hold it now).
void ResultsFolder::remove_stale_staging() const {
  const std::string prefix = fmt::format(".{}.kvlab-staging-", folder_.filename().string());
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder_.parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    std::string problem;
    if (name.rfind(prefix, 0) == 0 && entry.is_directory() && !entry.is_symlink() &&
        fs::exists(entry.path() / kResultsMarker) &&
        (marker_files(entry.path(), problem), problem.empty()))
      fs::remove_all(entry.path(), ec);
  }
}

void ResultsFolder::commit() {
  write_marker(staging_, true, files_under(staging_));
  std::error_code ec;
  if (!replaces_) {
    fs::rename(staging_, folder_, ec);  // replaces an empty folder
    if (ec)
      throw Error(fmt::format("cannot move results from {} to {}: {}", staging_.string(),
                              folder_.string(), ec.message()));
    committed_ = true;
    return;
  }
  replace_existing();
  committed_ = true;
}

// The user's files (and folders, empty ones included) from the earlier folder, now at `aside`,
// into the new one. A file whose name the new run wrote with the same bytes stays aside.
void ResultsFolder::carry_over(const fs::path& aside, const std::vector<std::string>& files) {
  std::set<fs::path> kvlab_folders;  // folders that hold what the earlier run wrote
  for (const std::string& file : earlier_files_)
    for (fs::path p = fs::path(file).parent_path(); !p.empty(); p = p.parent_path())
      kvlab_folders.insert(p);
  std::error_code ec;
  for (const auto& entry : fs::recursive_directory_iterator(aside, ec)) {
    const fs::path relative = fs::relative(entry.path(), aside);
    if (entry.is_directory() && !entry.is_symlink() && !kvlab_folders.contains(relative))
      fs::create_directories(folder_ / relative, ec);
  }
  for (const std::string& file : files) {
    if (fs::exists(folder_ / file)) continue;  // the same bytes: the new copy stands for it
    fs::create_directories((folder_ / file).parent_path(), ec);
    fs::rename(aside / file, folder_ / file, ec);
    if (!ec) notes_.push_back(fmt::format("kept {} (not written by kvlab)", file));
  }
}

// The earlier kvlab folder goes aside, the new one into place; what in the earlier folder is
// not kvlab's (or is an input) comes over; kvlab's own files are then deleted.
void ResultsFolder::replace_existing() {
  auto is_input = [&](const fs::path& path) {
    std::error_code ec;
    for (const auto& input : inputs_)
      if (fs::equivalent(input, path, ec)) return true;
    return false;
  };
  std::vector<std::string> carried;
  for (const std::string& file : files_under(folder_))
    if (!earlier_files_.contains(file) || is_input(folder_ / file)) carried.push_back(file);
  for (const std::string& file : carried)
    if (fs::exists(staging_ / file) && !same_bytes(folder_ / file, staging_ / file)) {
      keep_staging_ = true;
      throw Error(fmt::format(
          "results folder {} holds {}, which kvlab did not write, and this run wrote a file of "
          "that name: move it and run again; nothing in {} was changed, and this run's results "
          "are in {}",
          folder_.string(), file, folder_.string(), staging_.string()));
    }
  const fs::path aside = folder_.parent_path() / fmt::format(".{}.kvlab-replaced-{}",
                                                             folder_.filename().string(), getpid());
  std::error_code ec;
  fs::rename(folder_, aside, ec);
  if (ec)
    throw Error(fmt::format("cannot move the earlier results folder {} aside: {}", folder_.string(),
                            ec.message()));
  fs::rename(staging_, folder_, ec);
  if (ec) {
    std::error_code back;
    fs::rename(aside, folder_, back);
    throw Error(fmt::format("cannot move results from {} to {}: {}", staging_.string(),
                            folder_.string(), ec.message()));
  }
  carry_over(aside, carried);
  const std::set<std::string> kept(carried.begin(), carried.end());
  for (const std::string& file : earlier_files_)
    if (!kept.contains(file)) fs::remove(aside / file, ec);
  fs::remove(aside / kResultsMarker, ec);
  std::vector<fs::path> folders;  // deepest first, so each is empty when its turn comes
  for (const auto& entry : fs::recursive_directory_iterator(aside, ec))
    if (entry.is_directory() && !entry.is_symlink()) folders.push_back(entry.path());
  std::sort(folders.rbegin(), folders.rend());
  for (const auto& folder : folders)
    if (fs::is_empty(folder, ec)) fs::remove(folder, ec);  // the user's were made anew
  if (fs::is_empty(aside, ec))
    fs::remove(aside, ec);
  else
    notes_.push_back(fmt::format("what could not be carried over from the earlier folder is in {}",
                                 aside.string()));
}

}  // namespace kvlab
