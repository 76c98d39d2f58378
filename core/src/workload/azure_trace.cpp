// The Azure LLM inference trace 2023 (Splitwise): TIMESTAMP,ContextTokens,GeneratedTokens a
// request, replayed with random prompt ids and each output forced to its length.
#include "kvlab/workload/real_workloads.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "../csv_fields.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "replay.hpp"
#include "sources.hpp"

namespace kvlab {
namespace {

struct AzureRow {
  double time_s = 0;  // seconds since the epoch
  std::int64_t prompt = 0;
  std::int64_t output = 0;
};

// "2023-11-16 18:15:46.6805900" -> seconds since 1970-01-01 (UTC; the trace has no zone).
double parse_timestamp(std::string_view text) {
  if (text.size() < 19 || text[4] != '-' || text[7] != '-' || text[10] != ' ' || text[13] != ':' ||
      text[16] != ':')
    throw Error(fmt::format("TIMESTAMP \"{}\" is not YYYY-MM-DD HH:MM:SS[.fraction]", text));
  using namespace std::chrono;
  const year_month_day date{year(parse_number<int>(text.substr(0, 4), "year")),
                            month(parse_number<unsigned>(text.substr(5, 2), "month")),
                            day(parse_number<unsigned>(text.substr(8, 2), "day"))};
  const int hours = parse_number<int>(text.substr(11, 2), "hour");
  const int minutes = parse_number<int>(text.substr(14, 2), "minute");
  const double seconds = parse_number<double>(text.substr(17), "second");
  if (!date.ok() || hours > 23 || minutes > 59 || !(seconds >= 0 && seconds < 61))
    throw Error(fmt::format("TIMESTAMP \"{}\" is not a valid date and time", text));
  const auto days = sys_days(date).time_since_epoch().count();
  return static_cast<double>(days) * 86400.0 + hours * 3600.0 + minutes * 60.0 + seconds;
}

std::vector<AzureRow> read_azure_rows(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(
        fmt::format("cannot read Azure trace {}{}", path.string(), data_set_hint(path.string())));
  std::vector<AzureRow> rows;
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line_number == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);  // a UTF-8 BOM
    if (line.empty()) continue;
    const auto cells = csv_cells(line);
    try {
      if (line_number == 1) {
        if (cells != std::vector<std::string>{"TIMESTAMP", "ContextTokens", "GeneratedTokens"})
          throw Error("the header must be TIMESTAMP,ContextTokens,GeneratedTokens");
        continue;
      }
      if (cells.size() != 3) throw Error(fmt::format("{} cells, expected 3", cells.size()));
      AzureRow row{parse_timestamp(cells[0]), parse_number<std::int64_t>(cells[1], "ContextTokens"),
                   parse_number<std::int64_t>(cells[2], "GeneratedTokens")};
      if (row.prompt < 1 || row.prompt > kMaxRequestTokens || row.output < 1 ||
          row.output > kMaxRequestTokens)
        throw Error(fmt::format("token counts must be in [1, {}], got {} and {}", kMaxRequestTokens,
                                row.prompt, row.output));
      rows.push_back(row);
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {}", path.string(), line_number, e.what()));
    }
  }
  if (line_number == 0) throw Error(fmt::format("Azure trace {} is empty", path.string()));
  std::stable_sort(rows.begin(), rows.end(),
                   [](const AzureRow& a, const AzureRow& b) { return a.time_s < b.time_s; });
  return rows;
}

std::vector<std::int32_t> random_ids(std::int64_t n, std::int64_t vocab, std::mt19937_64& rng) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return ids;
}

}  // namespace

RealWorkload load_azure_trace(const std::filesystem::path& path, const AzureTraceOptions& o) {
  detail::check_replay_options("Azure trace", o.start_s, o.duration_s, o.rate_scale, o.max_requests,
                               o.context, o.vocab_size);
  const std::vector<AzureRow> rows = read_azure_rows(path);
  RealWorkload out;
  if (rows.empty()) throw Error(fmt::format("Azure trace {} has no requests", path.string()));
  const double first = rows.front().time_s + o.start_s;
  std::mt19937_64 rng(o.seed);
  std::int64_t prompt_tokens = 0;
  for (const AzureRow& row : rows) {
    const double offset = row.time_s - first;
    if (offset < 0) continue;
    if (o.duration_s > 0 && offset >= o.duration_s) break;
    if (o.max_requests > 0 && static_cast<std::int64_t>(out.requests.size()) >= o.max_requests)
      break;
    std::int64_t prompt = row.prompt, output = row.output;
    out.clipped += detail::clip_to_context(prompt, output, o.context);
    prompt_tokens += prompt;
    if (prompt_tokens > (std::int64_t{1} << 31))
      throw Error("the Azure trace window holds more than 2^31 prompt tokens: use a shorter one");
    WorkloadRequest r;
    r.id = static_cast<std::int64_t>(out.requests.size());
    r.arrival_s = offset / o.rate_scale;
    r.prompt = random_ids(prompt, o.vocab_size, rng);
    r.output_tokens = output;
    r.sampling = o.sampling;
    r.sampling.max_tokens = static_cast<std::int32_t>(output);
    r.sampling.ignore_eos = true;
    r.sampling.seed = o.seed + static_cast<std::uint64_t>(r.id);
    out.requests.push_back(std::move(r));
  }
  if (out.requests.empty())
    throw Error(fmt::format("Azure trace {}: no request in the window [{}, {}) s", path.string(),
                            o.start_s, o.duration_s > 0 ? o.start_s + o.duration_s : INFINITY));
  out.description = fmt::format(
      "Azure trace {}: {} requests over {:.1f} s (rate x{}), {} clipped to the {}-token context",
      path.filename().string(), out.requests.size(), out.requests.back().arrival_s, o.rate_scale,
      out.clipped, o.context);
  return out;
}

namespace detail {

// Its header row names its three columns.
bool is_azure_trace(const std::filesystem::path& file) {
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return line == "TIMESTAMP,ContextTokens,GeneratedTokens";
  }
  return false;
}

RealWorkload load_azure_source(const WorkloadInput& input) {
  if (input.window.length_scale != 1.0)
    throw Error(
        fmt::format("Azure trace {}: length_scale is a Mooncake trace's; the Azure "
                    "trace replays its lengths as they are",
                    input.file.string()));
  return load_azure_trace(input.file, replay_options<AzureTraceOptions>(input));
}

}  // namespace detail

}  // namespace kvlab
