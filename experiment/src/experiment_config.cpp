// Parsing and validating experiment files (toml++): every key is known, every value typed,
// every problem reported as file:line:column with a suggestion, before anything runs.
#include <fmt/format.h>

#include <fmt/ranges.h>
#include <cmath>

#include <toml++/toml.h>
#include <algorithm>
#include <filesystem>
#include <limits>
#include <set>
#include <sstream>

#include "experiment_toml.hpp"
#include "kvlab/checked_math.hpp"
#include "kvlab/cpu_reference/weight_choices.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "kvlab/kv_pool.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/suggest.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab {

// Limits on sizes an experiment file sets, checked when it is read (docs/experiments.md).
constexpr std::int64_t kMaxRepeats = 10'000;
constexpr std::int64_t kMaxRequests = 10'000'000;  // per run: the request table stays < ~10 GB
constexpr std::int64_t kMaxThreads = 1024;
namespace {

std::string where(const toml::node& node, const std::string& fallback_file) {
  const auto& source = node.source();
  if (source.begin.line == 0) return fmt::format("{} (set by a sweep or --set)", fallback_file);
  return fmt::format("{}:{}:{}", source.path ? *source.path : fallback_file, source.begin.line,
                     source.begin.column);
}

// Reads one table's keys with their types checked; finish() rejects any key not read.
class Section {
 public:
  Section(const toml::table* table, std::string name, std::string file)
      : table_(table), name_(std::move(name)), file_(std::move(file)) {}

  template <typename T>
  std::optional<T> get(const char* key) {
    known_.insert(key);
    if (table_ == nullptr) return std::nullopt;
    const toml::node* node = table_->get(key);
    if (node == nullptr) return std::nullopt;
    if constexpr (std::is_same_v<T, double>) {
      if (auto v = node->value<double>()) return *v;  // integers convert too
      fail(*node, fmt::format("{}.{} must be a number", name_, key));
    } else if constexpr (std::is_same_v<T, std::int64_t>) {
      if (node->is_integer()) return node->as_integer()->get();
      fail(*node, fmt::format("{}.{} must be an integer", name_, key));
    } else if constexpr (std::is_same_v<T, bool>) {
      if (node->is_boolean()) return node->as_boolean()->get();
      fail(*node, fmt::format("{}.{} must be true or false", name_, key));
    } else {
      if (node->is_string()) return node->as_string()->get();
      fail(*node, fmt::format("{}.{} must be a string", name_, key));
    }
    return std::nullopt;
  }
  // An integer that must fit T and lie in [min, max]: an error naming the key otherwise.
  template <typename T>
  std::optional<T> get_int(const char* key, std::int64_t min, std::int64_t max) {
    const auto value = get<std::int64_t>(key);
    if (!value) return std::nullopt;
    if (*value < min || *value > max || !narrow_integer<T>(*value))
      fail(*node(key), fmt::format("{}.{} = {} is outside [{}, {}]", name_, key, *value, min, max));
    return static_cast<T>(*value);
  }
  const toml::node* node(const char* key) {
    known_.insert(key);
    return table_ ? table_->get(key) : nullptr;
  }
  const toml::table* table(const char* key) {
    const toml::node* n = node(key);
    if (n == nullptr) return nullptr;
    if (!n->is_table()) fail(*n, fmt::format("{}.{} must be a table", name_, key));
    return n->as_table();
  }
  [[noreturn]] void fail(const toml::node& node, const std::string& why) const {
    throw Error(fmt::format("{}: {}", where(node, file_), why));
  }
  void finish() const {
    if (table_ == nullptr) return;
    const std::vector<std::string> names(known_.begin(), known_.end());
    for (const auto& [key, value] : *table_) {
      if (known_.count(std::string(key.str()))) continue;
      std::string message = fmt::format("unknown key \"{}\" in [{}]", key.str(), name_);
      if (auto near = nearest_name(key.str(), names))
        message += fmt::format(" (did you mean \"{}\"?)", *near);
      message += "; keys: " + join_names(names);
      const auto& at = key.source();
      if (at.begin.line > 0)
        throw Error(fmt::format("{}:{}:{}: {}", at.path ? *at.path : file_, at.begin.line,
                                at.begin.column, message));
      fail(value, message);
    }
  }
  const std::string& file() const { return file_; }
  const std::string& name() const { return name_; }
  const toml::table* table_itself() const { return table_; }

