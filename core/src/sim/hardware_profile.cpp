#include "kvlab/sim/hardware_profile.hpp"

#include <fmt/format.h>

#include "kvlab/kv_pool.hpp"

#include <toml++/toml.h>
#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <set>
#include <sstream>

#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// One [table] of a profile file: typed reads that remember which keys were used, so leftovers
// are reported as unknown (with the nearest known key).
// "file:line", or the file alone for a key with no line (one the experiment's [hardware]
// changed: merged copies keep no source position).
std::string located(const std::string& where, std::uint32_t line) {
  return line == 0 ? where : fmt::format("{}:{}", where, line);
}

class ProfileSection {
 public:
  ProfileSection(const toml::table* table, std::string name, std::string file)
      : table_(table), name_(std::move(name)), file_(std::move(file)) {}

  [[noreturn]] void fail(const toml::node* node, const std::string& why) const {
    throw Error(fmt::format("{}: {}",
                            located(file_, node != nullptr ? node->source().begin.line : 0), why));
  }
  const toml::node* node(std::string_view key) const {
    return table_ == nullptr ? nullptr : table_->get(key);
  }
  std::string text(std::string_view key, std::string fallback, bool required = false) {
    known_.emplace_back(key);
    const toml::node* n = node(key);
    if (n == nullptr) {
      if (required) missing(key);
      return fallback;
    }
    if (!n->is_string()) fail(n, fmt::format("{}.{} must be a string", name_, key));
    return std::string(*n->value<std::string>());
  }
  double number(std::string_view key, double fallback, bool required = false,
                bool allow_zero = false) {
    known_.emplace_back(key);
    const toml::node* n = node(key);
    if (n == nullptr) {
      if (required) missing(key);
      return fallback;
    }
    const auto v = n->value<double>();
    if (!v || !(n->is_number())) fail(n, fmt::format("{}.{} must be a number", name_, key));
    if (allow_zero ? !(*v >= 0) : !(*v > 0))
      fail(n, fmt::format("{}.{} must be {} 0 (got {})", name_, key, allow_zero ? ">=" : ">", *v));
    return *v;
  }
  void mark_known(std::string_view key) { known_.emplace_back(key); }
  bool boolean(std::string_view key, bool fallback) {
    known_.emplace_back(key);
    const toml::node* n = node(key);
    if (n == nullptr) return fallback;
    if (!n->is_boolean()) fail(n, fmt::format("{}.{} must be true or false", name_, key));
    return *n->value<bool>();
  }
  double fraction(std::string_view key, double fallback) {
    const double v = number(key, fallback);
    if (v > 1)
      fail(node(key),
           fmt::format("{}.{} is a fraction of the peak: (0, 1], got {}", name_, key, v));
    return v;
  }
  // `kv`: a KV cache's dtype (the quantized row formats too), else a compute dtype.
  DType dtype(std::string_view key, DType fallback, bool kv = false) {
    const std::string name = text(key, std::string(dtype_short_name(fallback)));
    const auto d = dtype_from_short_name(name);
    const bool compute = d && (*d == DType::dtype_f32 || *d == DType::dtype_f16 ||
                               *d == DType::dtype_bf16 || *d == DType::dtype_f8_e4m3);
    if (!(kv ? d && kv_pool_holds(*d) : compute))
      fail(node(key), fmt::format("{}.{} \"{}\": choose {}", name_, key, name,
                                  kv ? kv_pool_dtype_names() : "f32, f16, bf16 or fp8"));
    return *d;
  }
  void finish() const {
    if (table_ == nullptr) return;
    for (const auto& [key, value] : *table_) {
      if (std::find(known_.begin(), known_.end(), key.str()) != known_.end()) continue;
      std::string why = fmt::format("unknown key {}.{}", name_, key.str());
      if (const auto near = nearest_name(key.str(), known_))
        why += fmt::format(" (did you mean {}?)", *near);
      fail(&value, why);
    }
  }

