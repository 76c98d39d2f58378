#pragma once
// A results folder that cannot eat user files. kvlab writes a run into a staging folder beside
// the results folder and moves it into place only when every file is written; the folder holds
// a marker (kResultsMarker) that lists each file kvlab wrote. `--force` replaces only a folder
// that has the marker, deletes only the files it lists, and carries every other file over; a
// lock beside the folder lets one writer at a time in.
#include <filesystem>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/error.hpp"

namespace kvlab {

// The marker: {"kvlab_results": 1, "complete": bool, "files": [relative paths]}.
inline constexpr const char* kResultsMarker = ".kvlab-results.json";

// A write that did not reach the disk (full disk, quota, permissions): the whole job stops with
// it, not one run of a sweep.
class WriteError : public Error {
 public:
  using Error::Error;
};

// Writes `contents` to `path` (created or truncated); throws WriteError with the system's reason
// when any byte does not reach the file (write and close are both checked).
void write_file(const std::filesystem::path& path, std::string_view contents);

// Lists `file` (relative to `folder`, written by kvlab there after the run: kvlab view's page) in
// the folder's marker, so that `--force` replaces it with the rest; false, changing nothing,
// when the folder has no marker kvlab wrote.
bool add_to_marker(const std::filesystem::path& folder, const std::string& file);
// Whether the folder's marker lists `file` as kvlab wrote it (unchanged since).
bool marker_lists(const std::filesystem::path& folder, const std::string& file);

// The same, in parts: a file written as it is made (a whole-trace replay's steps.csv is 150 MB,
// whose one buffer would cost as much in page faults and copies as its writing). Each write and
// the close are checked; a file left unclosed is closed unchecked (an error is on its way).
class FileWriter {
 public:
  explicit FileWriter(const std::filesystem::path& path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void write(std::string_view contents);
  void close();

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::size_t written_ = 0;
};

class ResultsFolder {
 public:
  struct Options {
    bool force = false;  // replace an earlier kvlab run's files
    // Files the run reads (the experiment file): never deleted, even from a folder kvlab wrote.
    std::vector<std::filesystem::path> inputs;
  };

  // Takes the folder's lock, checks what is there now (nothing, an empty folder, or a kvlab
  // folder with --force) and makes the staging folder. Throws kvlab::Error naming the folder and
  // why otherwise; nothing is touched then.
  ResultsFolder(const std::filesystem::path& folder, const Options& options);
  // Not committed: the staging folder (only kvlab's files) is removed. The lock is released.
  ~ResultsFolder();
  ResultsFolder(const ResultsFolder&) = delete;
  ResultsFolder& operator=(const ResultsFolder&) = delete;

  const std::filesystem::path& path() const { return folder_; }
  const std::filesystem::path& staging() const { return staging_; }  // write everything here

  // Seals the marker and moves the staging folder into place. An earlier kvlab folder's files
  // are deleted; anything else in it (user files, the input being run) is carried over. Throws
  // kvlab::Error when a file of the user's has the name of a new one (the new results stay in the
  // staging folder, named in the message) or a rename fails (the earlier folder is put back).
  void commit();
  // After commit: what the user should know (files carried over, anything left aside).
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  void check_existing(const Options& options);
  void remove_stale_staging() const;
  void replace_existing();
  void carry_over(const std::filesystem::path& aside, const std::vector<std::string>& files);

  std::filesystem::path folder_, staging_;
  std::filesystem::path lock_path_;
  int lock_fd_ = -1;
  bool replaces_ = false;  // folder_ holds an earlier kvlab run (to be replaced on commit)
  bool committed_ = false, keep_staging_ = false;
  std::set<std::string> earlier_files_;  // what the earlier marker lists, still unchanged
  std::vector<std::filesystem::path> inputs_;
  std::vector<std::string> notes_;
};

}  // namespace kvlab