 private:
  const toml::table* table_;
  std::string name_, file_;
  std::set<std::string> known_;
};

ParamMap plugin_params(Section& section, const char* key) {
  ParamMap params;
  const toml::table* table = section.table(key);
  if (table == nullptr) return params;
  for (const auto& [name, value] : *table) {
    if (value.is_integer())
      params[std::string(name.str())] = value.as_integer()->get();
    else if (value.is_floating_point())
      params[std::string(name.str())] = value.as_floating_point()->get();
    else if (value.is_boolean())
      params[std::string(name.str())] = value.as_boolean()->get();
    else if (value.is_string())
      params[std::string(name.str())] = value.as_string()->get();
    else
      section.fail(value, fmt::format("plugin parameter \"{}\" must be a number, boolean or string",
                                      name.str()));
  }
  return params;
}

LengthDistribution length(Section& parent, const char* key, LengthDistribution fallback) {
  const toml::table* table = parent.table(key);
  if (table == nullptr) return fallback;
  Section s(table, fmt::format("workload.{}", key), parent.file());
  LengthDistribution d = fallback;
  const std::string kind = s.get<std::string>("dist").value_or("fixed");
  static const std::map<std::string, LengthKind> kinds{{"fixed", LengthKind::fixed},
                                                       {"uniform", LengthKind::uniform},
                                                       {"normal", LengthKind::normal},
                                                       {"lognormal", LengthKind::lognormal},
                                                       {"zipf", LengthKind::zipf}};
  auto it = kinds.find(kind);
  if (it == kinds.end())
    s.fail(*s.node("dist"),
           fmt::format("dist \"{}\" is not one of fixed, uniform, normal, lognormal, zipf", kind));
  d.kind = it->second;
  d.value = s.get<double>("value").value_or(d.value);
  d.mean = s.get<double>("mean").value_or(d.mean);
  d.stddev = s.get<double>("stddev").value_or(d.stddev);
  d.alpha = s.get<double>("alpha").value_or(d.alpha);
  d.min = s.get<std::int64_t>("min").value_or(d.min);
  d.max = s.get<std::int64_t>("max").value_or(d.max);
  // A fixed length is what it says: the default clamp (max 4096) does not cut it silently.
  if (d.kind == LengthKind::fixed && !s.node("max") && d.value > static_cast<double>(d.max))
    d.max = static_cast<std::int64_t>(std::ceil(d.value));
  s.finish();
  return d;
}

// Relative paths in an experiment file name files next to it, wherever kvlab runs from: the
// model folder (not a preset name), a profile file (not a profile name), the trace, plugin
// folders and the output folder. Normalised lexically, so experiments/../results stays in the
// tree the file was reached through (symlinked folders included).
void resolve_relative_paths(ExperimentConfig& c, const std::string& file) {
  const std::filesystem::path folder = std::filesystem::path(file).parent_path();
  auto resolve = [&](std::string& path) {
    if (path.empty() || std::filesystem::path(path).is_absolute() || folder.empty()) return;
    path = (folder / path).lexically_normal().string();
  };
  const auto presets = model_preset_names();
  if (std::find(presets.begin(), presets.end(), c.model) == presets.end()) resolve(c.model);
  if (c.profile.find('/') != std::string::npos || c.profile.ends_with(".toml")) resolve(c.profile);
  resolve(c.trace);
  resolve(c.azure_trace);
  resolve(c.prompt_set);
  resolve(c.eval.filler);
  resolve(c.output_dir);
  resolve(c.disk_tier_directory);
  resolve(c.speculation.accept_trace);
  if (!c.draft_model.empty() &&
      std::find(presets.begin(), presets.end(), c.draft_model) == presets.end())
    resolve(c.draft_model);
  for (auto& p : c.plugin_paths) resolve(p);
}

// One parser per section of the file (docs/experiments.md): each reads its keys into the
// config and fails with file:line:column on a bad value.
void parse_experiment(Section& s, ExperimentConfig& c) {
  c.name = s.get<std::string>("name").value_or(c.name);
  c.seed = static_cast<std::uint64_t>(s.get<std::int64_t>("seed").value_or(0));
  if (s.get<std::int64_t>("seed").value_or(0) < 0)  // -1 would read as 2^64 - 1
    s.fail(*s.node("seed"), "experiment.seed must be >= 0");
  c.repeats = s.get_int<std::int64_t>("repeats", 1, kMaxRepeats).value_or(1);
  const std::string clock = s.get<std::string>("clock").value_or(clock_name(c.clock));
  const std::optional<EngineClock> parsed = clock_from_name(clock);
  if (!parsed || *parsed == EngineClock::steps)
    s.fail(*s.node("clock"),
           fmt::format("experiment.clock \"{}\" is not one of virtual, offline, measured, wall",
                       clock));
  c.clock = *parsed;
  if (const toml::node* paths = s.node("plugin_paths")) {
    if (!paths->is_array()) s.fail(*paths, "experiment.plugin_paths must be a list of folders");
    for (const auto& p : *paths->as_array()) {
      if (!p.is_string()) s.fail(p, "experiment.plugin_paths entries must be strings");
      c.plugin_paths.push_back(p.as_string()->get());
    }
  }
}

void parse_model(Section& s, ExperimentConfig& c) {
  c.model = s.get<std::string>("name").value_or("stories15m");
  c.weights_seed = static_cast<std::uint64_t>(s.get<std::int64_t>("weights_seed").value_or(0));
  if (s.get<std::int64_t>("weights_seed").value_or(0) < 0)
    s.fail(*s.node("weights_seed"), "model.weights_seed must be >= 0");
}

}  // namespace

BackendKind backend_kind_of(std::string_view name) {
  return name == "cpu"         ? BackendKind::cpu
         : name == "simulated" ? BackendKind::simulated
                               : BackendKind::plugin;
}

