#include "cli_common.hpp"

#include <unistd.h>

#include <fmt/format.h>

#include <toml++/toml.h>
#include <charconv>
#include <fstream>
#include <sstream>

#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/model/mapped_file.hpp"
#include "kvlab/suggest.hpp"
#include "kvlab_commit.hpp"

namespace kvlab::cli {

std::vector<std::int32_t> parse_token_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::size_t start = 0;
  int index = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    std::string item = text.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    std::int32_t value = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size())
      throw Error(fmt::format("bad token id list \"{}\": item {} (\"{}\") is not an integer", text,
                              index, item));
    if (value < 0)
      throw Error(
          fmt::format("bad token id list \"{}\": item {} ({}) is negative", text, index, value));
    ids.push_back(value);
    start = end + 1;
    ++index;
  }
  return ids;
}

// "block_size=16" -> {"block_size", 16}: integers, reals, booleans and quoted strings as TOML
// reads them; anything TOML cannot read is a string.
std::pair<std::string, ParamValue> parse_param(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error(fmt::format("plugin parameter \"{}\": expected key=value", text));
  const std::string key = text.substr(0, eq), value = text.substr(eq + 1);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    return {key, value};
  }
  const toml::node& node = *parsed.get("v");
  if (auto i = node.value_exact<std::int64_t>()) return {key, *i};
  if (auto d = node.value_exact<double>()) return {key, *d};
  if (auto b = node.value_exact<bool>()) return {key, *b};
  if (auto s = node.value_exact<std::string>()) return {key, *s};
  return {key, value};
}

void print_progress_line(const std::string& line, bool last) {
  static const bool tty = isatty(STDERR_FILENO) != 0;
  if (tty)
    fmt::print(stderr, "\r\033[K{}{}", line, last ? "\n" : "");
  else
    fmt::print(stderr, "{}\n", line);
}

std::string eta_text(double done, double total, std::chrono::steady_clock::time_point start) {
  if (done <= 0) return "?";
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return fmt::format("{:.0f}s", elapsed / done * std::max(0.0, total - done));
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[unit]);
}

std::string read_experiment_text(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw Error(fmt::format("cannot read {}", file));
  return text.str();
}

void finish_results(ResultsFolder& folder, const SweepReport& report, const std::string& file,
                    const std::string& experiment_text, const CommandLineChanges& changes,
                    std::size_t runs, int ranks) {
  const ManifestInfo info{file,         experiment_text,       changes, KVLAB_VERSION,
                          KVLAB_COMMIT, machine_description(), ranks};
  write_results_index(folder.staging(), report, info, runs);
  folder.commit();
  for (const std::string& note : folder.notes()) fmt::print(stderr, "kvlab: {}\n", note);
  fmt::print("\nresults: {}\nstep by step in a browser: kvlab view {}\n", folder.path().string(),
             folder.path().string());
}

std::ofstream open_output_file(const std::string& path) {
  if (const auto folder = std::filesystem::path(path).parent_path(); !folder.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) throw Error(fmt::format("cannot create {}: {}", folder.string(), ec.message()));
  }
  std::ofstream file(path, std::ios::trunc);
  if (!file) throw Error(fmt::format("cannot write {}", path));
  return file;
}

void write_profile_file(const std::string& path, const std::string& header,
                        const HardwareProfile& profile) {
  std::ofstream file = open_output_file(path);
  file << header << hardware_profile_to_toml(profile);
  if (!file) throw Error(fmt::format("cannot write {}", path));
  fmt::print("wrote {}\n", path);
}

std::string read_text(const std::string& path) {
  if (!std::filesystem::is_regular_file(path) && !data_set_hint(path).empty())
    throw Error(fmt::format("cannot open text file {}{}", path, data_set_hint(path)));
  const MappedFile file(path, "text");
  const auto bytes = file.bytes();
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace kvlab::cli
