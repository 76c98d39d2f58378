// The Mooncake FAST'25 traces as workloads (real_workloads.hpp): rows, the ideal prefix reuse,
// and prompt ids that honour the hash ids.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/splitmix64.hpp"
#include "kvlab/workload/real_workloads.hpp"
#include "replay.hpp"
#include "sources.hpp"

namespace kvlab {
namespace {

// A non-negative integer field of a row.
std::int64_t count_field(const nlohmann::json& row, const char* key) {
  const auto it = row.find(key);
  if (it == row.end()) throw Error(fmt::format("no \"{}\"", key));
  if (!it->is_number_integer() || it->get<std::int64_t>() < 0)
    throw Error(fmt::format("\"{}\" must be a non-negative integer", key));
  return it->get<std::int64_t>();
}

MooncakeRow parse_row(const std::string& line) {
  const nlohmann::json row = detail::parse_json_object(line);
  MooncakeRow out;
  out.time_s = static_cast<double>(count_field(row, "timestamp")) / 1000.0;
  out.input = count_field(row, "input_length");
  out.output = count_field(row, "output_length");
  if (out.input < 1 || out.input > kMaxRequestTokens || out.output < 1 ||
      out.output > kMaxRequestTokens)
    throw Error(fmt::format("input_length and output_length must be in [1, {}], got {} and {}",
                            kMaxRequestTokens, out.input, out.output));
  const auto ids = row.find("hash_ids");
  if (ids == row.end() || !ids->is_array()) throw Error("\"hash_ids\" must be a list");
  const std::int64_t blocks = (out.input + kMooncakeBlockTokens - 1) / kMooncakeBlockTokens;
  if (static_cast<std::int64_t>(ids->size()) > blocks)
    throw Error(fmt::format("{} hash_ids for {} input tokens: at most {} blocks of {}", ids->size(),
                            out.input, blocks, kMooncakeBlockTokens));
  for (const auto& id : *ids) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0)
      throw Error("hash_ids must be non-negative integers");
    out.hash_ids.push_back(id.get<std::int64_t>());
  }
  return out;
}

void check_options(const MooncakeTraceOptions& o) {
  detail::check_replay_options("Mooncake trace", o.start_s, o.duration_s, o.rate_scale,
                               o.max_requests, o.context, o.vocab_size);
  if (!(o.length_scale > 0 && o.length_scale <= 1))
    throw Error(
        fmt::format("Mooncake trace length_scale must be in (0, 1], got {}", o.length_scale));
}

std::int64_t scaled(std::int64_t tokens, double scale) {
  return std::max<std::int64_t>(1, std::llround(static_cast<double>(tokens) * scale));
}

// splitmix64: token j of the block a hash id names (or, with the request's salt, of a request's
// own tail), the same for the same (seed, id, j) everywhere.
std::int32_t token_of(std::uint64_t seed, std::uint64_t id, std::uint64_t j, std::int64_t vocab) {
  const std::uint64_t z =
      splitmix64_mix(seed ^ (id * 0x9e3779b97f4a7c15ULL) ^ (j * 0xd1b54a32d192ed03ULL));
  return static_cast<std::int32_t>(z % static_cast<std::uint64_t>(vocab));
}

// `length` prompt ids: block b is the block of hash_ids[b]; past the ids, the request's own.
std::vector<std::int32_t> prompt_ids(const MooncakeRow& row, std::int64_t length,
                                     std::int64_t block, std::int64_t request,
                                     const MooncakeTraceOptions& o) {
  constexpr std::uint64_t kOwnTokens = 0x6f776e0000000000ULL;  // salt: never a block's tokens
  std::vector<std::int32_t> ids(static_cast<std::size_t>(length));
  for (std::int64_t p = 0; p < length; ++p) {
    const auto b = static_cast<std::size_t>(p / block);
    ids[static_cast<std::size_t>(p)] =
        b < row.hash_ids.size() ? token_of(o.seed, static_cast<std::uint64_t>(row.hash_ids[b]),
                                           static_cast<std::uint64_t>(p % block), o.vocab_size)
                                : token_of(o.seed ^ kOwnTokens, static_cast<std::uint64_t>(request),
                                           static_cast<std::uint64_t>(p), o.vocab_size);
  }
  return ids;
}

// Every request's prompt ids, half on a second thread: a whole trace is 145M ids, the largest
// part of its load (each prompt depends on its row alone, so the halves give what one pass does).
void fill_prompts(std::vector<WorkloadRequest>& requests,
                  const std::vector<const MooncakeRow*>& rows,
                  const std::vector<std::int64_t>& lengths, std::int64_t block,
                  const MooncakeTraceOptions& o) {
  auto fill = [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i)
      requests[i].prompt = prompt_ids(*rows[i], lengths[i], block, requests[i].id, o);
  };
  const std::size_t half = requests.size() / 2;
  auto second = std::async(std::launch::async, fill, half, requests.size());
  fill(0, half);
  second.get();
}

}  // namespace

