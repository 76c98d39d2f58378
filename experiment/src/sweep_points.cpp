// An experiment file's runs: its [[sweep]] axes and the command line's --sweep axes crossed
// into points, each point's table with --set applied on top, then repeats.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "experiment_toml.hpp"
#include "kvlab/checked_math.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"

namespace kvlab {
namespace {

constexpr std::size_t kMaxSweepPoints = 10'000;
constexpr std::size_t kMaxRuns = 100'000;  // points x repeats

// One sweep axis; values point into the parsed file's table or a --sweep's own array.
struct SweepAxis {
  std::string key;
  std::vector<const toml::node*> values;
  std::string group;   // axes of one group advance together; groups are crossed
  std::string origin;  // "[[sweep]]" or "--sweep ..."
};

// "key=value" of --set and --sweep: the key and the value's text.
std::pair<std::string, std::string> split_assignment(const std::string& text, const char* option) {
  const std::size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error(fmt::format("{} \"{}\": expected key=value", option, text));
  std::string key = text.substr(0, eq);
  if (key.starts_with("sweep.") || (key == "sweep" && std::string_view(option) == "--sweep"))
    throw Error(
        fmt::format("{} \"{}\": the sweep is replaced whole (--set 'sweep=[{{key=...,"
                    " values=[...]}}]') or given an axis (--sweep key=v1,v2)",
                    option, text));
  return {std::move(key), text.substr(eq + 1)};
}

// A --set value: one TOML value, or a bare word as a string.
toml::table one_value(const std::string& text, const std::string& origin) {
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + text);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", text}};  // a bare word is a string
  }
  if (parsed.size() != 1)  // "5\nx=1" parses as two keys: the second would vanish
    throw Error(fmt::format("{}: the value is more than one TOML value (a newline?)", origin));
  return parsed;
}

void apply_overrides(toml::table& root, const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    const auto [key, text] = split_assignment(o, "--set");
    const std::string origin = fmt::format("--set {}", o);
    set_dotted(root, key, *one_value(text, origin).get("v"), origin);
  }
}

// --sweep key=v1,v2: a TOML array's items ("8,16", "{a=1},{a=2}"), else comma-separated words
// each read as --set reads a value ("fcfs,static").
toml::array sweep_values(const std::string& text, const std::string& origin) {
  try {
    const toml::table parsed = toml::parse("v = [" + text + "]");
    if (parsed.size() == 1 && !parsed.get("v")->as_array()->empty())
      return *parsed.get("v")->as_array();
  } catch (const toml::parse_error&) {
  }
  toml::array values;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    if (item.empty()) throw Error(fmt::format("{}: an empty value", origin));
    values.push_back(*one_value(item, origin).get("v"));
    start = comma + 1;
  }
  return values;
}

std::vector<SweepAxis> file_axes(const toml::table& root, const std::string& file) {
  std::vector<SweepAxis> axes;
  for (const SweepTable& t : read_sweep_tables(root, file)) {
    SweepAxis axis{t.key, {}, t.group, "[[sweep]]"};
    for (const auto& v : *t.values) axis.values.push_back(&v);
    axes.push_back(std::move(axis));
  }
  return axes;
}

// True when setting `key` decides what `axis_key` would sweep: the same key or a table holding it.
bool covers(const std::string& key, const std::string& axis_key) {
  return axis_key == key || axis_key.starts_with(key + ".");
}

// A command-line setting that decides a key: the key, and the option as typed.
struct Decider {
  std::string key, typed;
};

// The file's axes less those the command line decides (and the axes zipped with them: a zip
// group advances as one setting), each dropped group told in `notes`.
std::vector<SweepAxis> without_decided_axes(std::vector<SweepAxis> axes,
                                            const std::vector<Decider>& deciders,
                                            std::vector<std::string>& notes) {
  for (const Decider& d : deciders) {
    std::set<std::string> groups;
    for (const auto& a : axes)
      if (covers(d.key, a.key)) groups.insert(a.group);
    if (groups.empty()) continue;
    std::vector<std::string> dropped;
    std::erase_if(axes, [&](const SweepAxis& a) {
      if (!groups.contains(a.group)) return false;
      dropped.push_back(fmt::format("{} ({} values)", a.key, a.values.size()));
      return true;
    });
    notes.push_back(fmt::format("{} replaces the file's [[sweep]] over {}", d.typed,
                                fmt::join(dropped, " and ")));
  }
  return axes;
}