namespace {

// The cpu backend's formats: backend.weights / backend.activations, or the same as its plugin
// parameters (backend.params.weights / .activations), parsed here into the typed fields (and
// given back to the plugin as parameters by backend_params).
void parse_cpu_formats(Section& s, ExperimentConfig& c) {
  auto name_of = [&](const char* key) -> std::optional<std::pair<std::string, const toml::node*>> {
    const toml::node* node = s.node(key);
    const auto param = c.backend_params.find(key);
    const bool in_params = c.backend_kind == BackendKind::cpu && param != c.backend_params.end();
    if (node != nullptr && c.backend_kind != BackendKind::cpu)
      s.fail(*node, fmt::format("backend.{} is the cpu backend's; backend \"{}\" takes its own "
                                "parameters",
                                key, c.backend));
    if (node != nullptr && in_params)
      s.fail(*node, fmt::format("backend.{} and backend.params.{} name one parameter: keep one",
                                key, key));
    if (node != nullptr) return std::pair{s.get<std::string>(key).value_or(""), node};
    if (!in_params) return std::nullopt;
    const auto* text = std::get_if<std::string>(&param->second);
    std::pair<std::string, const toml::node*> named{text ? *text : "", s.node("params")};
    c.backend_params.erase(param);
    return named;
  };
  if (const auto weights = name_of("weights")) {
    const auto& choices = cpu::kWeightChoices;
    if (std::find(choices.begin(), choices.end(), weights->first) == choices.end())
      s.fail(*weights->second, fmt::format("backend.weights must be one of {}, not \"{}\"",
                                           fmt::join(choices, ", "), weights->first));
    c.cpu_weights = cpu::weight_format_from_name(weights->first);  // nullopt: "stored"
  }
  if (const auto activations = name_of("activations")) {
    const auto format = cpu::activation_format_from_name(activations->first);
    if (!format)
      s.fail(*activations->second,
             fmt::format("backend.activations must be one of {}, not \"{}\"",
                         fmt::join(cpu::kActivationChoices, ", "), activations->first));
    c.cpu_activations = *format;
  }
}

void parse_backend(Section& s, const toml::node& where, ExperimentConfig& c) {
  c.backend = s.get<std::string>("name").value_or(c.backend);  // cpu, simulated or a plugin
  c.backend_kind = backend_kind_of(c.backend);
  c.threads = s.get_int<int>("threads", 0, kMaxThreads).value_or(0);
  c.profile = s.get<std::string>("profile").value_or("");
  c.tensor_parallel = s.get_int<std::int64_t>("tensor_parallel", 1, 1024).value_or(1);
  c.context_parallel = s.get_int<std::int64_t>("context_parallel", 1, 1024).value_or(1);
  for (const auto& [key, value] : {std::pair{"tensor_parallel", c.tensor_parallel},
                                   std::pair{"context_parallel", c.context_parallel}})
    if (value > 1 && c.backend_kind != BackendKind::simulated)
      s.fail(*s.node(key), fmt::format("backend.{} is the simulated backend's GPUs per model; "
                                       "backend \"{}\" computes on one device",
                                       key, c.backend));
  c.backend_params = plugin_params(s, "params");
  parse_cpu_formats(s, c);
  if (c.backend_kind == BackendKind::cpu && c.profile.empty()) c.profile = kDefaultCpuProfile;
  if (c.backend_kind == BackendKind::simulated && c.profile.empty())
    s.fail(where,
           fmt::format("backend \"simulated\" needs backend.profile: a name ({}) or a .toml file",
                       join_names(hardware_profile_names())));
}

// kv_cache.KEY, a dtype the KV pool holds, when the table gives it.
std::optional<DType> kv_pool_dtype_at(Section& s, const char* key) {
  const toml::node* node = s.node(key);
  if (node == nullptr) return std::nullopt;
  const std::string name = s.get<std::string>(key).value_or("");
  const auto parsed = dtype_from_short_name(name);
  if (!parsed || !kv_pool_holds(*parsed))
    s.fail(*node, fmt::format("kv_cache.{} must be one of {}, not \"{}\"", key,
                              kv_pool_dtype_names(), name));
  return parsed;
}

void parse_kv_cache(Section& s, ExperimentConfig& c) {
  c.allocator = s.get<std::string>("allocator").value_or(c.allocator);
  c.kv_slots = s.get<std::int64_t>("slots");
  if (c.kv_slots && *c.kv_slots < 1) s.fail(*s.node("slots"), "kv_cache.slots must be >= 1");
  c.kv_memory_mib = s.get<double>("memory_mib");
  c.kv_dtype = kv_pool_dtype_at(s, "dtype").value_or(c.kv_dtype);
  c.kv_value_dtype = kv_pool_dtype_at(s, "value_dtype");
  if (const toml::node* rotation = s.node("rotation")) {
    const std::string name = s.get<std::string>("rotation").value_or("");
    if (name != "none" && name != "hadamard")
      s.fail(*rotation,
             fmt::format("kv_cache.rotation must be \"none\" or \"hadamard\", not \"{}\"", name));
    c.kv_hadamard = name == "hadamard";
  }
  c.kivi_residual = s.get_int<std::int64_t>("residual_length", 0, kKiviResidualMost)
                        .value_or(kKiviResidualDefault);
  if (!kivi_residual_valid(c.kivi_residual))
    s.fail(*s.node("residual_length"),
           fmt::format("kv_cache.residual_length is KIVI's fp16 tokens in whole groups of {}: a "
                       "multiple of {}, not {}",
                       kKiviGroup, kKiviGroup, c.kivi_residual));
  if (const toml::node* groups = s.node("groups")) {
    const std::string name = s.get<std::string>("groups").value_or("");
    if (name != "uniform" && name != "per_kind")
      s.fail(*groups,
             fmt::format("kv_cache.groups must be \"uniform\" or \"per_kind\", not \"{}\"", name));
    c.kv_groups = name == "per_kind";
  }
  c.swap_slots = s.get<std::int64_t>("swap_slots").value_or(0);
  if (c.swap_slots < 0) s.fail(*s.node("swap_slots"), "kv_cache.swap_slots must be >= 0");
  if (const toml::node* old = s.node("swap_gb_per_s"))
    s.fail(*old,
           "kv_cache.swap_gb_per_s is gone: the swap link is the hardware profile's [link] "
           "swap_gb_per_s and swap_latency_s (backend.profile)");
  if (c.kv_memory_mib && !(*c.kv_memory_mib > 0))
    s.fail(*s.node("memory_mib"), "kv_cache.memory_mib must be > 0");
  c.allocator_params = plugin_params(s, "params");
}

void parse_attention(Section& s, ExperimentConfig& c) {
  c.attention = s.get<std::string>("variant").value_or(c.attention);
  c.attention_params = plugin_params(s, "params");
}

void parse_scheduler(Section& s, ExperimentConfig& c) {
  c.scheduler = s.get<std::string>("name").value_or(c.scheduler);
  c.scheduler_params = plugin_params(s, "params");
}

// A recorded trace's window and rate scale (and its length scale where `lengths`), from `table`.
ReplayWindow parse_window(Section& s, const toml::table& table, bool lengths) {
  ReplayWindow w;
  w.start_s = s.get<double>("start_s").value_or(0);
  w.duration_s = s.get<double>("duration_s").value_or(0);
  w.rate_scale = s.get<double>("rate_scale").value_or(1.0);
  if (lengths) w.length_scale = s.get<double>("length_scale").value_or(1.0);
  w.max_requests = s.get_int<std::int64_t>("max_requests", 0, kMaxRequests).value_or(0);
  if (!(w.start_s >= 0) || !(w.duration_s >= 0) || !(w.rate_scale > 0) ||
      !std::isfinite(w.start_s) || !std::isfinite(w.duration_s) || !std::isfinite(w.rate_scale))
    s.fail(table, fmt::format("{}: start_s, duration_s >= 0 and rate_scale > 0, finite", s.name()));
  if (!(w.length_scale > 0 && w.length_scale <= 1))
    s.fail(*s.node("length_scale"), fmt::format("{}.length_scale must be in (0, 1]", s.name()));
  return w;
}

void parse_azure_trace(Section& workload, ExperimentConfig& c) {
  const toml::table* table = workload.table("azure_trace");
  if (table == nullptr) return;
  Section s(table, "workload.azure_trace", workload.file());
  const auto file = s.get<std::string>("file");
  if (!file) s.fail(*table, "[workload.azure_trace] needs file = \"...csv\"");
  c.azure_trace = *file;
  c.azure = parse_window(s, *table, false);
  s.finish();
}

void parse_trace_replay(Section& workload, ExperimentConfig& c) {
  const toml::table* table = workload.table("replay");
  if (table == nullptr) return;
  Section s(table, "workload.replay", workload.file());
  if (c.trace.empty())
    s.fail(*table,
           "[workload.replay] replays a part of workload.trace (a Mooncake trace): give "
           "trace = \"...jsonl\"");
  c.replay_given = true;
  c.replay = parse_window(s, *table, true);
  s.finish();
}

void parse_prompt_set(Section& workload, ExperimentConfig& c) {
  const toml::table* table = workload.table("prompts");
  if (table == nullptr) return;
  Section s(table, "workload.prompts", workload.file());
  const auto file = s.get<std::string>("file");
  if (!file) s.fail(*table, "[workload.prompts] needs file = \"...jsonl\"");
  c.prompt_set = *file;
  c.prompt_chat = s.get<bool>("chat").value_or(true);
  c.prompt_max_tokens =
      s.get_int<std::int32_t>("max_tokens", 1, kMaxRequestTokens).value_or(c.prompt_max_tokens);
  c.prompt_requests = s.get_int<std::int64_t>("requests", 0, kMaxRequests).value_or(0);
  s.finish();
}

// A latency target in seconds (finite, > 0) from `s`, or none.
std::optional<double> slo_seconds(Section& s, const char* key, const std::string& table) {
  const auto seconds = s.get<double>(key);
  if (seconds && !(*seconds > 0 && std::isfinite(*seconds)))  // NaN met nothing and said so
    s.fail(*s.node(key), fmt::format("{}.{} must be a finite number of seconds > 0", table, key));
  return seconds;
}

// [[workload.tenants]]: name, share, and the tenant's own ttft_s / tpot_s / e2e_s.
void parse_tenants(Section& workload, ExperimentConfig& c) {
  const toml::node* list = workload.node("tenants");
  if (list == nullptr) return;
  if (!list->is_array_of_tables())
    workload.fail(*list,
                  "workload.tenants must be a list of tables ([[workload.tenants]] name = ..., "
                  "share = ...)");
  std::size_t i = 0;
  for (const toml::node& entry : *list->as_array()) {
    const std::string table = fmt::format("workload.tenants[{}]", i++);
    Section s(entry.as_table(), table, workload.file());
    TenantSpec& t = c.tenants.emplace_back();
    const auto name = s.get<std::string>("name");
    if (!name) s.fail(entry, table + " needs name = \"...\"");
    try {
      t.name = check_tenant_name(*name);
    } catch (const Error& e) {
      s.fail(*s.node("name"), e.what());
    }
    t.share = s.get<double>("share");
    if (t.share && !(*t.share >= 0 && std::isfinite(*t.share)))
      s.fail(*s.node("share"), table + ".share must be a finite number >= 0");
    t.slo = {slo_seconds(s, "ttft_s", table), slo_seconds(s, "tpot_s", table),
             slo_seconds(s, "e2e_s", table)};
    s.finish();
    for (std::size_t other = 0; other + 1 < c.tenants.size(); ++other)
      if (c.tenants[other].name == t.name)
        s.fail(entry, fmt::format("tenant \"{}\" is listed twice in workload.tenants", t.name));
  }
  double shares = 0;
  for (const TenantSpec& t : c.tenants) shares += t.share.value_or(1.0);
  if (!(shares > 0))
    workload.fail(*list, "the shares of workload.tenants must have a positive sum");
}

void parse_workload(Section& s, ExperimentConfig& c) {
  SyntheticWorkload& w = c.workload;
  if (const toml::table* given = s.table_itself())
    for (const auto& [key, value] : *given) c.workload_keys_given.emplace_back(key.str());
  w.requests = s.get_int<std::int64_t>("requests", 1, kMaxRequests).value_or(w.requests);
  const std::string arrival = s.get<std::string>("arrival").value_or("all_at_once");
  static const std::map<std::string, ArrivalKind> arrivals{
      {"all_at_once", ArrivalKind::all_at_once},
      {"poisson", ArrivalKind::poisson},
      {"gamma", ArrivalKind::gamma},
      {"bursts", ArrivalKind::bursts}};
  auto it = arrivals.find(arrival);
  if (it == arrivals.end())
    s.fail(
        *s.node("arrival"),
        fmt::format("arrival \"{}\" is not one of all_at_once, poisson, gamma, bursts", arrival));
  w.arrival.kind = it->second;
  w.arrival.rate_per_s = s.get<double>("rate").value_or(w.arrival.rate_per_s);
  w.arrival.cv = s.get<double>("cv").value_or(w.arrival.cv);
  w.arrival.burst_size = s.get<std::int64_t>("burst_size").value_or(w.arrival.burst_size);
  w.prompt_tokens = length(s, "prompt_tokens", w.prompt_tokens);
  w.output_tokens = length(s, "output_tokens", {LengthKind::fixed, 32});
  w.prefix_groups = s.get<std::int64_t>("prefix_groups").value_or(0);
  w.prefix_tokens = s.get<std::int64_t>("prefix_tokens").value_or(0);
  if (const toml::node* weights = s.node("priority_weights")) {
    if (!weights->is_array())
      s.fail(*weights, "workload.priority_weights must be a list of numbers");
    w.priority_weights.clear();
    for (const auto& v : *weights->as_array()) {
      auto number = v.value<double>();
      if (!number) s.fail(v, "workload.priority_weights entries must be numbers");
      w.priority_weights.push_back(*number);
    }
  }
  w.temperature = s.get<double>("temperature").value_or(0.0);
  w.top_p = s.get<double>("top_p").value_or(1.0);
  w.top_k =
      s.get_int<std::int32_t>("top_k", 0, std::numeric_limits<std::int32_t>::max()).value_or(0);
  w.logprobs = s.get_int<std::int32_t>("logprobs", 0, kMaxLogprobs).value_or(-1);
  if (w.logprobs >= 0 && c.backend_kind == BackendKind::simulated)
    s.fail(*s.node("logprobs"),
           "workload.logprobs needs a backend with logits (cpu, or a plugin such as cuda): the "
           "simulated backend picks its tokens without any");
  w.ignore_eos = s.get<bool>("ignore_eos").value_or(true);
  c.trace = s.get<std::string>("trace").value_or("");
  parse_tenants(s, c);
  parse_trace_replay(s, c);
  parse_azure_trace(s, c);
  parse_prompt_set(s, c);
  const int sources = !c.trace.empty() + !c.azure_trace.empty() + !c.prompt_set.empty();
  if (sources > 1)
    s.fail(*s.node(c.trace.empty() ? "azure_trace" : "trace"),
           "workload: give at most one of trace, [workload.azure_trace], [workload.prompts]");
}

void parse_slo(Section& s, ExperimentConfig& c) {
  c.slo = {slo_seconds(s, "ttft_s", "slo"), slo_seconds(s, "tpot_s", "slo"),
           slo_seconds(s, "e2e_s", "slo")};
}

void parse_output(Section& s, ExperimentConfig& c) {
  c.output_dir = s.get<std::string>("dir").value_or("");
  c.frame_budget = s.get_int<std::int64_t>("frames", 0, 1'000'000'000).value_or(c.frame_budget);
  const toml::node* columns = s.node("columns");
  if (columns == nullptr) return;
  const toml::array* list = columns->as_array();
  if (list == nullptr) s.fail(*columns, "output.columns must be an array of column names");
  const std::vector<std::string> known = metric_column_options();
  for (const toml::node& item : *list) {
    const auto name = item.value<std::string>();
    if (!name)
      s.fail(item,
             fmt::format("output.columns holds column names (strings): {}", join_names(known)));
    if (std::find(known.begin(), known.end(), *name) == known.end())
      s.fail(item, fmt::format("output.columns: \"{}\" is not a column; choose from {}", *name,
                               join_names(known)));
    c.table_columns.push_back(*name);
  }
}

// [kv_policy]: which cached positions each sequence keeps under a KV budget.
void parse_kv_policy(Section& s, ExperimentConfig& c) {
  if (s.table_itself() == nullptr) return;  // no table: every position kept
  const auto name = s.get<std::string>("name");
  if (!name || name->empty())
    s.fail(s.node("name") ? *s.node("name") : *s.table_itself(),
           "[kv_policy] needs name: window, streaming_llm, h2o, snapkv or a kv_policy "
           "plugin (leave the table out to keep every position)");
  c.kv_policy = *name;
  c.kv_policy_params = plugin_params(s, "params");  // the rest: validate_points (per point)
}

// speculation.adaptive: false, true (= "priced"), "priced" or "measured".
AdaptiveLength adaptive_length(Section& s) {
  const toml::node* node = s.node("adaptive");
  if (node == nullptr) return AdaptiveLength::off;
  if (node->is_boolean())
    return node->as_boolean()->get() ? AdaptiveLength::priced : AdaptiveLength::off;
  if (node->is_string() && node->as_string()->get() == "priced") return AdaptiveLength::priced;
  if (node->is_string() && node->as_string()->get() == "measured") return AdaptiveLength::measured;
  s.fail(*node,
         "speculation.adaptive is false, true or \"priced\" (each length's step priced by the "
         "hardware profile) or \"measured\" (by the times of the steps run so far)");
}

// speculation.draft_model / draft_layers: the draft model a proposer runs (the draft proposer;
// on the simulated backend, what the draft's steps cost).
void parse_draft(Section& s, ExperimentConfig& c) {
  c.draft_model = s.get<std::string>("draft_model").value_or("");
  c.draft_layers = s.get_int<std::int64_t>("draft_layers", 1, 1024).value_or(0);
  if (!c.draft_model.empty() && c.draft_layers > 0)
    s.fail(*s.node("draft_layers"),
           "speculation.draft_model and draft_layers both name the draft: give one (draft_layers: "
           "the target's own first layers)");
  const bool has_draft = !c.draft_model.empty() || c.draft_layers > 0;
  const std::string& proposer = c.speculation.proposer;
  if (proposer == "draft" && !has_draft)
    s.fail(*s.node("proposer"),
           "speculation.proposer \"draft\" runs a draft model: name it with draft_model (a "
           "preset or model path with the target's vocabulary) or draft_layers (the target's "
           "first layers: self-speculation)");
  if (has_draft && proposer == "prompt_lookup")
    s.fail(*s.node(c.draft_layers > 0 ? "draft_layers" : "draft_model"),
           "speculation.draft_model / draft_layers: prompt_lookup runs no draft; use proposer = "
           "\"draft\" (or \"simulated\" on the simulated backend, to price the draft's steps)");
}

// The built-in proposers' settings (their plugins' params: proposer_params): prompt_lookup's
// n-gram range, simulated's acceptance.
void parse_builtin_proposer_keys(Section& s, ExperimentConfig& c) {
  SpeculationOptions& spec = c.speculation;
  const bool simulated = spec.proposer == "simulated";
  spec.lookup.max_ngram = s.get_int<std::int64_t>("max_ngram", 1, 64).value_or(3);
  spec.lookup.min_ngram = s.get_int<std::int64_t>("min_ngram", 1, 64).value_or(1);
  for (const char* key : {"min_ngram", "max_ngram"})
    if (s.node(key) != nullptr && spec.proposer != "prompt_lookup")
      s.fail(*s.node(key), fmt::format("speculation.{} is prompt_lookup's n-gram range: the {} "
                                       "proposer has none",
                                       key, spec.proposer));
  if (spec.lookup.min_ngram > spec.lookup.max_ngram)
    s.fail(*s.node("min_ngram"),
           fmt::format("speculation.min_ngram ({}) must not exceed max_ngram ({})",
                       spec.lookup.min_ngram, spec.lookup.max_ngram));
  spec.acceptance_rate = s.get<double>("acceptance_rate").value_or(spec.acceptance_rate);
  if (!(spec.acceptance_rate >= 0 && spec.acceptance_rate <= 1))
    s.fail(*s.node("acceptance_rate"), "speculation.acceptance_rate must be in [0, 1]");
  if (s.node("acceptance_rate") != nullptr && !simulated)
    s.fail(*s.node("acceptance_rate"),
           "speculation.acceptance_rate is the simulated proposer's: a computed proposal's "
           "acceptance is what the models and the text make it");
  spec.accept_trace = s.get<std::string>("accept_trace").value_or("");
  if (const toml::node* trace = s.node("accept_trace")) {
    if (!simulated)
      s.fail(*trace,
             "speculation.accept_trace is the simulated proposer's: it replays a measured run's "
             "acceptance on the simulated backend (proposer = \"simulated\")");
    if (s.node("acceptance_rate") != nullptr)
      s.fail(*trace,
             "speculation.accept_trace and acceptance_rate both say how often a proposal "
             "is right: give one");
  }
  spec.seed = static_cast<std::uint64_t>(c.seed);
}

// [speculation]: speculative decoding (kvlab/speculation/speculation.hpp): which proposer plugin
// (and draft model), how many proposals per decode, fixed or adaptive.
void parse_speculation(Section& s, ExperimentConfig& c) {
  if (s.table_itself() == nullptr) return;  // no table: off
  SpeculationOptions& spec = c.speculation;
  spec.proposer = s.get<std::string>("proposer").value_or("prompt_lookup");
  if (spec.proposer == "simulated" && c.backend_kind != BackendKind::simulated)
    s.fail(*s.node("proposer"),
           "speculation.proposer \"simulated\" proposes the simulated backend's own tokens at "
           "acceptance_rate: it needs backend.name = \"simulated\" (use \"prompt_lookup\" or "
           "\"draft\" on a backend that computes)");
  if (spec.proposer == "draft" && c.backend_kind != BackendKind::cpu)
    s.fail(*s.node("proposer"),
           "speculation.proposer \"draft\" runs the draft model on the cpu backend beside the "
           "target: it needs backend.name = \"cpu\" (on the simulated backend, proposer = "
           "\"simulated\" with draft_model or draft_layers prices the draft's steps)");
  c.proposer_params = plugin_params(s, "params");
  if ((spec.proposer == "prompt_lookup" || spec.proposer == "simulated") &&
      !c.proposer_params.empty())
    s.fail(*s.node("params"),
           fmt::format("speculation.params: the {} proposer's settings are keys of [speculation] "
                       "itself",
                       spec.proposer));
  parse_builtin_proposer_keys(s, c);
  parse_draft(s, c);
  spec.tokens = s.get_int<std::int64_t>("tokens", 0, 64).value_or(4);
  spec.adaptive = adaptive_length(s);
  if (spec.enabled() && !c.kv_policy.empty())
    s.fail(s.node("tokens") != nullptr ? *s.node("tokens") : *s.table_itself(),
           "[speculation] with [kv_policy]: a rejected proposal is rolled back by truncating the "
           "sequence, which a policy's dropped positions prevent; drop one of the two tables");
}

// [kv_tiers]: host memory and disk below the paged allocator's prefix cache.
void parse_kv_tiers(Section& s, ExperimentConfig& c) {
  auto gib = [&](const char* key) {
    const double value = s.get<double>(key).value_or(0);
    if (!(value >= 0) || value > 1e6)
      s.fail(*s.node(key), fmt::format("kv_tiers.{} must be in [0, 1e6] GiB", key));
    return value;
  };
  c.host_tier_gib = gib("host_gib");
  c.disk_tier_gib = gib("disk_gib");
  c.tier_policy = s.get<std::string>("policy").value_or(c.tier_policy);
  c.tier_policy_params = plugin_params(s, "params");
  c.disk_tier_directory = s.get<std::string>("disk_directory").value_or("");
  if (c.disk_tier_gib > 0 && c.host_tier_gib <= 0)
    s.fail(*s.node("disk_gib"),
           "kv_tiers.disk_gib: the disk tier sits below host memory (blocks reach it when host "
           "memory gives them up): set kv_tiers.host_gib too");
  if (c.has_kv_tiers() && c.allocator != "paged")
    s.fail(*s.node(c.host_tier_gib > 0 ? "host_gib" : "disk_gib"),
           fmt::format("[kv_tiers] keeps the prefix cache's evicted blocks: it needs "
                       "kv_cache.allocator = \"paged\" (not \"{}\")",
                       c.allocator));
}

// [cluster]: replicas of the whole serving stack behind a router plugin.
void parse_cluster(Section& s, ExperimentConfig& c) {
  c.replicas = s.get_int<std::int64_t>("replicas", 1, 1024).value_or(1);
  c.router = s.get<std::string>("router").value_or(c.router);
  c.router_params = plugin_params(s, "params");
  c.prefill_replicas = s.get_int<std::int64_t>("prefill_replicas", 0, 1023).value_or(0);
  if (c.prefill_replicas >= c.replicas && c.prefill_replicas > 0)
    s.fail(*s.node("prefill_replicas"),
           fmt::format("cluster.prefill_replicas ({}) leaves no decode replica of {}: it must be "
                       "below cluster.replicas",
                       c.prefill_replicas, c.replicas));
  c.decode_router = s.get<std::string>("decode_router").value_or(c.router);
  c.decode_router_params =
      s.node("decode_params") != nullptr ? plugin_params(s, "decode_params") : c.router_params;
  for (auto [key, target] : {std::pair{"prefill_tensor_parallel", &c.prefill_tensor_parallel},
                             std::pair{"decode_tensor_parallel", &c.decode_tensor_parallel}}) {
    *target = s.get_int<std::int64_t>(key, 1, 1024);
    if (!*target) continue;
    if (!c.disaggregated())
      s.fail(*s.node(key), fmt::format("cluster.{} is a side's GPUs per replica in a "
                                       "disaggregated cluster: set cluster.prefill_replicas",
                                       key));
    if (**target > 1 && c.backend_kind != BackendKind::simulated)
      s.fail(*s.node(key), fmt::format("cluster.{} is the simulated backend's GPUs per replica; "
                                       "backend \"{}\" computes on one device",
                                       key, c.backend));
  }
}

// An array of numbers under `key`, each in [min, max]; empty when the key is absent.
template <typename T>
std::vector<T> number_array(Section& s, const char* key, double min, double max) {
  std::vector<T> values;
  const toml::node* node = s.node(key);
  if (node == nullptr) return values;
  const toml::array* array = node->as_array();
  if (array == nullptr || array->empty())
    s.fail(*node, fmt::format("{}.{} must be a non-empty array of numbers", s.name(), key));
  for (const toml::node& item : *array) {
    const std::optional<double> value = item.value<double>();
    const bool whole = !std::is_integral_v<T> || item.is_integer();
    if (!value || !whole || *value < min || *value > max)
      s.fail(item, fmt::format("{}.{}: each must be {} in [{}, {}]", s.name(), key,
                               std::is_integral_v<T> ? "an integer" : "a number", min, max));
    values.push_back(static_cast<T>(*value));
  }
  return values;
}

// [eval]: kvlab eval's retrieval task.
void parse_eval(Section& s, ExperimentConfig& c) {
  if (s.table_itself() == nullptr) return;
  EvalSpec& e = c.eval;
  e.task = s.get<std::string>("task").value_or("passkey");
  if (e.task != "passkey" && e.task != "needle")
    s.fail(*s.node("task"), fmt::format("eval.task \"{}\" is not passkey or needle", e.task));
  const auto filler = s.get<std::string>("filler");
  if (!filler) s.fail(*s.table_itself(), "[eval] needs filler = \"a text file\" (WikiText-2)");
  e.filler = *filler;
  e.lengths = number_array<std::int64_t>(s, "lengths", 64, 1 << 20);
  e.depths = number_array<double>(s, "depths", 0, 1);
  if (e.lengths.empty() || e.depths.empty())
    s.fail(*s.table_itself(), "[eval] needs lengths = [tokens, ...] and depths = [0 to 1, ...]");
  e.samples = s.get_int<std::int64_t>("samples", 1, 10000).value_or(1);
  e.answer_tokens = s.get_int<std::int32_t>("answer_tokens", 1, 1024).value_or(e.answer_tokens);
}

}  // namespace

ExperimentConfig parse_config(const toml::table& root, const std::string& file) {
  ExperimentConfig c;
  Section top(&root, "top level", file);
  // Each section through its parser; unknown keys fail when the section finishes.
  auto section = [&](const char* name, auto parse) {
    Section s(top.table(name), name, file);
    parse(s);
    s.finish();
  };
  section("experiment", [&](Section& s) { parse_experiment(s, c); });
  section("model", [&](Section& s) { parse_model(s, c); });
  section("backend", [&](Section& s) {
    parse_backend(s, top.table("backend") != nullptr ? *top.table("backend") : root, c);
  });
  section("kv_cache", [&](Section& s) { parse_kv_cache(s, c); });
  section("attention", [&](Section& s) { parse_attention(s, c); });
  section("scheduler", [&](Section& s) { parse_scheduler(s, c); });
  section("workload", [&](Section& s) { parse_workload(s, c); });
  section("slo", [&](Section& s) { parse_slo(s, c); });
  section("cluster", [&](Section& s) { parse_cluster(s, c); });
  section("kv_tiers", [&](Section& s) { parse_kv_tiers(s, c); });
  section("kv_policy", [&](Section& s) { parse_kv_policy(s, c); });
  section("speculation", [&](Section& s) { parse_speculation(s, c); });
  section("eval", [&](Section& s) { parse_eval(s, c); });
  if (const toml::node* gone = root.get("time_model"))
    top.fail(*gone,
             "[time_model] is gone: the virtual clock prices each step with the roofline cost "
             "model of backend.profile (\"cpu\" by default for the cpu backend; kvlab calibrate "
             "writes one for your machine); delete the table");
  section("output", [&](Section& s) { parse_output(s, c); });
  if (const toml::table* hardware = top.table("hardware")) {
    if (c.profile.empty())
      top.fail(*hardware, "[hardware] changes keys of backend.profile, and this run has none");
    std::ostringstream text;
    text << *hardware;
    c.hardware_changes = text.str();
  }
  top.node("sweep");
  top.finish();
  c.workload.seed = c.seed;
  resolve_relative_paths(c, file);
  return c;
}

// Sets a dotted key ("scheduler.params.max_batch") in the table, creating tables on the way.
void set_dotted(toml::table& root, const std::string& key, const toml::node& value,
                const std::string& origin) {
  toml::table* table = &root;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = key.find('.', start);
    const std::string part =
        key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) throw Error(fmt::format("{}: \"{}\" is not a dotted key", origin, key));
    if (dot == std::string::npos) {
      table->insert_or_assign(part, value);
      return;
    }
    if (table->get(part) == nullptr) table->insert(part, toml::table{});
    toml::node* next = table->get(part);
    if (!next->is_table())
      throw Error(fmt::format("{}: \"{}\" is not a table in \"{}\"", origin, part, key));
    table = next->as_table();
    start = dot + 1;
  }
}

