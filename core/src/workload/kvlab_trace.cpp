// kvlab's own trace format: a CSV file with a header row, or JSONL (one object a line), by the
// file's extension. Fields: arrival_s, prompt_len or prompt_ids, output_len, priority and
// tenant (optional).
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "../csv_fields.hpp"
#include "draws.hpp"
#include "kvlab/checked_math.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"
#include "kvlab/workload/workload.hpp"
#include "sources.hpp"

namespace kvlab {

using detail::Draw;
using detail::PromptBudget;
using detail::random_tokens;

namespace {

struct TraceRow {
  std::optional<double> arrival_s;
  std::optional<std::int64_t> prompt_len;
  std::optional<std::vector<std::int32_t>> prompt_ids;
  std::optional<std::int64_t> output_len;
  std::optional<std::int64_t> priority;
  std::string tenant;
};

const std::vector<std::string>& trace_fields() {
  static const std::vector<std::string> fields{"arrival_s",  "prompt_len", "prompt_ids",
                                               "output_len", "priority",   "tenant"};
  return fields;
}

std::string unknown_field(const std::string& name) {
  std::string message = fmt::format("unknown field \"{}\"", name);
  if (auto near = nearest_name(name, trace_fields()))
    message += fmt::format(" (did you mean \"{}\"?)", *near);
  return message + "; fields: " + join_names(trace_fields());
}

WorkloadRequest finish_row(const TraceRow& row, std::int64_t index, const TraceOptions& options,
                           Draw& draw) {
  if (!row.arrival_s) throw Error("missing arrival_s");
  if (!(*row.arrival_s >= 0) || !(*row.arrival_s <= kMaxArrivalSeconds))
    throw Error(fmt::format("arrival_s must be in [0, {:g}] seconds, got {}", kMaxArrivalSeconds,
                            *row.arrival_s));
  if (!row.output_len) throw Error("missing output_len");
  if (*row.output_len < 1 || *row.output_len > kMaxRequestTokens)
    throw Error(
        fmt::format("output_len must be in [1, {}], got {}", kMaxRequestTokens, *row.output_len));
  if (row.prompt_ids && row.prompt_len &&
      static_cast<std::int64_t>(row.prompt_ids->size()) != *row.prompt_len)
    throw Error(fmt::format("prompt_len {} disagrees with the {} prompt_ids", *row.prompt_len,
                            row.prompt_ids->size()));
  WorkloadRequest r;
  r.id = index;
  r.arrival_s = *row.arrival_s;
  r.output_tokens = *row.output_len;
  const auto priority = narrow_integer<int>(row.priority.value_or(0));
  if (!priority) throw Error(fmt::format("priority {} does not fit in 32 bits", *row.priority));
  r.priority = *priority;
  r.tenant = row.tenant;
  if (row.prompt_ids) {
    for (auto id : *row.prompt_ids)
      if (id < 0 || id >= options.vocab_size)
        throw Error(
            fmt::format("prompt id {} is outside the vocabulary [0, {})", id, options.vocab_size));
    r.prompt = *row.prompt_ids;
  } else if (row.prompt_len) {
    if (*row.prompt_len < 1 || *row.prompt_len > kMaxRequestTokens)
      throw Error(
          fmt::format("prompt_len must be in [1, {}], got {}", kMaxRequestTokens, *row.prompt_len));
    r.prompt = random_tokens(*row.prompt_len, options.vocab_size, draw);
  } else {
    throw Error("missing prompt_len or prompt_ids");
  }
  if (r.prompt.empty()) throw Error("empty prompt");
  r.sampling = options.sampling;
  r.sampling.max_tokens = static_cast<std::int32_t>(r.output_tokens);
  r.sampling.seed = options.sampling.seed + static_cast<std::uint64_t>(index);
  return r;
}

}  // namespace

namespace {

// One JSONL trace line: an object of trace fields.
TraceRow jsonl_row(const std::string& line) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(fmt::format("not valid JSON: {}", e.what()));
  }
  if (!object.is_object()) throw Error("each line must be a JSON object");
  TraceRow row;
  auto integer = [](const std::string& key, const nlohmann::json& value) {
    if (!value.is_number_integer())
      throw Error(fmt::format("{} must be an integer, got {}", key, value.dump()));
    return value.get<std::int64_t>();
  };
  for (const auto& item : object.items()) {
    const std::string& key = item.key();
    const nlohmann::json& value = item.value();
    if (key == "arrival_s") {
      if (!value.is_number())
        throw Error(fmt::format("arrival_s must be a number, got {}", value.dump()));
      row.arrival_s = value.get<double>();
    } else if (key == "prompt_len" || key == "output_len" || key == "priority") {
      (key == "prompt_len"   ? row.prompt_len
       : key == "output_len" ? row.output_len
                             : row.priority) = integer(key, value);
    } else if (key == "tenant") {
      if (!value.is_string())
        throw Error(fmt::format("tenant must be a string, got {}", value.dump()));
      row.tenant = check_tenant_name(value.get<std::string>());
    } else if (key == "prompt_ids") {
      if (!value.is_array() || !std::all_of(value.begin(), value.end(),
                                            [](const auto& v) { return v.is_number_integer(); }))
        throw Error("prompt_ids must be a list of integers");
      row.prompt_ids.emplace();
      for (const auto& id : value) {
        const auto fitted = id.is_number_unsigned()
                                ? narrow_integer<std::int32_t>(id.get<std::uint64_t>())
                                : narrow_integer<std::int32_t>(id.get<std::int64_t>());
        if (!fitted) throw Error(fmt::format("prompt id {} does not fit in 32 bits", id.dump()));
        row.prompt_ids->push_back(*fitted);
      }
    } else {
      throw Error(unknown_field(key));
    }
  }
  return row;
}

