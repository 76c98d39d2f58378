// kvlab view's data: a results folder's runs as the page's columns (experiment/view/view.js
// reads them), and the page itself around them.
#include "kvlab/experiment/results_view.hpp"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "kvlab/error.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/json_limits.hpp"

namespace kvlab {
namespace view_assets {  // the page's files (cmake/embed_text.cmake)
std::string page_html();
std::string view_css();
std::string view_js();
std::string chart_js();
}  // namespace view_assets

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The columns of steps.csv the page draws, under the page's names.
constexpr std::pair<const char*, const char*> kStepColumns[] = {
    {"step", "step"},
    {"start_s", "t"},
    {"duration_s", "dur"},
    {"batch", "batch"},
    {"prefill_tokens", "prefill"},
    {"decode_tokens", "decode"},
    {"preempted", "preempted"},
    {"waiting", "waiting"},
    {"running", "running"},
    {"kv_capacity", "capacity"},
    {"kv_used", "used"},
    {"kv_reserved_unused", "reserved"},
    {"kv_last_block_slack", "slack"},
    {"kv_free", "free"},
    {"kv_cached_free", "cached"},
    {"padding_slots", "padding"},
};

// requests.csv's columns the lanes need (not the token times: a long run's largest column).
constexpr std::pair<const char*, const char*> kRequestColumns[] = {
    {"id", "id"},
    {"arrival_s", "arrival"},
    {"first_scheduled_s", "scheduled"},
    {"first_token_s", "first_token"},
    {"finish_s", "finish"},
    {"prompt_tokens", "prompt"},
    {"output_tokens", "output"},
    {"ttft_s", "ttft"},
    {"tpot_s", "tpot"},
    {"preemptions", "preemptions"},
    {"rejected", "rejected"},
};

// What a results folder's files may be: a JSON line or file this long and this deep (kvlab's
// own nest < 10 deep), a CSV line this long.
constexpr std::size_t kMaxLineBytes = std::size_t{64} << 20;
constexpr JsonLimits kJsonLimits{std::size_t{256} << 20, 32};

// Whether anything (a file, a link, a dangling link) is at `path`.
bool present(const fs::path& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() != fs::file_type::not_found;
}

// The folder's own files only: a symlink (out of the folder, to a credentials file the page would
// embed), a device or a fifo is refused, never followed.
void check_own_file(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(path, ec);
  if (ec || status.type() == fs::file_type::not_found)
    throw Error(fmt::format("kvlab view: cannot open {}", path.string()));
  if (!fs::is_regular_file(status))
    throw Error(
        fmt::format("kvlab view: {} is {}, not a regular file: kvlab view reads only the "
                    "results folder's own files",
                    path.string(), fs::is_symlink(status) ? "a symbolic link" : "not a file"));
}

class LineReader {
 public:
  explicit LineReader(fs::path path) : path_(std::move(path)) {
    check_own_file(path_);
    in_.open(path_, std::ios::binary);
    if (!in_) throw Error(fmt::format("kvlab view: cannot open {}", path_.string()));
  }
  bool next(std::string& line) {
    if (!std::getline(in_, line)) return false;
    ++number_;
    if (line.size() > kMaxLineBytes)
      fail(fmt::format("{} bytes on one line, past the limit of {}", line.size(), kMaxLineBytes));
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return true;
  }
  // A JSON line: an object within kJsonLimits, else an error naming the line.
  json next_json_object(const std::string& line, const char* what) {
    if (const std::string problem = json_limit_problem(line, kJsonLimits); !problem.empty())
      fail(problem);
    json value = json::parse(line, nullptr, false);
    if (value.is_discarded() || !value.is_object()) fail(what);
    return value;
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("kvlab view: {} line {}: {}", path_.string(), number_, what));
  }

 private:
  fs::path path_;
  std::ifstream in_;
  std::int64_t number_ = 0;
};

// A cell as a number: empty (not reached: a rejected request's first token) is null.
json number_cell(const std::string& cell, const LineReader& reader, const char* column) {
  if (cell.empty()) return nullptr;
  double value = 0;
  const auto [end, error] = std::from_chars(cell.data(), cell.data() + cell.size(), value);
  if (error != std::errc() || end != cell.data() + cell.size())
    reader.fail(fmt::format("{} is \"{}\", not a number", column, cell));
  return value;
}

