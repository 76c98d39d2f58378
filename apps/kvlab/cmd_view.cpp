// kvlab view RESULTS_DIR [--out FILE.html]: the results folder as one self-contained HTML page
// that replays its runs step by step (kvlab/experiment/results_view.hpp).
#include <fmt/format.h>

#include <fstream>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/results_view.hpp"

namespace kvlab::cli {

namespace {

struct ViewArgs {
  std::string folder, out;
};

void write_view(const ViewArgs& args) {
  const std::filesystem::path folder = args.folder;
  const std::filesystem::path out =
      args.out.empty() ? folder / "view.html" : std::filesystem::path(args.out);
  const std::string page = results_view_html(results_view_data(folder));
  std::ofstream file(out, std::ios::binary);
  file << page;
  file.close();
  if (!file) throw Error(fmt::format("kvlab view: cannot write {}", out.string()));
  // Inside the results folder: listed as kvlab's, so that kvlab run --force replaces it too.
  if (std::filesystem::weakly_canonical(out).parent_path() ==
      std::filesystem::weakly_canonical(folder))
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
  sub->add_option("--out", args->out, "the page to write (default: RESULTS/view.html)");
  sub->callback([args]() { write_view(*args); });
}

}  // namespace kvlab::cli