 private:
  [[noreturn]] void missing(std::string_view key) const {
    throw Error(fmt::format("{}: [{}] needs {}", file_, name_, key));
  }
  const toml::table* table_;
  std::string name_, file_;
  std::vector<std::string> known_;
};

// [[gemm_regime]] or [[decode_attention_regime]] tables: min_rows > 1, strictly ascending;
// compute and memory efficiencies required.
std::vector<KernelRegime> read_regimes(const toml::array* regimes, const std::string& name,
                                       const std::string& where) {
  std::vector<KernelRegime> out;
  if (regimes == nullptr) return out;
  for (const toml::node& node : *regimes) {
    ProfileSection s(node.as_table(), name, where);
    if (s.node("compute") == nullptr || s.node("memory") == nullptr)
      s.fail(&node, fmt::format("a {} needs min_rows, compute and memory", name));
    KernelRegime r;
    const double rows = s.number("min_rows", 0, true);
    if (rows != std::floor(rows) || rows < 2 || rows > 1e9)
      s.fail(s.node("min_rows"),
             fmt::format("{}.min_rows must be an integer in [2, 1e9], got {}", name, rows));
    r.min_rows = static_cast<std::int64_t>(rows);
    if (!out.empty() && r.min_rows <= out.back().min_rows)
      s.fail(s.node("min_rows"), fmt::format("{}.min_rows must ascend: {} after {}", name,
                                             r.min_rows, out.back().min_rows));
    r.compute = s.fraction("compute", r.compute);
    r.memory = s.fraction("memory", r.memory);
    s.finish();
    out.push_back(r);
  }
  return out;
}

// Every top-level key is a known table ([[...]] for the kernel regimes), or an error naming it.
void check_top_level(const toml::table& top, const std::string& where) {
  const std::vector<std::string> tables{"profile", "device",      "efficiency",   "overhead",
                                        "memory",  "link",        "interconnect", "network",
                                        "kernels", "elementwise", "provenance"};
  const std::vector<std::string> regime_arrays{"gemm_regime", "decode_attention_regime",
                                               "allreduce"};
  for (const auto& [key, value] : top) {
    const bool regimes =
        std::find(regime_arrays.begin(), regime_arrays.end(), key.str()) != regime_arrays.end();
    const bool known =
        regimes || std::find(tables.begin(), tables.end(), key.str()) != tables.end();
    if (!known || (regimes ? !value.is_array_of_tables() : !value.is_table())) {
      std::string why = regimes ? fmt::format("{0} must be an array of tables ([[{0}]])", key.str())
                        : known ? fmt::format("[{}] must be a table", key.str())
                                : fmt::format("unknown table [{}]", key.str());
      if (!known)
        if (const auto near = nearest_name(key.str(), tables))
          why += fmt::format(" (did you mean [{}]?)", *near);
      throw Error(fmt::format("{}: {}", located(where, value.source().begin.line), why));
    }
  }
}

// [link], [interconnect] and [network]: what moves KV and activations between memories and GPUs.
void read_links(toml::table& top, const std::string& where, HardwareProfile& p) {
  {
    ProfileSection s(top["link"].as_table(), "link", where);
    p.swap_gb_per_s = s.number("swap_gb_per_s", p.swap_gb_per_s);
    p.swap_latency_s = s.number("swap_latency_s", p.swap_latency_s, false, true);
    p.disk_gb_per_s = s.number("disk_gb_per_s", p.disk_gb_per_s);
    p.disk_latency_s = s.number("disk_latency_s", p.disk_latency_s, false, true);
    p.tier_copies_overlap = s.boolean("tier_copies_overlap", p.tier_copies_overlap);
    s.finish();
  }
  {
    ProfileSection s(top["interconnect"].as_table(), "interconnect", where);
    p.allreduce_gb_per_s = s.number("allreduce_gb_per_s", 0, top["interconnect"].is_table());
    p.allreduce_latency_s = s.number("allreduce_latency_s", 0, false, true);
    s.finish();
  }
  {
    ProfileSection s(top["network"].as_table(), "network", where);
    p.kv_transfer_gb_per_s = s.number("kv_transfer_gb_per_s", p.kv_transfer_gb_per_s);
    p.kv_transfer_latency_s =
        s.number("kv_transfer_latency_s", p.kv_transfer_latency_s, false, true);
    s.finish();
  }
}