// The groups in order of appearance with their sizes, and the number of points they make.
struct SweepShape {
  std::vector<std::string> groups;
  std::map<std::string, std::size_t> size;
  std::size_t points = 1;
};

SweepShape sweep_shape(const std::vector<SweepAxis>& axes, const std::string& file) {
  SweepShape shape;
  for (const auto& a : axes) {
    auto [it, inserted] = shape.size.try_emplace(a.group, a.values.size());
    if (inserted)
      shape.groups.push_back(a.group);
    else if (it->second != a.values.size())
      throw Error(fmt::format(
          "{}: zipped sweep axes in group \"{}\" need the same number of values", file, a.group));
  }
  for (const auto& g : shape.groups) {
    const auto product = checked_mul<std::size_t>(shape.points, shape.size[g]);
    if (!product || *product > kMaxSweepPoints)
      throw Error(
          fmt::format("{}: the sweep axes make more than {} points (kvlab's limit per "
                      "experiment file): split the sweep into several files",
                      file, kMaxSweepPoints));
    shape.points = *product;
  }
  return shape;
}

// A value as JSON text.
std::string json_text(const toml::node& value) {
  std::ostringstream out;
  out << toml::json_formatter{value, toml::format_flags::none};
  return out.str();
}

// Sets sweep point `point`'s values into `table` and `swept`; returns its label
// ("key=value, ...").
std::string apply_sweep_point(toml::table& table, const std::vector<SweepAxis>& axes,
                              const SweepShape& shape, std::size_t point,
                              std::vector<std::pair<std::string, std::string>>& swept) {
  std::map<std::string, std::size_t> index;
  for (auto g = shape.groups.rbegin(); g != shape.groups.rend(); ++g) {
    index[*g] = point % shape.size.at(*g);
    point /= shape.size.at(*g);
  }
  std::string label;
  for (const auto& a : axes) {
    const toml::node* value = a.values[index[a.group]];
    set_dotted(table, a.key, *value, fmt::format("{} {}", a.origin, a.key));
    label += (label.empty() ? "" : ", ") + a.key + "=" + value_text(*value);
    swept.emplace_back(a.key, json_text(*value));
  }
  return label;
}

toml::table parse_experiment_file(const std::filesystem::path& file) {
  try {
    return toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    if (!std::filesystem::exists(file))
      throw Error(fmt::format("cannot read experiment file {}", file.string()));
    throw Error(fmt::format("{}:{}:{}: {}", file.string(), e.source().begin.line,
                            e.source().begin.column, e.description()));
  }
}

// The axes of a run: the file's, less those the command line decides, then each --sweep's.
std::vector<SweepAxis> run_axes(const toml::table& root, const std::string& file,
                                const CommandLineChanges& changes,
                                std::deque<toml::array>& sweep_arrays,
                                std::vector<std::string>& notes) {
  std::vector<Decider> deciders;
  for (const auto& s : changes.set)
    deciders.push_back({split_assignment(s, "--set").first, "--set " + s});
  for (const auto& s : changes.sweep)
    deciders.push_back({split_assignment(s, "--sweep").first, "--sweep " + s});
  std::vector<SweepAxis> axes = without_decided_axes(file_axes(root, file), deciders, notes);
  std::set<std::string> swept;
  for (const auto& s : changes.sweep) {
    const auto [key, text] = split_assignment(s, "--sweep");
    const std::string origin = "--sweep " + s;
    for (const Decider& d : deciders)
      if (d.typed.starts_with("--set ") && (covers(d.key, key) || covers(key, d.key)))
        throw Error(fmt::format("{} and {} set the same key: keep one", origin, d.typed));
    if (!swept.insert(key).second)
      throw Error(fmt::format("{}: {} is swept twice on the command line", origin, key));
    SweepAxis axis{key, {}, "axis:" + key, "--sweep"};
    for (const auto& v : sweep_arrays.emplace_back(sweep_values(text, origin)))
      axis.values.push_back(&v);
    axes.push_back(std::move(axis));
  }
  return axes;
}