// Named columns of a CSV file as arrays; `text_columns` are kept as strings.
json read_columns(const fs::path& path, std::span<const std::pair<const char*, const char*>> wanted,
                  std::span<const std::pair<const char*, const char*>> text_columns = {},
                  std::span<const std::pair<const char*, const char*>> optional = {}) {
  LineReader reader(path);
  std::string line;
  if (!reader.next(line)) reader.fail("empty: no header");
  const std::vector<std::string> header = csv_row_cells(line);
  std::vector<std::tuple<std::size_t, const char*, const char*, bool>> picked;
  auto pick = [&](std::span<const std::pair<const char*, const char*>> columns, bool text) {
    for (const auto& [name, key] : columns) {
      const auto at = std::find(header.begin(), header.end(), name);
      if (at == header.end()) reader.fail(fmt::format("no column {}", name));
      picked.emplace_back(at - header.begin(), name, key, text);
    }
  };
  pick(wanted, false);
  pick(text_columns, true);
  for (const auto& column : optional)
    if (std::find(header.begin(), header.end(), column.first) != header.end())
      pick(std::span(&column, 1), false);
  json columns = json::object();
  for (const auto& [index, name, key, text] : picked) columns[key] = json::array();
  while (reader.next(line)) {
    if (line.empty()) continue;
    // A quoted cell may hold a line break (RFC 4180): the row goes on to the next line.
    for (std::string more; std::count(line.begin(), line.end(), '"') % 2 == 1;) {
      if (!reader.next(more)) reader.fail("a quote left open at the end of the file");
      (line += '\n') += more;
      if (line.size() > kMaxLineBytes) reader.fail("a row past the line limit");
    }
    const std::vector<std::string> cells = csv_row_cells(line);
    if (cells.size() != header.size())
      reader.fail(fmt::format("{} cells, the header has {}", cells.size(), header.size()));
    for (const auto& [index, name, key, text] : picked)
      columns[key].push_back(text ? json(cells[index]) : number_cell(cells[index], reader, name));
  }
  return columns;
}

// events.jsonl as [step, kind, request, reason, replica] rows; past `most` events, the defers
// summed per step and reason as [step, "defer", -count, reason, -1].
json read_events(const fs::path& path, std::int64_t most) {
  LineReader reader(path);
  std::vector<json> events;
  std::string line;
  while (reader.next(line)) {
    if (line.empty()) continue;
    constexpr const char* kNotEvent = "not an event (a JSON object with step and event)";
    json e = reader.next_json_object(line, kNotEvent);
    if (!e.contains("step") || !e.contains("event")) reader.fail(kNotEvent);
    events.push_back(json::array({e["step"], e["event"], e.value("request", -1),
                                  e.value("reason", std::string()), e.value("replica", -1)}));
  }
  if (static_cast<std::int64_t>(events.size()) <= most) return events;
  std::map<std::pair<std::int64_t, std::string>, std::int64_t> defers;
  json kept = json::array();
  for (json& e : events) {
    if (e[1] == "defer")
      ++defers[{e[0].get<std::int64_t>(), e[3].get<std::string>()}];
    else
      kept.push_back(std::move(e));
  }
  for (const auto& [key, count] : defers)
    kept.push_back(json::array({key.first, "defer", -count, key.second, -1}));
  return kept;
}

json read_frames(const fs::path& path) {
  json frames = json::array();
  if (!present(path)) return frames;
  LineReader reader(path);
  std::string line;
  while (reader.next(line)) {
    if (line.empty()) continue;
    constexpr const char* kNotFrame = "not a step frame (a JSON object with step, batch and runs)";
    json f = reader.next_json_object(line, kNotFrame);
    if (!f.contains("step") || !f.contains("runs") || !f["runs"].is_array() || !f.contains("batch"))
      reader.fail(kNotFrame);
    frames.push_back(std::move(f));
  }
  return frames;
}

// The pool's block size from the run's config.toml (kv_cache.params.block_size), else 0.
std::int64_t block_size(const fs::path& config) {
  if (!present(config)) return 0;
  check_own_file(config);
  try {
    const toml::table t = toml::parse_file(config.string());
    return t["kv_cache"]["params"]["block_size"].value_or<std::int64_t>(0);
  } catch (const toml::parse_error&) {
    return 0;
  }
}

json read_json_file(const fs::path& path) {
  check_own_file(path);
  std::error_code ec;
  if (const auto bytes = fs::file_size(path, ec); !ec && bytes > kJsonLimits.max_bytes)
    throw Error(fmt::format("kvlab view: {} is {} bytes, past the limit of {}", path.string(),
                            bytes, kJsonLimits.max_bytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("kvlab view: cannot open {}", path.string()));
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (const std::string problem = json_limit_problem(text, kJsonLimits); !problem.empty())
    throw Error(fmt::format("kvlab view: {} is {}", path.string(), problem));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) throw Error(fmt::format("kvlab view: {} is not JSON", path.string()));
  return j;
}

// The summary numbers the page shows (each a number, or left out).
json summary_numbers(const json& summary) {
  json kept = json::object();
  if (!summary.is_object()) return kept;
  for (const char* latency : {"ttft_s", "tpot_s"}) {
    const auto it = summary.find(latency);
    if (it != summary.end() && it->is_object() && it->contains("mean") && (*it)["mean"].is_number())
      kept[latency] = {{"mean", (*it)["mean"]}};
  }
  if (const auto it = summary.find("output_tokens_per_s"); it != summary.end() && it->is_number())
    kept["output_tokens_per_s"] = *it;
  return kept;
}

