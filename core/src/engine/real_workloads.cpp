#include "kvlab/engine/real_workloads.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "../csv_fields.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "trace_replay.hpp"

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

namespace detail {

void check_replay_options(std::string_view trace, double start_s, double duration_s,
                          double rate_scale, std::int64_t max_requests, std::int64_t context,
                          std::int64_t vocab_size) {
  if (!(start_s >= 0) || !(duration_s >= 0) || !std::isfinite(start_s + duration_s))
    throw Error(fmt::format("{} window: start_s {} and duration_s {} must be >= 0", trace, start_s,
                            duration_s));
  if (!(rate_scale > 0) || !std::isfinite(rate_scale))
    throw Error(fmt::format("{} rate_scale must be > 0, got {}", trace, rate_scale));
  if (max_requests < 0 || context < 0 || context == 1 || vocab_size < 1)
    throw Error(
        fmt::format("{} max_requests and context must be >= 0 (context >= 2), vocab >= 1", trace));
}

nlohmann::json parse_json_object(const std::string& line) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("not valid JSON: {}", e.what()));
  }
  if (!object.is_object()) throw Error("each line must be a JSON object");
  return object;
}

bool clip_to_context(std::int64_t& prompt, std::int64_t& output, std::int64_t context) {
  if (context == 0 || prompt + output <= context) return false;
  prompt = std::min(prompt, context - 1);
  output = std::min(output, context - prompt);
  return true;
}

}  // namespace detail

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

std::vector<std::string> load_prompt_texts(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(
        fmt::format("cannot read prompt set {}{}", path.string(), data_set_hint(path.string())));
  std::vector<std::string> texts;
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto fail = [&](const std::string& why) {
      return Error(fmt::format("{}:{}: {}", path.string(), line_number, why));
    };
    nlohmann::json object;
    try {
      object = detail::parse_json_object(line);
    } catch (const Error& e) {
      throw fail(e.what());
    }
    const nlohmann::json* text = nullptr;
    if (object.contains("turns") && object["turns"].is_array() && !object["turns"].empty())
      text = &object["turns"][0];
    for (const char* key : {"question", "prompt", "text"})
      if (text == nullptr && object.contains(key)) text = &object[key];
    if (text == nullptr || !text->is_string() || text->get<std::string>().empty())
      throw fail("no prompt text (\"turns\"[0], \"question\", \"prompt\" or \"text\")");
    texts.push_back(text->get<std::string>());
  }
  if (texts.empty()) throw Error(fmt::format("prompt set {} holds no prompts", path.string()));
  return texts;
}

RealWorkload prompt_set_workload(
    const std::vector<std::string>& texts,
    const std::function<std::vector<std::int32_t>(const std::string&)>& encode,
    const PromptSetOptions& o) {
  if (texts.empty()) throw Error("the prompt set is empty");
  if (o.requests < 0 || o.max_tokens < 1)
    throw Error(fmt::format("prompt set: requests must be >= 0 and max_tokens >= 1, got {} and {}",
                            o.requests, o.max_tokens));
  const std::int64_t count = o.requests > 0 ? o.requests : static_cast<std::int64_t>(texts.size());
  const std::vector<double> arrivals = arrival_times(o.arrival, count, o.seed);
  RealWorkload out;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::size_t which = static_cast<std::size_t>(i) % texts.size();
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = arrivals[static_cast<std::size_t>(i)];
    r.prompt = encode(texts[which]);
    const auto prompt = static_cast<std::int64_t>(r.prompt.size());
    if (prompt < 1 || (o.context > 0 && prompt >= o.context))
      throw Error(
          fmt::format("prompt {} (\"{:.40}...\") is {} tokens: no room to answer in the "
                      "{}-token context",
                      which, texts[which], prompt, o.context));
    std::int64_t kept_prompt = prompt, cap = o.max_tokens;  // the prompt fits: only cap is cut
    out.clipped += detail::clip_to_context(kept_prompt, cap, o.context);
    r.output_tokens = cap;
    r.sampling = o.sampling;
    r.sampling.max_tokens = static_cast<std::int32_t>(cap);
    r.sampling.ignore_eos = false;
    r.sampling.seed = o.seed * 1000003ULL + static_cast<std::uint64_t>(i);
    out.requests.push_back(std::move(r));
    out.prompt_texts.push_back(texts[which]);
  }
  out.description = fmt::format(
      "{} prompts of a {}-prompt set, answers end at EOS or {} tokens "
      "({} caps cut to the context)",
      count, texts.size(), o.max_tokens, out.clipped);
  return out;
}

}  // namespace kvlab