// [kernels]: <kernel>_floor_s >= 0 and <kernel>_knee (0: max; else in [1, 64]).
void read_kernel_terms(toml::table& top, const std::string& where, HardwareProfile& p) {
  ProfileSection s(top["kernels"].as_table(), "kernels", where);
  const std::pair<const char*, KernelTerms*> kernels[] = {
      {"gemm", &p.gemm_kernel},
      {"prefill_attention", &p.prefill_attention_kernel},
      {"decode_attention", &p.decode_attention_kernel}};
  for (const auto& [name, terms] : kernels) {
    const std::string floor = fmt::format("{}_floor_s", name), knee = fmt::format("{}_knee", name);
    terms->floor_s = s.number(floor, 0, false, true);
    terms->knee = s.number(knee, 0, false, true);
    if (terms->knee != 0 && !(terms->knee >= 1 && terms->knee <= 64))
      s.fail(s.node(knee),
             fmt::format("kernels.{} must be 0 (the plain roofline) or in [1, 64], got {}", knee,
                         terms->knee));
  }
  p.elementwise_wave_rows = s.number("elementwise_wave_rows", 0, false, true);
  if (p.elementwise_wave_rows > 1e6)
    s.fail(s.node("elementwise_wave_rows"),
           fmt::format("kernels.elementwise_wave_rows must be at most 1e6, got {}",
                       p.elementwise_wave_rows));
  s.finish();
}

// [elementwise]: one inline table a kind, { memory = fraction, floor_s = seconds }.
void read_elementwise_terms(toml::table& top, const std::string& where, HardwareProfile& p) {
  ProfileSection s(top["elementwise"].as_table(), "elementwise", where);
  for (int k = 0; k < kElementwiseKinds; ++k) {
    const char* name = kElementwiseNames[static_cast<std::size_t>(k)];
    s.mark_known(name);
    const toml::node* node = s.node(name);
    if (node == nullptr) continue;
    if (!node->is_table()) s.fail(node, fmt::format("elementwise.{} must be a table", name));
    ProfileSection term(node->as_table(), fmt::format("elementwise.{}", name), where);
    ElementwiseTerm& t = p.elementwise[static_cast<std::size_t>(k)];
    if (term.node("memory") == nullptr)
      s.fail(node, fmt::format("elementwise.{} needs memory (a fraction of the bandwidth)", name));
    t.memory = term.fraction("memory", 0);
    t.floor_s = term.number("floor_s", 0, false, true);
    term.finish();
  }
  s.finish();
}

// [[allreduce]]: gpus (2..1024, ascending), latency_s >= 0, gb_per_s > 0.
std::vector<AllReduceTerm> read_allreduce_terms(const toml::array* terms,
                                                const std::string& where) {
  std::vector<AllReduceTerm> out;
  if (terms == nullptr) return out;
  for (const toml::node& node : *terms) {
    ProfileSection s(node.as_table(), "allreduce", where);
    AllReduceTerm t;
    const double gpus = s.number("gpus", 0, true);
    if (gpus != std::floor(gpus) || gpus < 2 || gpus > 1024)
      s.fail(s.node("gpus"),
             fmt::format("allreduce.gpus must be an integer in [2, 1024], got {}", gpus));
    t.gpus = static_cast<std::int64_t>(gpus);
    if (!out.empty() && t.gpus <= out.back().gpus)
      s.fail(s.node("gpus"),
             fmt::format("allreduce.gpus must ascend: {} after {}", t.gpus, out.back().gpus));
    t.latency_s = s.number("latency_s", 0, true, true);
    t.gb_per_s = s.number("gb_per_s", 0, true);
    s.finish();
    out.push_back(t);
  }
  return out;
}