// A CSV trace's header: the column names, each a trace field.
std::vector<std::string> csv_header(std::vector<std::string> cells) {
  cells = csv_header_names(std::move(cells));
  for (std::size_t c = 0; c < cells.size(); ++c) {
    const std::string& name = cells[c];
    if (std::find(trace_fields().begin(), trace_fields().end(), name) == trace_fields().end())
      throw Error(unknown_field(name));
    if (std::find(cells.begin(), cells.begin() + static_cast<std::ptrdiff_t>(c), name) !=
        cells.begin() + static_cast<std::ptrdiff_t>(c))
      throw Error(fmt::format("column \"{}\" appears twice in the header", name));
  }
  return cells;
}

TraceRow csv_row(const std::vector<std::string>& cells, const std::vector<std::string>& header) {
  if (cells.size() != header.size())
    throw Error(
        fmt::format("{} cells, but the header has {} columns", cells.size(), header.size()));
  TraceRow row;
  for (std::size_t c = 0; c < cells.size(); ++c) {
    const std::string& name = header[c];
    if (name == "arrival_s") {
      row.arrival_s = parse_number<double>(cells[c], "arrival_s");
    } else if (name == "prompt_len") {
      row.prompt_len = parse_number<std::int64_t>(cells[c], "prompt_len");
    } else if (name == "output_len") {
      row.output_len = parse_number<std::int64_t>(cells[c], "output_len");
    } else if (name == "priority") {
      row.priority = parse_number<std::int64_t>(cells[c], "priority");
    } else if (name == "tenant") {
      row.tenant = check_tenant_name(cells[c]);
    } else if (name == "prompt_ids") {  // space-separated ids inside the cell
      std::vector<std::int32_t> ids;
      std::stringstream id_stream(cells[c]);
      for (std::string id; id_stream >> id;)
        ids.push_back(parse_number<std::int32_t>(id, "prompt id"));
      row.prompt_ids = ids;
    }
  }
  return row;
}

}  // namespace

std::vector<WorkloadRequest> load_trace(const std::filesystem::path& path,
                                        const TraceOptions& options) {
  std::ifstream in(path);
  if (!in)
    throw Error(fmt::format("cannot read trace {}: file not found or not readable{}", path.string(),
                            data_set_hint(path.string())));
  const std::string extension = path.extension().string();
  if (extension != ".csv" && extension != ".jsonl")
    throw Error(fmt::format("trace {}: unknown format \"{}\" (use .csv or .jsonl)", path.string(),
                            extension));
  Draw draw(options.seed);
  std::vector<WorkloadRequest> requests;
  PromptBudget budget;
  std::vector<std::string> header;  // CSV: the first non-empty line names the columns
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      if (extension == ".csv" && header.empty()) {
        header = csv_header(csv_cells(line));
        continue;
      }
      const TraceRow row =
          extension == ".jsonl" ? jsonl_row(line) : csv_row(csv_cells(line), header);
      if (row.prompt_len) budget.add(*row.prompt_len, "the trace's prompts");
      requests.push_back(
          finish_row(row, static_cast<std::int64_t>(requests.size()), options, draw));
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {}", path.string(), line_number, e.what()));
    }
  }
  if (requests.empty()) throw Error(fmt::format("trace {} holds no requests", path.string()));
  std::stable_sort(
      requests.begin(), requests.end(),
      [](const WorkloadRequest& a, const WorkloadRequest& b) { return a.arrival_s < b.arrival_s; });
  return requests;
}

namespace detail {

// The last row sniffed: any other file is kvlab's, and its reader says what it wants.
bool is_kvlab_trace(const std::filesystem::path& file) {
  (void)file;
  return true;
}

RealWorkload load_kvlab_source(const WorkloadInput& input) {
  if (input.window.length_scale != 1.0)
    throw Error(fmt::format("trace {}: length_scale is a Mooncake trace's", input.file.string()));
  TraceOptions options;
  options.vocab_size = input.vocab_size;
  options.seed = input.seed;
  options.sampling = input.sampling;
  options.sampling.ignore_eos = input.synthetic.ignore_eos;
  RealWorkload out;
  out.requests = load_trace(input.file, options);
  return out;
}

}  // namespace detail

}  // namespace kvlab