bool is_mooncake_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
    return row.is_object() && row.contains("hash_ids") && row.contains("input_length") &&
           row.contains("output_length");
  }
  return false;
}

std::vector<MooncakeRow> read_mooncake_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(fmt::format("cannot read Mooncake trace {}{}", path.string(),
                            data_set_hint(path.string())));
  std::vector<MooncakeRow> rows;
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      rows.push_back(parse_row(line));
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {}", path.string(), line_number, e.what()));
    }
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const MooncakeRow& a, const MooncakeRow& b) { return a.time_s < b.time_s; });
  return rows;
}

PrefixReuse ideal_prefix_reuse(const std::vector<std::vector<std::int64_t>>& hash_ids,
                               const std::vector<std::int64_t>& prompt_lengths,
                               std::int64_t block_tokens) {
  PrefixReuse reuse;
  std::unordered_set<std::int64_t> whole;  // ids some earlier request held whole
  for (std::size_t r = 0; r < hash_ids.size(); ++r) {
    const std::int64_t length = prompt_lengths[r];
    reuse.prompt_tokens += length;
    const auto full_blocks = static_cast<std::size_t>(length / block_tokens);
    bool hitting = true;
    for (std::size_t b = 0; b < hash_ids[r].size() && b < full_blocks; ++b) {
      hitting = hitting && whole.contains(hash_ids[r][b]);
      if (hitting) reuse.hit_tokens += block_tokens;
    }
    for (std::size_t b = 0; b < hash_ids[r].size() && b < full_blocks; ++b)
      whole.insert(hash_ids[r][b]);
  }
  return reuse;
}

RealWorkload load_mooncake_trace(const std::filesystem::path& path, const MooncakeTraceOptions& o) {
  check_options(o);
  const std::vector<MooncakeRow> rows = read_mooncake_trace(path);
  if (rows.empty()) throw Error(fmt::format("Mooncake trace {} has no requests", path.string()));
  const std::int64_t block = scaled(kMooncakeBlockTokens, o.length_scale);
  const double first = rows.front().time_s + o.start_s;
  RealWorkload out;
  std::vector<std::vector<std::int64_t>> ids;
  std::vector<std::int64_t> lengths;
  std::vector<const MooncakeRow*> sources;  // each request's row
  std::int64_t prompt_tokens = 0;
  for (const MooncakeRow& row : rows) {
    const double offset = row.time_s - first;
    if (offset < 0) continue;
    if (o.duration_s > 0 && offset >= o.duration_s) break;
    if (o.max_requests > 0 && static_cast<std::int64_t>(out.requests.size()) >= o.max_requests)
      break;
    std::int64_t prompt = scaled(row.input, o.length_scale);
    std::int64_t output = scaled(row.output, o.length_scale);
    out.clipped += detail::clip_to_context(prompt, output, o.context);
    prompt_tokens += prompt;
    if (prompt_tokens > (std::int64_t{1} << 32))
      throw Error(
          "the Mooncake trace window holds more than 2^32 prompt tokens: use a shorter "
          "one, or length_scale");
    WorkloadRequest r;
    r.id = static_cast<std::int64_t>(out.requests.size());
    r.arrival_s = offset / o.rate_scale;
    r.output_tokens = output;
    r.sampling = o.sampling;
    r.sampling.max_tokens = static_cast<std::int32_t>(output);
    r.sampling.ignore_eos = true;
    r.sampling.seed = o.seed + static_cast<std::uint64_t>(r.id);
    out.requests.push_back(std::move(r));
    ids.push_back(row.hash_ids);
    lengths.push_back(prompt);
    sources.push_back(&row);
  }
  if (out.requests.empty())
    throw Error(fmt::format("Mooncake trace {}: no request in the window [{}, {}) s", path.string(),
                            o.start_s, o.duration_s > 0 ? o.start_s + o.duration_s : INFINITY));
  fill_prompts(out.requests, sources, lengths, block, o);
  const PrefixReuse ideal = ideal_prefix_reuse(ids, lengths, block);
  out.ideal_prefix_hit_rate = ideal.rate();
  out.description = fmt::format(
      "Mooncake trace {}: {} requests over {:.1f} s (rate x{}), lengths x{} ({}-token blocks), "
      "{} clipped to the {}-token context; ideal prefix hit rate {:.1f}%",
      path.filename().string(), out.requests.size(), out.requests.back().arrival_s, o.rate_scale,
      o.length_scale, block, out.clipped, o.context, 100 * ideal.rate());
  return out;
}

namespace detail {

RealWorkload load_mooncake_source(const WorkloadInput& input) {
  auto o = replay_options<MooncakeTraceOptions>(input);
  o.length_scale = input.window.length_scale;
  return load_mooncake_trace(input.file, o);
}

}  // namespace detail

}  // namespace kvlab
