#include "kvlab/experiment/distributed_sweep.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "kvlab/error.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab {
namespace {

double mean_length(const LengthDistribution& d) {
  switch (d.kind) {
    case LengthKind::fixed:
      return d.value;
    case LengthKind::uniform:
      return 0.5 * static_cast<double>(d.min + d.max);
    case LengthKind::normal:
    case LengthKind::lognormal:
      return d.mean;
    case LengthKind::zipf:  // most mass near min
      return static_cast<double>(d.min) + 0.1 * static_cast<double>(d.max - d.min);
  }
  return d.value;
}

constexpr std::size_t kLengthBytes = 8;

void put_length(std::string& out, std::uint64_t n) {
  for (std::size_t i = 0; i < kLengthBytes; ++i)
    out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
}

std::uint64_t get_length(std::string_view bytes) {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < kLengthBytes; ++i)
    n |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return n;
}

// The header's fields, each checked for its type (a record comes from another process).
RunRecord record_from_header(const nlohmann::json& h) {
  RunRecord r;
  r.index = h.at("index").get<std::uint64_t>();
  r.rank = h.at("rank").get<int>();
  r.error = h.at("error").get<std::string>();
  for (const auto& cell : h.at("row"))  // JSON writes a NaN (no value) as null
    r.row.push_back(cell.is_null() ? std::numeric_limits<double>::quiet_NaN() : cell.get<double>());
  r.finished = h.at("finished").get<std::int64_t>();
  r.all_rejected = h.at("all_rejected").get<std::string>();
  r.mismatches = h.at("mismatches").get<std::vector<std::string>>();
  r.checked_tokens = h.at("checked_tokens").get<std::int64_t>();
  r.off_argmax = h.at("off_argmax").get<std::int64_t>();
  r.max_gap = h.at("max_gap").get<double>();
  const nlohmann::json& logits = h.at("logits");
  r.logits.rows = logits.at("rows").get<std::int64_t>();
  r.logits.max_abs_delta = logits.at("max_abs_delta").get<double>();
  r.logits.sum_row_max_delta = logits.at("sum_row_max_delta").get<double>();
  r.logits.top_positions = logits.at("top_positions").get<std::int64_t>();
  r.logits.top_shared = logits.at("top_shared").get<std::int64_t>();
  const nlohmann::json& logprobs = h.at("logprobs");
  r.logprobs.tokens = logprobs.at("tokens").get<std::int64_t>();
  r.logprobs.entries = logprobs.at("entries").get<std::int64_t>();
  r.logprobs.max_abs_delta = logprobs.at("max_abs_delta").get<double>();
  r.wall_s = h.at("wall_s").get<double>();
  r.engine_wall_s = h.at("engine_wall_s").get<double>();
  r.forward_wall_s = h.at("forward_wall_s").get<double>();
  r.forwards = h.at("forwards").get<std::int64_t>();
  r.forwards_with_chosen_tokens = h.at("forwards_with_chosen_tokens").get<std::int64_t>();
  r.graph_replays = h.at("graph_replays").get<std::int64_t>();
  r.step_time_ratio_p50 = h.at("step_time_ratio_p50").get<double>();
  r.machine_load_1m = h.at("machine_load_1m").get<double>();
  r.graph_captures = h.at("graph_captures").get<std::int64_t>();
  return r;
}

}  // namespace

double estimated_run_cost(const ExperimentConfig& c) {
  double requests = static_cast<double>(c.workload.requests);
  if (!c.prompt_set.empty() && c.prompt_requests > 0)
    requests = static_cast<double>(c.prompt_requests);
  if (!c.azure_trace.empty() && c.azure.max_requests > 0)
    requests = static_cast<double>(c.azure.max_requests);
  const double tokens =
      mean_length(c.workload.prompt_tokens) + 2 * mean_length(c.workload.output_tokens);
  const double per_token = c.backend_kind == BackendKind::simulated ? 1.0 : 50.0;
  return std::max(1.0, requests * tokens * per_token);
}

