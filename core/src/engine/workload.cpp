#include "kvlab/engine/workload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "../csv_fields.hpp"
#include "kvlab/checked_math.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {
namespace {

// Draws from one 64-bit stream with explicit transforms (not <random>'s implementation-defined
// distributions), so a spec and seed give the same workload with any standard library.
class Draw {
 public:
  explicit Draw(std::uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double open_uniform() {
    return (static_cast<double>(engine_() >> 11) + 0.5) * 0x1.0p-53;
  }                  // (0, 1)
  double normal() {  // Box-Muller
    return std::sqrt(-2.0 * std::log(open_uniform())) *
           std::cos(2.0 * std::numbers::pi * uniform());
  }
  double exponential(double rate) { return -std::log(open_uniform()) / rate; }
  double gamma(double shape) {  // Marsaglia-Tsang, with the boost for shape < 1
    if (shape < 1.0) return gamma(shape + 1.0) * std::pow(open_uniform(), 1.0 / shape);
    const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
    while (true) {
      double x, v;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = open_uniform();
      if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v;
    }
  }
  std::uint64_t bits() { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

// Request i's arrival time, the one before it at `clock`.
double next_arrival(const ArrivalProcess& arrival, std::int64_t i, double clock, Draw& draw) {
  switch (arrival.kind) {
    case ArrivalKind::all_at_once:
      return 0;
    case ArrivalKind::poisson:
      return clock + draw.exponential(arrival.rate_per_s);
    case ArrivalKind::gamma: {  // shape 1/cv^2, mean 1/rate
      const double shape = 1.0 / (arrival.cv * arrival.cv);
      return clock + draw.gamma(shape) / (shape * arrival.rate_per_s);
    }
    case ArrivalKind::bursts:  // burst_size requests at once, bursts spaced to keep the mean rate
      if (i % arrival.burst_size == 0 && i > 0)
        return clock + static_cast<double>(arrival.burst_size) / arrival.rate_per_s;
      return clock;
  }
  return clock;
}

void check_arrival(const ArrivalProcess& arrival) {
  if (arrival.kind != ArrivalKind::all_at_once &&
      !(arrival.rate_per_s > 0 && std::isfinite(arrival.rate_per_s)))
    throw Error(fmt::format("workload arrival rate must be a finite number > 0 requests/s, got {}",
                            arrival.rate_per_s));
  if (arrival.kind == ArrivalKind::gamma && !(arrival.cv > 0 && std::isfinite(arrival.cv)))
    throw Error(fmt::format("workload gamma arrival cv must be > 0, got {}", arrival.cv));
  if (arrival.kind == ArrivalKind::bursts && arrival.burst_size < 1)
    throw Error("workload burst_size must be >= 1");
}

void check_length(const LengthDistribution& d, const char* what) {
  if (d.min < 1 || d.max < d.min)
    throw Error(
        fmt::format("workload {}: need 1 <= min <= max, got min {} max {}", what, d.min, d.max));
  if (d.max > kMaxRequestTokens)
    throw Error(fmt::format("workload {}: max {} is above kvlab's limit of {} tokens per request",
                            what, d.max, kMaxRequestTokens));
  if ((d.kind == LengthKind::normal || d.kind == LengthKind::lognormal) &&
      (!(d.mean > 0) || !(d.stddev >= 0)))
    throw Error(fmt::format("workload {}: mean must be > 0 and stddev >= 0", what));
  if (d.kind == LengthKind::zipf && !(d.alpha > 0))
    throw Error(fmt::format("workload {}: zipf alpha must be > 0", what));
  if (d.kind == LengthKind::fixed && !(d.value >= 1))
    throw Error(fmt::format("workload {}: fixed value must be >= 1", what));
}

// Every prompt token a workload holds, checked against the machine's memory as they accumulate
// (before each allocation), so 10^7 requests of 10^6 tokens fail with the fields, not bad_alloc.
class PromptBudget {
 public:
  void add(std::int64_t tokens, const char* what) {
    total_ += tokens;
    if (static_cast<std::uint64_t>(total_) * sizeof(std::int32_t) > limit_)
      throw Error(
          fmt::format("{} reach {} tokens, more than half of what this machine can hold "
                      "({:.1f} GiB)",
                      what, total_, static_cast<double>(2 * limit_) / (1 << 30)));
  }

 private:
  std::int64_t total_ = 0;
  std::uint64_t limit_ = allocatable_bytes() / 2;  // prompts are not all a run holds
};

// The mean of draw_length(d) (zipf: bounded below by min), to size a workload before drawing it.
double expected_length(const LengthDistribution& d) {
  const auto lo = static_cast<double>(d.min), hi = static_cast<double>(d.max);
  switch (d.kind) {
    case LengthKind::fixed:
      return std::clamp(d.value, lo, hi);
    case LengthKind::uniform:
      return (lo + hi) / 2;
    case LengthKind::normal:
    case LengthKind::lognormal:
      return std::clamp(d.mean, lo, hi);
    case LengthKind::zipf:
      break;
  }
  return lo;
}

std::int64_t draw_length(const LengthDistribution& d, Draw& draw) {
  double x = 0;
  switch (d.kind) {
    case LengthKind::fixed:
      x = d.value;
      break;
    case LengthKind::uniform:
      x = static_cast<double>(d.min) +
          std::floor(draw.uniform() * static_cast<double>(d.max - d.min + 1));
      break;
    case LengthKind::normal:
      x = std::round(d.mean + d.stddev * draw.normal());
      break;
    case LengthKind::lognormal: {  // parameters chosen so the lengths have the given mean and
                                   // stddev
      const double sigma2 = std::log(1.0 + (d.stddev * d.stddev) / (d.mean * d.mean));
      const double mu = std::log(d.mean) - sigma2 / 2.0;
      x = std::round(std::exp(mu + std::sqrt(sigma2) * draw.normal()));
      break;
    }
    case LengthKind::zipf: {  // P(k) ~ k^-alpha over [min, max], by inverse CDF
      double total = 0;
      for (std::int64_t k = d.min; k <= d.max; ++k)
        total += std::pow(static_cast<double>(k), -d.alpha);
      double target = draw.uniform() * total;
      x = static_cast<double>(d.max);
      for (std::int64_t k = d.min; k <= d.max; ++k) {
        target -= std::pow(static_cast<double>(k), -d.alpha);
        if (target < 0) {
          x = static_cast<double>(k);
          break;
        }
      }
      break;
    }
  }
  // Clamped as a double first: a fixed value of 1e30 must not reach the integer conversion.
  return static_cast<std::int64_t>(std::clamp(std::isnan(x) ? static_cast<double>(d.min) : x,
                                              static_cast<double>(d.min),
                                              static_cast<double>(d.max)));
}

std::vector<std::int32_t> random_tokens(std::int64_t count, std::int64_t vocab, Draw& draw) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
  for (auto& t : tokens)
    t = static_cast<std::int32_t>(draw.bits() % static_cast<std::uint64_t>(vocab));
  return tokens;
}

}  // namespace

SamplingParams workload_sampling(const SyntheticWorkload& spec) {
  SamplingParams sampling;
  sampling.temperature = spec.temperature;
  sampling.top_p = spec.top_p;
  sampling.top_k = spec.top_k;
  sampling.logprobs = spec.logprobs;
  return sampling;
}

std::vector<WorkloadRequest> generate_workload(const SyntheticWorkload& spec) {
  if (spec.requests < 0) throw Error("workload requests must be >= 0");
  if (spec.vocab_size < 1) throw Error("workload vocab_size must be >= 1");
  check_arrival(spec.arrival);
  check_length(spec.prompt_tokens, "prompt_tokens");
  check_length(spec.output_tokens, "output_tokens");
  if (spec.prefix_tokens >= kMaxRequestTokens || spec.prefix_groups > kMaxPrefixGroups)
    throw Error(fmt::format(
        "workload shared prefix: {} groups of {} tokens is above kvlab's "
        "limits ({} groups, {} tokens)",
        spec.prefix_groups, spec.prefix_tokens, kMaxPrefixGroups, kMaxRequestTokens - 1));
  if (spec.prefix_groups < 0 || spec.prefix_tokens < 0 ||
      (spec.prefix_groups > 0) != (spec.prefix_tokens > 0))
    throw Error(
        "workload shared prefix: set both prefix_groups and prefix_tokens (> 0), or neither");
  if (spec.priority_weights.empty() ||
      std::any_of(spec.priority_weights.begin(), spec.priority_weights.end(),
                  [](double w) { return !(w >= 0); }) ||
      std::accumulate(spec.priority_weights.begin(), spec.priority_weights.end(), 0.0) <= 0)
    throw Error("workload priority weights must be >= 0 with a positive sum");

  Draw draw(spec.seed);
  std::vector<std::vector<std::int32_t>> prefixes;
  for (std::int64_t g = 0; g < spec.prefix_groups; ++g)
    prefixes.push_back(random_tokens(spec.prefix_tokens, spec.vocab_size, draw));
  const double weight_sum =
      std::accumulate(spec.priority_weights.begin(), spec.priority_weights.end(), 0.0);

  const double expected_tokens =
      static_cast<double>(spec.requests) *
      std::max(expected_length(spec.prompt_tokens), static_cast<double>(spec.prefix_tokens + 1));
  if (expected_tokens * sizeof(std::int32_t) > static_cast<double>(allocatable_bytes()) / 2)
    throw Error(fmt::format(
        "the workload's prompts (workload.requests {} x about {:.0f} prompt_tokens) need more "
        "than half of what this machine can hold ({:.1f} GiB)",
        spec.requests, expected_tokens / static_cast<double>(spec.requests),
        static_cast<double>(allocatable_bytes()) / (1 << 30)));
  std::vector<WorkloadRequest> requests;
  PromptBudget budget;  // the backstop for distributions whose mean says little
  double clock = 0;
  for (std::int64_t i = 0; i < spec.requests; ++i) {
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = clock = next_arrival(spec.arrival, i, clock, draw);
    std::int64_t prompt_length = draw_length(spec.prompt_tokens, draw);
    if (spec.prefix_groups > 0) {
      r.prefix_group =
          static_cast<std::int64_t>(draw.bits() % static_cast<std::uint64_t>(spec.prefix_groups));
      r.prompt = prefixes[static_cast<std::size_t>(r.prefix_group)];
      prompt_length = std::max(prompt_length, spec.prefix_tokens + 1);  // at least one own token
    }
    budget.add(prompt_length, "the workload's prompts (workload.requests x prompt_tokens)");
    const auto own = random_tokens(prompt_length - static_cast<std::int64_t>(r.prompt.size()),
                                   spec.vocab_size, draw);
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    r.output_tokens = draw_length(spec.output_tokens, draw);
    double pick = draw.uniform() * weight_sum;
    r.priority = 0;
    for (std::size_t p = 0; p < spec.priority_weights.size(); ++p) {
      pick -= spec.priority_weights[p];
      if (pick < 0) {
        r.priority = static_cast<int>(p);
        break;
      }
    }
    r.sampling = workload_sampling(spec);
    r.sampling.max_tokens = static_cast<std::int32_t>(r.output_tokens);
    r.sampling.ignore_eos = spec.ignore_eos;
    r.sampling.seed = spec.seed * 1000003ULL + static_cast<std::uint64_t>(i);
    validate_sampling_params(r.sampling);
    requests.push_back(std::move(r));
  }
  return requests;
}

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

std::vector<double> arrival_times(const ArrivalProcess& arrival, std::int64_t requests,
                                  std::uint64_t seed) {
  check_arrival(arrival);
  Draw draw(seed);
  std::vector<double> times;
  double clock = 0;
  for (std::int64_t i = 0; i < requests; ++i)
    times.push_back(clock = next_arrival(arrival, i, clock, draw));
  return times;
}

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

void check_arrival_times(const std::vector<WorkloadRequest>& requests, const std::string& source) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const double t = requests[i].arrival_s;
    if (!(t >= 0 && t <= kMaxArrivalSeconds))
      throw Error(fmt::format(
          "{}: request {} arrives at {:g} s, outside [0, {:g}] s (latencies past that would "
          "vanish in double-precision time); raise the rate or shorten the trace",
          source, i, t, kMaxArrivalSeconds));
  }
}

}  // namespace kvlab
