// kvlab view RESULTS_DIR [--out FILE.html] [--force]: the results folder as one self-contained
// HTML page that replays its runs step by step (kvlab/experiment/results_view.hpp).
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/results_view.hpp"

namespace kvlab::cli {

namespace {

namespace fs = std::filesystem;

struct ViewArgs {
  std::string folder, out;
  bool force = false;
};

// A path with its folder resolved and its last name kept (a symlink there is named, not
// followed: the page replaces the link, never what it points to).
fs::path resolved_folder(const fs::path& path) {
  const fs::path absolute = fs::absolute(path).lexically_normal();
  return fs::weakly_canonical(absolute.parent_path()) / absolute.filename();
}

// The page may replace: nothing, a file with --force, or the folder's own view.html as kvlab
// wrote it. Never one of the files the page was made from, even with --force.
void check_output(const fs::path& out, const fs::path& folder, const std::vector<fs::path>& inputs,
                  bool force) {
  const fs::path target = resolved_folder(out);
  for (const fs::path& input : inputs)
    if (resolved_folder(input) == target)
      throw Error(fmt::format(
          "kvlab view: --out {} is one of the results folder's own files, which the page is made "
          "from: name another file",
          out.string()));
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(out, ec);
  if (status.type() == fs::file_type::not_found) return;
  if (fs::is_directory(status))
    throw Error(fmt::format("kvlab view: --out {} is a folder: name a file", out.string()));
  const bool own_page = fs::is_regular_file(status) && out.filename() == "view.html" &&
                        target.parent_path() == fs::weakly_canonical(folder) &&
                        marker_lists(folder, "view.html");
  if (!force && !own_page)
    throw Error(
        fmt::format("kvlab view: {} exists: pass --force to replace it, or --out another "
                    "file",
                    out.string()));
}

// The page into a new file beside `out`, renamed over it when whole: a reader never sees half a
// page, and a symlink at `out` is replaced itself.
void write_atomically(const fs::path& out, const std::string& page) {
  const fs::path temporary =
      out.parent_path() / fmt::format(".{}.kvlab-tmp-{}", out.filename().string(), getpid());
  const int fd =
      ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(
        fmt::format("kvlab view: cannot write {}: {}", temporary.string(), std::strerror(errno)));
  std::size_t written = 0;
  while (written < page.size()) {
    const ssize_t n = ::write(fd, page.data() + written, page.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<std::size_t>(n);
  }
  const int error = written < page.size() ? errno : 0;
  if (::close(fd) != 0 || error != 0 || ::rename(temporary.c_str(), out.c_str()) != 0) {
    const std::string reason = std::strerror(error != 0 ? error : errno);
    ::unlink(temporary.c_str());
    throw Error(fmt::format("kvlab view: cannot write {}: {}", out.string(), reason));
  }
}

void write_view(const ViewArgs& args) {
  const fs::path folder = args.folder;
  const fs::path out = args.out.empty() ? folder / "view.html" : fs::path(args.out);
  std::vector<fs::path> inputs;
  ResultsViewOptions options;
  options.files_read = &inputs;
  const std::string page = results_view_html(results_view_data(folder, options));
  check_output(out, folder, inputs, args.force);
  write_atomically(out, page);
  // Inside the results folder: listed as kvlab's, so that kvlab run --force replaces it too.
  if (resolved_folder(out).parent_path() == fs::weakly_canonical(folder))
    (void)add_to_marker(folder, out.filename().string());
  fmt::print("{} ({:.1f} MB): open it in a browser (no network needed)\n", out.string(),
             static_cast<double>(page.size()) / 1e6);
}

}  // namespace

void register_view(CLI::App& app) {
  auto args = std::make_shared<ViewArgs>();
  auto* sub = app.add_subcommand(
      "view",
      "Write a results folder as one HTML page that replays every step: the batch, the KV pool "
      "block by block, each request's lane, two runs side by side");
  sub->add_option("results", args->folder, "a results folder that kvlab run wrote")
      ->required()
      ->check(CLI::ExistingDirectory);
  sub->add_option("--out", args->out,
                  "the page to write (default: RESULTS/view.html, replaced when kvlab wrote it)");
  sub->add_flag("--force", args->force, "replace an existing file at --out");
  sub->callback([args]() { write_view(*args); });
}

}  // namespace kvlab::cli