// Rows of each column of `columns` where keep(row) holds.
template <typename Keep>
json rows_where(const json& columns, std::size_t rows, Keep keep) {
  json kept = json::object();
  for (const auto& [key, column] : columns.items()) kept[key] = json::array();
  for (std::size_t i = 0; i < rows; ++i)
    if (keep(i))
      for (const auto& [key, column] : columns.items()) kept[key].push_back(column[i]);
  return kept;
}

// A cluster's run as a run per replica: its steps, events and frames, and the requests routed
// to it (a disaggregated request is on its prefill and its decode replica).
void add_replica_runs(json& runs, const json& run) {
  const json& replica_of_step = run["steps"]["replica"];
  std::set<std::int64_t> replicas;
  for (const json& r : replica_of_step) replicas.insert(r.get<std::int64_t>());
  for (const std::int64_t r : replicas) {
    json part = {{"name", fmt::format("{} / replica {}", run["name"].get<std::string>(), r)},
                 {"dir", run["dir"]},
                 {"block_size", run["block_size"]}};
    part["steps"] = rows_where(run["steps"], replica_of_step.size(), [&](std::size_t i) {
      return replica_of_step[i].get<std::int64_t>() == r;
    });
    std::set<std::int64_t> routed;
    part["events"] = json::array();
    for (const json& e : run["events"]) {
      if (e[4] != r) continue;
      part["events"].push_back(e);
      if (e[1] == "route") routed.insert(e[2].get<std::int64_t>());
    }
    const json& ids = run["requests"]["id"];
    part["requests"] = rows_where(run["requests"], ids.size(), [&](std::size_t i) {
      return routed.contains(ids[i].get<std::int64_t>());
    });
    part["frames"] = json::array();
    for (const json& f : run["frames"])
      if (f.value("replica", -1) == r) part["frames"].push_back(f);
    if (run.contains("summary")) part["summary"] = run["summary"];
    part["summary_of"] = "the cluster's";  // summary.json is the whole run's
    runs.push_back(std::move(part));
  }
}

// One run folder's data, appended to `runs` (a cluster's: a run per replica).
void add_run(json& runs, const fs::path& dir, const std::string& label,
             const ResultsViewOptions& options) {
  constexpr std::pair<const char*, const char*> kReason[] = {{"reject_reason", "reason"}};
  constexpr std::pair<const char*, const char*> kReplica[] = {{"replica", "replica"}};
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(dir, ec)))
    throw Error(
        fmt::format("kvlab view: {} is not a folder of the results folder (a symbolic "
                    "link is not followed)",
                    dir.string()));
  json run = {{"name", label}, {"dir", dir.filename().string()}};
  run["steps"] = read_columns(dir / "steps.csv", kStepColumns, {}, kReplica);
  run["requests"] = read_columns(dir / "requests.csv", kRequestColumns, kReason);
  run["events"] = read_events(dir / "events.jsonl", options.most_events);
  run["frames"] = read_frames(dir / "frames.jsonl");
  run["block_size"] = block_size(dir / "config.toml");
  if (options.files_read)
    for (const char* name : {"steps.csv", "requests.csv", "events.jsonl", "frames.jsonl",
                             "config.toml", "summary.json"})
      options.files_read->push_back(dir / name);
  if (present(dir / "summary.json"))
    run["summary"] = summary_numbers(read_json_file(dir / "summary.json"));
  if (run["steps"].contains("replica"))
    add_replica_runs(runs, run);
  else
    runs.push_back(std::move(run));
}

}  // namespace

std::vector<std::string> csv_row_cells(std::string_view line) {
  std::vector<std::string> cells(1);
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted && c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
      cells.back() += '"';
      ++i;
    } else if (c == '"') {
      quoted = !quoted;
    } else if (c == ',' && !quoted) {
      cells.emplace_back();
    } else {
      cells.back() += c;
    }
  }
  if (quoted) throw Error("a CSV row with a quote left open");
  return cells;
}