std::vector<SweepTable> read_sweep_tables(const toml::table& root, const std::string& file) {
  std::vector<SweepTable> tables;
  const toml::node* sweep = root.get("sweep");
  if (sweep == nullptr) return tables;
  if (!sweep->is_array_of_tables())
    throw Error(fmt::format("{}: [[sweep]] must be an array of tables", where(*sweep, file)));
  for (const auto& entry : *sweep->as_array()) {
    Section s(entry.as_table(), "sweep", file);
    SweepTable t;
    t.key = s.get<std::string>("key").value_or("");
    if (t.key.empty()) s.fail(entry, "[[sweep]] needs key = \"section.field\"");
    if (t.key == "sweep" || t.key.starts_with("sweep."))
      s.fail(*s.node("key"), "[[sweep]] cannot sweep the sweep itself");
    const toml::node* values = s.node("values");
    if (values == nullptr || !values->is_array() || values->as_array()->empty())
      s.fail(entry, "[[sweep]] needs a non-empty values = [...]");
    t.values = values->as_array();
    t.group = s.get<std::string>("zip").value_or("axis:" + t.key);
    s.finish();
    tables.push_back(std::move(t));
  }
  return tables;
}

std::string value_text(const toml::node& node) {
  if (node.is_string()) return node.as_string()->get();
  std::ostringstream out;
  node.visit([&](const auto& v) { out << v; });
  return out.str();
}

}  // namespace kvlab