// [provenance]: strings only, any key (a term's name).
std::map<std::string, std::string> read_provenance(const toml::table* table,
                                                   const std::string& where) {
  std::map<std::string, std::string> out;
  if (table == nullptr) return out;
  for (const auto& [key, value] : *table) {
    if (!value.is_string())
      throw Error(fmt::format("{}: provenance.{} must be a string",
                              located(where, value.source().begin.line), key.str()));
    out.emplace(std::string(key.str()), *value.value<std::string>());
  }
  return out;
}

}  // namespace

bool has_elementwise_terms(const HardwareProfile& p) {
  for (const ElementwiseTerm& t : p.elementwise)
    if (t.memory > 0 || t.floor_s > 0) return true;
  return false;
}

std::pair<double, double> allreduce_latency_and_bandwidth(const HardwareProfile& p,
                                                          std::int64_t gpus) {
  for (const AllReduceTerm& t : p.allreduce)
    if (t.gpus == gpus) return {t.latency_s, t.gb_per_s};
  return {p.allreduce_latency_s, p.allreduce_gb_per_s};
}

std::pair<double, double> regime_efficiency(std::span<const KernelRegime> regimes,
                                            std::int64_t rows, std::pair<double, double> base) {
  for (const KernelRegime& r : regimes)
    if (rows >= r.min_rows) base = {r.compute, r.memory};
  return base;
}

namespace {

// `changes` into `top`: tables merge key by key, anything else (values, arrays of regimes)
// replaces what was there.
void merge_changes(toml::table& top, const toml::table& changes) {
  for (const auto& [key, value] : changes) {
    toml::node* mine = top.get(key);
    if (mine != nullptr && mine->is_table() && value.is_table())
      merge_changes(*mine->as_table(), *value.as_table());
    else
      top.insert_or_assign(key, value);
  }
}

}  // namespace

HardwareProfile load_hardware_profile_file(const std::filesystem::path& file,
                                           std::string_view changes) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec))
    throw Error(
        fmt::format("hardware profile {}: no such file (profiles ship in profiles/; kvlab "
                    "calibrate writes one)",
                    file.string()));
  toml::table top;
  try {
    top = toml::parse_file(file.string());
  } catch (const toml::parse_error& e) {
    throw Error(fmt::format("{}:{}:{}: {}", file.string(), e.source().begin.line,
                            e.source().begin.column, e.description()));
  }
  std::string where = file.string();
  if (!changes.empty()) {
    try {
      merge_changes(top, toml::parse(changes));
    } catch (const toml::parse_error& e) {
      throw Error(fmt::format("[hardware] changes to {}: {}", where, e.description()));
    }
    where += " with the experiment's [hardware] changes";
  }
  check_top_level(top, where);
  HardwareProfile p;
  p.source = where;
  {
    ProfileSection s(top["profile"].as_table(), "profile", where);
    p.name = s.text("name", "", true);
    p.description = s.text("description", "");
    s.finish();
  }
  {
    ProfileSection s(top["device"].as_table(), "device", where);
    p.peak_tflops = s.number("peak_tflops", 0, true);
    p.memory_gb_per_s = s.number("memory_gb_per_s", 0, true);
    p.memory_gib = s.number("memory_gib", 0, true);
    p.compute_dtype = s.dtype("compute_dtype", p.compute_dtype);
    p.kv_dtype = s.dtype("kv_dtype", p.kv_dtype, true);
    s.finish();
  }
  {
    ProfileSection s(top["efficiency"].as_table(), "efficiency", where);
    Efficiency& e = p.efficiency;
    e.gemm_compute = s.fraction("gemm_compute", e.gemm_compute);
    e.gemm_memory = s.fraction("gemm_memory", e.gemm_memory);
    e.attention_compute = s.fraction("attention_compute", e.attention_compute);
    e.attention_memory = s.fraction("attention_memory", e.attention_memory);
    e.elementwise_memory = s.fraction("elementwise_memory", e.elementwise_memory);
    s.finish();
  }
  p.gemm_regimes = read_regimes(top["gemm_regime"].as_array(), "gemm_regime", where);
  p.decode_attention_regimes =
      read_regimes(top["decode_attention_regime"].as_array(), "decode_attention_regime", where);
  {
    ProfileSection s(top["overhead"].as_table(), "overhead", where);
    p.step_overhead_s = s.number("step_s", p.step_overhead_s, false, true);
    p.sequence_overhead_s = s.number("sequence_s", p.sequence_overhead_s, false, true);
    p.ungraphed_step_s = s.number("ungraphed_step_s", p.ungraphed_step_s, false, true);
    s.finish();
  }
  read_kernel_terms(top, where, p);
  read_elementwise_terms(top, where, p);
  p.allreduce = read_allreduce_terms(top["allreduce"].as_array(), where);
  p.provenance = read_provenance(top["provenance"].as_table(), where);
  {
    ProfileSection s(top["memory"].as_table(), "memory", where);
    p.memory_utilization = s.fraction("utilization", p.memory_utilization);
    p.activation_reserve_gib =
        s.number("activation_reserve_gib", p.activation_reserve_gib, false, true);
    s.finish();
  }
  read_links(top, where, p);
  return p;
}