namespace {

// A JSON object's string member, or "" (no object, no member, not a string).
std::string string_field(const json& object, const char* key) {
  if (!object.is_object()) return {};
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A runs.json entry's run folder: a name inside the results folder, nothing else.
std::string run_dir(const json& run, const fs::path& folder) {
  const std::string dir = string_field(run, "dir");
  if (dir.empty())
    throw Error(fmt::format("kvlab view: {}'s runs.json: a run without its dir", folder.string()));
  if (dir.find('/') != std::string::npos || dir == "." || dir == "..")
    throw Error(fmt::format("kvlab view: runs.json names \"{}\", not a run folder", dir));
  return dir;
}

}  // namespace

std::string csv_field(std::string_view text) {
  if (text.find_first_of(",\"\n\r") == std::string_view::npos) return std::string(text);
  std::string quoted = "\"";
  for (const char c : text) quoted += c == '"' ? std::string_view("\"\"") : std::string_view(&c, 1);
  return quoted + "\"";
}

json results_view_data(const fs::path& folder, const ResultsViewOptions& options) {
  if (!fs::is_directory(folder))
    throw Error(
        fmt::format("kvlab view: {} is not a folder (give a results folder that kvlab "
                    "run wrote)",
                    folder.string()));
  if (!present(folder / "runs.json"))
    throw Error(
        fmt::format("kvlab view: {} has no runs.json: not a results folder kvlab run "
                    "wrote",
                    folder.string()));
  if (options.files_read)
    for (const char* name : {"runs.json", "manifest.json", kResultsMarker})
      options.files_read->push_back(folder / name);
  const json runs = read_json_file(folder / "runs.json");
  if (!runs.is_array() || runs.empty())
    throw Error(fmt::format("kvlab view: {}'s runs.json lists no runs", folder.string()));
  json data = {{"title", folder.filename().string()}, {"runs", json::array()}};
  if (present(folder / "manifest.json")) {
    const std::string file =
        string_field(read_json_file(folder / "manifest.json"), "experiment_file");
    if (!file.empty()) data["experiment_file"] = file;
  }
  for (const json& run : runs) {
    const std::string dir = run_dir(run, folder);
    const std::string label = string_field(run, "label");
    add_run(data["runs"], folder / dir, label.empty() ? dir : label, options);  // "": no sweep
  }
  return data;
}

std::string results_view_html(const json& data, bool live) {
  return results_view_html(data.dump(-1, ' ', false, json::error_handler_t::replace), live);
}

// JSON text safe inside a <script> element: '<', '>' and '&' (and U+2028, U+2029) as \u escapes.
// Outside strings JSON has none of them, so the text parses to the same value, and no "</script>",
// "<!--" or "<script" in a label can end the element or change how the HTML parser reads it.
std::string script_safe_json(std::string_view json_text) {
  std::string out;
  out.reserve(json_text.size());
  for (std::size_t i = 0; i < json_text.size(); ++i) {
    const char c = json_text[i];
    if (c == '<') {
      out += "\\u003c";
    } else if (c == '>') {
      out += "\\u003e";
    } else if (c == '&') {
      out += "\\u0026";
    } else if (c == '\xE2' && i + 2 < json_text.size() && json_text[i + 1] == '\x80' &&
               (json_text[i + 2] == '\xA8' || json_text[i + 2] == '\xA9')) {
      out += json_text[i + 2] == '\xA8' ? "\\u2028" : "\\u2029";
      i += 2;
    } else {
      out += c;
    }
  }
  return out;
}

// The page's Content-Security-Policy nonce: its own scripts and style carry it, so the browser
// runs no other script (an inline handler in injected markup, a remote file): 128 random bits.
std::string script_nonce() {
  constexpr char kDigits[] = "0123456789abcdef";
  std::random_device random;
  std::string nonce;
  for (int i = 0; i < 4; ++i)
    for (std::uint32_t word = random(), k = 0; k < 8; ++k, word >>= 4) nonce += kDigits[word & 15];
  return nonce;
}

std::string results_view_html(std::string payload, bool live) {
  payload = script_safe_json(payload);
  static const std::string page_template = view_assets::page_html();
  static const std::string css = view_assets::view_css(), js = view_assets::view_js(),
                           chart = view_assets::chart_js();
  const std::string nonce = script_nonce();
  const std::map<std::string_view, std::string_view> slots = {
      {"LIVE", live ? "true" : "false"},
      {"NONCE", nonce},
      {"CONNECT", live ? "'self'" : "'none'"},  // the live page polls /ui/data
      {"CSS", css},
      {"DATA", payload},
      {"CHART_JS", chart},
      {"VIEW_JS", js}};
  // The template's @@NAME@@ slots in one pass: no slot's text is searched for slots again.
  std::string page;
  std::size_t from = 0;
  for (std::size_t at = page_template.find("@@"); at != std::string_view::npos;
       at = page_template.find("@@", from)) {
    const std::size_t end = page_template.find("@@", at + 2);
    const auto slot = end == std::string_view::npos
                          ? slots.end()
                          : slots.find(page_template.substr(at + 2, end - at - 2));
    if (slot == slots.end()) throw Error("internal: kvlab view's page has an unknown @@ slot");
    page.append(page_template.substr(from, at - from)).append(slot->second);
    from = end + 2;
  }
  page.append(page_template.substr(from));
  return page;
}

}  // namespace kvlab
