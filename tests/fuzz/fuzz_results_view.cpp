// libFuzzer: kvlab view's readers of a results folder (runs.json, steps.csv, requests.csv,
// events.jsonl, frames.jsonl, config.toml). The input is split at NUL bytes into those files of
// one run; the folder reads as the page's data or is a kvlab::Error, and data that reads makes
// a page whose data element no text closes early.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/results_view.hpp"

// The page's template, reduced to its data slot (the real page is embedded by the build).
namespace kvlab::view_assets {
std::string page_html();
std::string view_css();
std::string view_js();
std::string chart_js();
std::string page_html() {
  return "<script>@@DATA@@</script>@@LIVE@@@@CSS@@@@CHART_JS@@@@VIEW_JS@@";
}
std::string view_css() {
  return "";
}
std::string view_js() {
  return "";
}
std::string chart_js() {
  return "";
}
}  // namespace kvlab::view_assets

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace fs = std::filesystem;
  const fs::path folder =
      fs::temp_directory_path() / ("kvlab_fuzz_view_" + std::to_string(getpid()));
  fs::create_directories(folder / "r");
  const char* files[] = {"runs.json",      "r/steps.csv",    "r/requests.csv",
                         "r/events.jsonl", "r/frames.jsonl", "r/config.toml"};
  std::string_view rest = kvlab::fuzz::as_text(data, size);
  for (const char* name : files) {
    const std::size_t end = rest.find('\0');
    std::ofstream(folder / name, std::ios::binary | std::ios::trunc) << rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
  }
  try {
    const nlohmann::json view = kvlab::results_view_data(folder);
    const std::string page = kvlab::results_view_html(view);
    if (page.find("</script>") != page.rfind("</script>")) std::abort();  // closed early
  } catch (const kvlab::Error&) {
  }
  return 0;
}