// --set sweep=[...] replaces the file's [[sweep]] whole (zipped axes need it); the other --set
// keys apply to each point.
std::pair<std::vector<std::string>, std::vector<std::string>> whole_sweep_and_keys(
    const std::vector<std::string>& set) {
  std::vector<std::string> whole, keys;
  for (const auto& s : set)
    (split_assignment(s, "--set").first == "sweep" ? whole : keys).push_back(s);
  return {whole, keys};
}

}  // namespace

std::vector<ExperimentRun> load_experiment(const std::filesystem::path& file,
                                           const std::vector<std::string>& overrides) {
  return load_experiment(file, CommandLineChanges{overrides, {}}, nullptr);
}

std::vector<ExperimentRun> load_experiment(const std::filesystem::path& file,
                                           const CommandLineChanges& typed,
                                           std::vector<std::string>* notes) {
  if (std::filesystem::is_directory(file))
    throw Error(
        fmt::format("{} is a folder: kvlab run and check take an experiment file (TOML), "
                    "e.g. experiments/quickstart.toml",
                    file.string()));
  auto [whole_sweep, keys] = whole_sweep_and_keys(typed.set);
  const CommandLineChanges changes{std::move(keys), typed.sweep};
  toml::table root = parse_experiment_file(file);
  apply_overrides(root, whole_sweep);
  std::deque<toml::array> sweep_arrays;  // the --sweep values the axes point into
  std::vector<std::string> told;
  const std::vector<SweepAxis> axes = run_axes(root, file.string(), changes, sweep_arrays, told);
  const SweepShape shape = sweep_shape(axes, file.string());
  if (notes != nullptr) *notes = std::move(told);

  std::vector<ExperimentRun> runs;
  for (std::size_t point = 0; point < shape.points; ++point) {
    // Parsed afresh for every point: copies of toml++ nodes lose their source positions.
    toml::table table = parse_experiment_file(file);
    table.erase("sweep");
    std::vector<std::pair<std::string, std::string>> swept;
    const std::string label = apply_sweep_point(table, axes, shape, point, swept);
    apply_overrides(table, changes.set);  // on top: a key inside a swept table reaches each point
    ExperimentConfig config = parse_config(table, file.string());
    config.label = label;
    config.swept = std::move(swept);
    std::ostringstream resolved;
    resolved << table;
    config.resolved_toml = resolved.str();
    if (runs.size() + static_cast<std::size_t>(config.repeats) > kMaxRuns)
      throw Error(
          fmt::format("{}: sweep points x repeats make more than {} runs (kvlab's limit "
                      "per experiment file)",
                      file.string(), kMaxRuns));
    for (std::int64_t r = 0; r < config.repeats; ++r) {
      ExperimentRun run{config, r};
      run.config.seed = config.seed + static_cast<std::uint64_t>(r);
      run.config.workload.seed = run.config.seed;
      runs.push_back(std::move(run));
    }
  }
  // Timed by the machine, repeats go round: every point's first, then every point's second, so
  // a change in the machine's load hits every point alike.
  const bool machine_timed = std::any_of(runs.begin(), runs.end(), [](const ExperimentRun& r) {
    return r.config.clock == EngineClock::measured || r.config.clock == EngineClock::wall;
  });
  if (machine_timed)
    std::stable_sort(runs.begin(), runs.end(), [](const ExperimentRun& a, const ExperimentRun& b) {
      return a.repeat < b.repeat;
    });
  return runs;
}

}  // namespace kvlab