std::vector<std::filesystem::path> hardware_profile_search_path() {
  std::vector<std::filesystem::path> path;
  if (const char* env = std::getenv("KVLAB_PROFILE_PATH")) {
    std::stringstream list(env);
    for (std::string item; std::getline(list, item, ':');)
      if (!item.empty()) path.emplace_back(item);
  }
  std::error_code ec;
  const std::filesystem::path program = boost::dll::program_location(ec);
  if (!ec) path.push_back(program.parent_path().parent_path() / "share" / "kvlab" / "profiles");
#ifdef KVLAB_SOURCE_PROFILE_DIR
  path.emplace_back(KVLAB_SOURCE_PROFILE_DIR);
#endif
  return path;
}

std::vector<std::string> hardware_profile_names() {
  std::set<std::string> names;
  for (const auto& dir : hardware_profile_search_path()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
      if (entry.path().extension() == ".toml") names.insert(lower(entry.path().stem().string()));
  }
  return {names.begin(), names.end()};
}

HardwareProfile load_hardware_profile(std::string_view name_or_path, std::string_view changes) {
  const std::string text(name_or_path);
  if (text.find('/') != std::string::npos || text.ends_with(".toml"))
    return load_hardware_profile_file(text, changes);
  const std::string wanted = lower(text);
  for (const auto& dir : hardware_profile_search_path()) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
      if (entry.path().extension() == ".toml" && lower(entry.path().stem().string()) == wanted)
        return load_hardware_profile_file(entry.path(), changes);
  }
  const auto names = hardware_profile_names();
  std::string message = fmt::format("unknown hardware profile \"{}\"", text);
  if (const auto near = nearest_name(wanted, names))
    message += fmt::format(" (did you mean {}?)", *near);
  message += names.empty() ? "; no profiles found (set KVLAB_PROFILE_PATH)"
                           : "; profiles: " + join_names(names);
  throw Error(message);
}