std::vector<std::vector<std::size_t>> balance_runs(std::span<const double> costs, int ranks) {
  if (ranks < 1) throw Error(fmt::format("balance_runs: {} ranks", ranks));
  std::vector<std::size_t> order(costs.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return costs[a] > costs[b]; });
  std::vector<double> load(static_cast<std::size_t>(ranks), 0.0);
  std::vector<std::vector<std::size_t>> assigned(static_cast<std::size_t>(ranks));
  for (const std::size_t run : order) {
    const auto lightest = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) -
                                                   load.begin());  // first of equals
    load[lightest] += costs[run];
    assigned[lightest].push_back(run);
  }
  for (auto& runs : assigned) std::sort(runs.begin(), runs.end());
  return assigned;
}

std::string encode_run_record(const RunRecord& r) {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& [path, contents] : r.files)
    files.push_back({{"path", path}, {"bytes", contents.size()}});
  const nlohmann::json header = {{"index", r.index},
                                 {"rank", r.rank},
                                 {"error", r.error},
                                 {"row", r.row},
                                 {"finished", r.finished},
                                 {"all_rejected", r.all_rejected},
                                 {"mismatches", r.mismatches},
                                 {"checked_tokens", r.checked_tokens},
                                 {"off_argmax", r.off_argmax},
                                 {"max_gap", r.max_gap},
                                 {"logits",
                                  {{"rows", r.logits.rows},
                                   {"max_abs_delta", r.logits.max_abs_delta},
                                   {"sum_row_max_delta", r.logits.sum_row_max_delta},
                                   {"top_positions", r.logits.top_positions},
                                   {"top_shared", r.logits.top_shared}}},
                                 {"logprobs",
                                  {{"tokens", r.logprobs.tokens},
                                   {"entries", r.logprobs.entries},
                                   {"max_abs_delta", r.logprobs.max_abs_delta}}},
                                 {"wall_s", r.wall_s},
                                 {"engine_wall_s", r.engine_wall_s},
                                 {"forward_wall_s", r.forward_wall_s},
                                 {"forwards", r.forwards},
                                 {"forwards_with_chosen_tokens", r.forwards_with_chosen_tokens},
                                 {"graph_replays", r.graph_replays},
                                 {"graph_captures", r.graph_captures},
                                 {"step_time_ratio_p50", r.step_time_ratio_p50},
                                 {"machine_load_1m", r.machine_load_1m},
                                 {"files", files}};
  const std::string text = header.dump();
  std::string out;
  put_length(out, text.size());
  out += text;
  for (const auto& file : r.files) out += file.second;
  return out;
}

RunRecord decode_run_record(std::string_view bytes) {
  if (bytes.size() < kLengthBytes)
    throw Error(fmt::format("run record: {} bytes, shorter than its length field", bytes.size()));
  const std::uint64_t header_size = get_length(bytes);
  if (header_size > bytes.size() - kLengthBytes)
    throw Error(fmt::format("run record: a {}-byte header in {} bytes", header_size, bytes.size()));
  RunRecord r;
  std::size_t offset = kLengthBytes + static_cast<std::size_t>(header_size);
  try {
    const nlohmann::json header =
        nlohmann::json::parse(bytes.substr(kLengthBytes, static_cast<std::size_t>(header_size)));
    r = record_from_header(header);
    for (const auto& file : header.at("files")) {
      const auto path = file.at("path").get<std::string>();
      const auto size = file.at("bytes").get<std::uint64_t>();
      if (path.empty() || path.front() == '/' || path.find("..") != std::string::npos)
        throw Error(fmt::format("run record: file path \"{}\" leaves its run folder", path));
      if (size > bytes.size() - offset)
        throw Error(fmt::format("run record: {} needs {} bytes, {} left", path, size,
                                bytes.size() - offset));
      r.files.emplace_back(path, std::string(bytes.substr(offset, static_cast<std::size_t>(size))));
      offset += static_cast<std::size_t>(size);
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("run record: malformed header: {}", e.what()));
  }
  if (offset != bytes.size())
    throw Error(fmt::format("run record: {} bytes after its last file", bytes.size() - offset));
  return r;
}

std::vector<std::pair<std::string, std::string>> read_folder_files(
    const std::filesystem::path& folder) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(folder)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::ostringstream contents;
    contents << in.rdbuf();
    if (!in) throw Error(fmt::format("cannot read {}", entry.path().string()));
    files.emplace_back(std::filesystem::relative(entry.path(), folder).generic_string(),
                       contents.str());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace kvlab