namespace {

// The terms kvlab calibrate --vidur fits, each written only where set (a profile without them
// reads back the same, and its file stays as it was).
void add_fitted_terms(toml::table& top, const HardwareProfile& p) {
  if (p.ungraphed_step_s > 0)
    top["overhead"].as_table()->insert("ungraphed_step_s", p.ungraphed_step_s);
  toml::table kernels;
  const std::pair<const char*, const KernelTerms*> terms[] = {
      {"gemm", &p.gemm_kernel},
      {"prefill_attention", &p.prefill_attention_kernel},
      {"decode_attention", &p.decode_attention_kernel}};
  for (const auto& [name, t] : terms) {
    if (t->floor_s > 0) kernels.insert(fmt::format("{}_floor_s", name), t->floor_s);
    if (t->knee > 0) kernels.insert(fmt::format("{}_knee", name), t->knee);
  }
  if (p.elementwise_wave_rows > 0) kernels.insert("elementwise_wave_rows", p.elementwise_wave_rows);
  if (!kernels.empty()) top.insert("kernels", std::move(kernels));
  toml::table elementwise;
  for (int k = 0; k < kElementwiseKinds; ++k) {
    const ElementwiseTerm& t = p.elementwise[static_cast<std::size_t>(k)];
    if (t.memory > 0)
      elementwise.insert(kElementwiseNames[static_cast<std::size_t>(k)],
                         toml::table{{"memory", t.memory}, {"floor_s", t.floor_s}});
  }
  if (!elementwise.empty()) top.insert("elementwise", std::move(elementwise));
  if (!p.allreduce.empty()) {
    toml::array array;
    for (const AllReduceTerm& t : p.allreduce)
      array.push_back(
          toml::table{{"gpus", t.gpus}, {"latency_s", t.latency_s}, {"gb_per_s", t.gb_per_s}});
    top.insert("allreduce", std::move(array));
  }
  if (!p.provenance.empty()) {
    toml::table provenance;
    for (const auto& [key, text] : p.provenance) provenance.insert(key, text);
    top.insert("provenance", std::move(provenance));
  }
}

}  // namespace

std::string hardware_profile_to_toml(const HardwareProfile& p) {
  const Efficiency& e = p.efficiency;
  toml::table top{
      {"profile", toml::table{{"name", p.name}, {"description", p.description}}},
      {"device", toml::table{{"peak_tflops", p.peak_tflops},
                             {"memory_gb_per_s", p.memory_gb_per_s},
                             {"memory_gib", p.memory_gib},
                             {"compute_dtype", std::string(dtype_short_name(p.compute_dtype))},
                             {"kv_dtype", std::string(dtype_short_name(p.kv_dtype))}}},
      {"efficiency", toml::table{{"gemm_compute", e.gemm_compute},
                                 {"gemm_memory", e.gemm_memory},
                                 {"attention_compute", e.attention_compute},
                                 {"attention_memory", e.attention_memory},
                                 {"elementwise_memory", e.elementwise_memory}}},
      {"overhead",
       toml::table{{"step_s", p.step_overhead_s}, {"sequence_s", p.sequence_overhead_s}}},
      {"memory", toml::table{{"utilization", p.memory_utilization},
                             {"activation_reserve_gib", p.activation_reserve_gib}}},
      {"link", toml::table{{"swap_gb_per_s", p.swap_gb_per_s},
                           {"swap_latency_s", p.swap_latency_s},
                           {"disk_gb_per_s", p.disk_gb_per_s},
                           {"disk_latency_s", p.disk_latency_s},
                           {"tier_copies_overlap", p.tier_copies_overlap}}}};
  top.insert("network", toml::table{{"kv_transfer_gb_per_s", p.kv_transfer_gb_per_s},
                                    {"kv_transfer_latency_s", p.kv_transfer_latency_s}});
  if (p.allreduce_gb_per_s > 0)
    top.insert("interconnect", toml::table{{"allreduce_gb_per_s", p.allreduce_gb_per_s},
                                           {"allreduce_latency_s", p.allreduce_latency_s}});
  auto add_regimes = [&](const char* name, const std::vector<KernelRegime>& regimes) {
    if (regimes.empty()) return;
    toml::array array;
    for (const KernelRegime& r : regimes)
      array.push_back(
          toml::table{{"min_rows", r.min_rows}, {"compute", r.compute}, {"memory", r.memory}});
    top.insert(name, std::move(array));
  };
  add_regimes("gemm_regime", p.gemm_regimes);
  add_regimes("decode_attention_regime", p.decode_attention_regimes);
  add_fitted_terms(top, p);
  std::ostringstream out;
  out << toml::toml_formatter(top) << "\n";
  return out.str();
}

}  // namespace kvlab
