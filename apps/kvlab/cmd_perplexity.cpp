// kvlab perplexity: a model's perplexity over a text with the KV settings under test, by
// llama.cpp's llama-perplexity protocol (cpu_reference/perplexity.hpp), and beside it the mean
// KL divergence and top-1 agreement against the exact KV.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "cli_common.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cpu_reference/perplexity.hpp"
#include "kvlab/cpu_reference/weight_choices.hpp"
#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/kv_pool.hpp"
#include "kvlab/model/mapped_file.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "svg_plots.hpp"

namespace kvlab::cli {
namespace {

struct PerplexityCommand {
  std::string model;
  std::string file;
  cpu::PerplexityOptions options;
  std::string kv_dtype = "f32";
  std::string kv_value_dtype;  // "": the same as kv_dtype
  std::string kv_rotation = "none";
  std::int64_t window = 0;
  std::string attention = "gqa";       // the attention variant (--experiment's points)
  std::string experiment;              // an experiment file: each point's KV settings
  std::string kv_policy;               // a kv_policy plugin, or "" for every position kept
  std::vector<std::string> kv_params;  // its parameters, key=value
  std::string weights = "stored";
  std::string activations = "f32";
  bool no_compare = false;
  bool json = false;
  int threads = 0;
  std::string plot;  // --experiment: an HTML page of quality against KV bytes per token
};

void print_json(const PerplexityCommand& c, const ModelConfig& config, std::int64_t text_tokens,
                const cpu::PerplexityResult& r, double seconds, std::size_t measured_together = 1) {
  nlohmann::json out = {
      {"model", config.name},
      {"file", c.file},
      {"text_tokens", text_tokens},
      {"context", c.options.context},
      {"chunks", r.chunks},
      {"scored_tokens", r.scored_tokens()},
      {"kv_dtype", c.kv_dtype},
      {"kv_value_dtype", c.kv_value_dtype.empty() ? c.kv_dtype : c.kv_value_dtype},
      {"kv_rotation", c.kv_rotation},
      {"kv_residual", c.options.kivi_residual},
      {"window", c.window},
      {"attention", c.attention},
      {"kv_heads", config.num_key_value_heads},
      {"kv_policy", c.kv_policy},
      {"kv_policy_params", c.kv_params},
      {"kv_step", c.options.policy_step},
      {"ppl", r.ppl()},
      {"ppl_error", r.ppl_error()},
      {"running_ppl", r.running_ppl},
      {"seconds", seconds},  // with --experiment: its group's
      {"measured_together", measured_together}};
  if (r.compared) {
    out["exact_ppl"] = r.exact_ppl();
    out["mean_kl"] = r.mean_kl();
    out["kl_error"] = r.kl_error();
    out["top1_agreement"] = r.top1_agreement();
  }
  if (r.kv_kept.selections > 0) {  // what the policy's selections held and what a head saw
    out["kv_held_positions"] = r.kv_kept.mean_held();
    out["kv_seen_positions"] = r.kv_kept.mean_seen();
  }
  fmt::print("{}\n", out.dump());
}

// "q8_0", or "q8_0/q4_0" for K and V in dtypes apart.
std::string kv_dtypes(const PerplexityCommand& c) {
  return c.kv_value_dtype.empty() || c.kv_value_dtype == c.kv_dtype
             ? c.kv_dtype
             : fmt::format("{}/{}", c.kv_dtype, c.kv_value_dtype);
}

void print_text(const PerplexityCommand& c, const cpu::PerplexityResult& r) {
  const std::string policy =
      c.options.policy == nullptr
          ? ""
          : fmt::format(", policy {} (budget {}, {} token{} a step)", c.kv_policy,
                        c.options.policy->budget(), c.options.policy_step,
                        c.options.policy_step == 1 ? "" : "s");
  fmt::print("\nPPL = {:.4f} +/- {:.5f}  ({} chunks of {}, {} tokens scored, KV {}{}{}{})\n",
             r.ppl(), r.ppl_error(), r.chunks, c.options.context, r.scored_tokens(), kv_dtypes(c),
             c.options.hadamard ? " rotated" : "",
             c.window > 0 ? fmt::format(", window {}", c.window) : "", policy);
  if (r.kv_kept.selections > 0)
    fmt::print(
        "KV after a selection: {:.1f} positions held (slots), {:.1f} seen by a layer's K/V head "
        "(the rest of those held masked), mean of {} selections\n",
        r.kv_kept.mean_held(), r.kv_kept.mean_seen(), r.kv_kept.selections);
  if (!r.compared) return;
  fmt::print("exact KV (f32, every position): PPL = {:.4f}; this KV: {:+.3f}%\n", r.exact_ppl(),
             100.0 * (r.ppl() / r.exact_ppl() - 1.0));
  fmt::print(
      "mean KL divergence from the exact KV = {:.6f} +/- {:.6f} nats; top-1 agreement "
      "{:.2f}%\n",
      r.mean_kl(), r.kl_error(), 100.0 * r.top1_agreement());
}

// The --kv-policy plugin with its --kv-param values, or none.
PluginObject<KvPolicy> make_kv_policy(const PerplexityCommand& c) {
  if (c.kv_policy.empty()) {
    if (!c.kv_params.empty())
      throw Error("--kv-param needs --kv-policy: the parameters are a KV policy's");
    return {};
  }
  std::map<std::string, ParamValue, std::less<>> params;
  for (const std::string& text : c.kv_params) params.insert(parse_param(text));
  const PluginRegistry registry(PluginRegistry::default_search_path());
  return registry.create<PluginKind::kv_policy>(c.kv_policy, params, PluginContext{});
}

// The text's tokens and the model's weights, loaded once for every setting measured.
struct TextAndModel {
  std::vector<std::int32_t> tokens;
  std::optional<std::int32_t> bos;
  cpu::LlamaWeights weights;
  std::string directory;
};

TextAndModel load_text_and_model(const std::string& model, const std::string& file) {
  const std::string text = read_text(file);
  const ModelSource source = resolve_model(model);
  if (source.is_preset())
    throw Error(
        fmt::format("\"{}\" is a preset: perplexity needs a model with a tokenizer (a "
                    "folder or a .gguf file)",
                    model));
  const TokenizerLookup lookup = find_tokenizer(source.directory, source.config.vocab_size);
  if (!lookup.tokenizer)
    throw Error(fmt::format("perplexity needs a tokenizer: {}", lookup.why_not));
  TextAndModel m;
  m.tokens = lookup.tokenizer->encode_prompt(text);
  if (lookup.tokenizer->adds_bos()) m.bos = lookup.tokenizer->bos_id();
  m.weights = cpu::load_llama_weights(source.directory);
  m.directory = source.directory.string();
  return m;
}

// One measurement with c's settings, printed as text or one JSON line.
// `weights`: m's, or m's converted to another K/V head count (an experiment's attention variant).
void measure(const PerplexityCommand& c, const TextAndModel& m, const cpu::LlamaWeights& weights) {
  const ModelWeightsView view = cpu::weights_view(weights, m.directory);
  const auto make_compute = [&] {
    return cpu::select_compute_weights(view, c.weights, c.activations);
  };
  const auto start = std::chrono::steady_clock::now();
  const auto progress = [&](const cpu::PerplexityResult& r) {
    if (c.json) return;
    for (std::size_t i = r.running_ppl.size() - static_cast<std::size_t>(std::min<std::int64_t>(
                                                    c.options.parallel, r.chunks));
         i < r.running_ppl.size(); ++i)
      fmt::print("[{}]{:.4f},", i + 1, r.running_ppl[i]);
    std::fflush(stdout);
  };
  const cpu::PerplexityResult result =
      cpu::measure_perplexity(view, make_compute, m.tokens, m.bos, c.options, progress);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (c.json)
    print_json(c, weights.config, static_cast<std::int64_t>(m.tokens.size()), result, seconds);
  else
    print_text(c, result);
  std::fflush(stdout);
  fmt::print(stderr, "{}: {} tokens in the text, {:.1f} s ({} threads)\n", weights.config.name,
             m.tokens.size(), seconds, cpu::num_threads());
}

// A point's attention variant: its window (sliding_window), and the K/V head count its
// weights need (m's converted to it when that differs: mean-pooled or repeated heads, as kvlab
// run serves them). The no-cache variant computes the same function.
std::int64_t with_attention_variant(PerplexityCommand& point, const ExperimentConfig& e,
                                    const PluginRegistry& registry, const TextAndModel& m) {
  const ModelConfig& config = m.weights.config;
  PluginContext context;
  context.model = &config;
  context.max_seq_len = config.max_position_embeddings;
  const auto variant =
      registry.create<PluginKind::attention_variant>(e.attention, e.attention_params, context);
  if (const std::string problem = variant->check(config); !problem.empty())
    throw Error(
        fmt::format("attention \"{}\" cannot run {}: {}", e.attention, config.name, problem));
  point.attention = e.attention;
  if (const std::optional<std::int64_t> window = variant->window()) {
    point.window = *window;
    point.options.window = *window;
  }
  return variant->kv_heads(config);
}

// One sweep point of --experiment: its settings, title and K/V head count.
struct ExperimentPoint {
  PerplexityCommand command;
  std::string title;
  std::int64_t kv_heads = 0;
  PluginObject<KvPolicy> policy;
};

ExperimentPoint experiment_point(const PerplexityCommand& c, const ExperimentConfig& e,
                                 const PluginRegistry& registry, const TextAndModel& m) {
  ExperimentPoint point{c, e.label.empty() ? e.name : e.label, 0, {}};
  PerplexityCommand& command = point.command;
  command.kv_dtype = dtype_short_name(e.kv_dtype);
  command.options.kv_dtype = e.kv_dtype;
  command.options.kv_value_dtype = e.kv_value_dtype;
  if (e.kv_value_dtype) command.kv_value_dtype = dtype_short_name(*e.kv_value_dtype);
  command.options.hadamard = e.kv_hadamard;
  command.options.kivi_residual = e.kivi_residual;
  command.kv_rotation = e.kv_hadamard ? "hadamard" : "none";
  point.kv_heads = with_attention_variant(command, e, registry, m);
  if (!e.kv_policy.empty()) {
    point.policy = registry.create<PluginKind::kv_policy>(e.kv_policy, e.kv_policy_params, {});
    command.kv_policy = e.kv_policy;
    for (const auto& [key, value] : e.kv_policy_params)
      command.kv_params.push_back(key + "=" + param_value_to_string(value));
  }
  command.options.policy = point.policy.get();
  command.options.policy_name = e.kv_policy;
  return point;
}

// What one point measured, for printing in the file's order.
struct PointResult {
  cpu::PerplexityResult result;
  ModelConfig config;     // the weights' (their K/V head count)
  double seconds = 0;     // its group's: the points measured together
  std::size_t group = 0;  // how many were measured together
};

// Where --experiment is: which group of points (one K/V head count each) of how many, each
// group scoring every chunk; since when.
struct ExperimentProgress {
  std::size_t group = 0, groups = 1;
  std::int64_t chunks = 0;  // a group's
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

// The points of one K/V head count, measured together: one exact run for all of them.
void measure_together(const std::vector<std::size_t>& members,
                      const std::vector<ExperimentPoint>& points, const TextAndModel& m,
                      const cpu::LlamaWeights& weights, const ExperimentProgress& at,
                      std::vector<PointResult>& out) {
  const PerplexityCommand& c = points[members.front()].command;
  const ModelWeightsView view = cpu::weights_view(weights, m.directory);
  std::vector<cpu::PerplexityOptions> options;
  for (const std::size_t i : members) options.push_back(points[i].command.options);
  const auto start = std::chrono::steady_clock::now();
  // After each point's turn in each batch of chunks: where the group is, and the ETA.
  const std::int64_t parallel = std::max<std::int64_t>(1, std::min(c.options.parallel, at.chunks));
  const auto turns = static_cast<double>(members.size()) *
                     static_cast<double>((at.chunks + parallel - 1) / parallel);
  double turns_done = 0;
  const auto progress = [&](std::size_t p, const cpu::PerplexityResult& r) {
    turns_done += 1;
    const double done = static_cast<double>(at.group) + turns_done / turns;
    print_progress_line(fmt::format("[{}/{}] {} K/V heads: setting {}/{}, {}/{} chunks (ETA {})",
                                    at.group + 1, at.groups, weights.config.num_key_value_heads,
                                    p + 1, members.size(), r.chunks, at.chunks,
                                    eta_text(done, static_cast<double>(at.groups), at.start)));
  };
  std::vector<cpu::PerplexityResult> results = cpu::measure_perplexity(
      view, [&] { return cpu::select_compute_weights(view, c.weights, c.activations); }, m.tokens,
      m.bos, options, progress);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (std::size_t p = 0; p < members.size(); ++p)
    out[members[p]] = {std::move(results[p]), weights.config, seconds, members.size()};
  print_progress_line(
      fmt::format("{} ({} K/V heads): {} settings measured together in {:.1f} s ({} threads)",
                  weights.config.name, weights.config.num_key_value_heads, members.size(), seconds,
                  cpu::num_threads()),
      true);
}

// The share of a full cache's positions a point's KV holds: a KV policy's selections (their
// union), a window's span averaged over the scored positions [n/2, n - 1), else 1.
double held_share(const PerplexityCommand& c, const cpu::PerplexityResult& r) {
  if (c.options.policy != nullptr) return r.kv_kept.held_fraction();
  if (!c.options.window) return 1;
  const std::int64_t n = c.options.context;
  double sum = 0;
  for (std::int64_t p = n / 2; p < n - 1; ++p)
    sum += static_cast<double>(std::min(*c.options.window, p + 1)) / static_cast<double>(p + 1);
  return sum / static_cast<double>(n - 1 - n / 2);
}

// --plot: KL and top-1 agreement against the KV bytes a token of context costs (the pool's row
// bytes in the point's dtype and K/V heads, times held_share), every compared point a dot, the
// Pareto front marked; the table beside it with the tokens a GiB of KV holds.
void write_plot(const std::string& file, const std::vector<ExperimentPoint>& points,
                const std::vector<PointResult>& results) {
  std::vector<ScatterPoint> kl, top1;
  std::string rows;
  for (std::size_t i = 0; i < points.size(); ++i) {
    const PerplexityCommand& c = points[i].command;
    const cpu::PerplexityResult& r = results[i].result;
    const ModelConfig& m = results[i].config;
    const DType value_dtype = c.options.kv_value_dtype.value_or(c.options.kv_dtype);
    const double row = static_cast<double>(m.num_hidden_layers * m.num_key_value_heads) *
                       static_cast<double>(dtype_row_bytes(c.options.kv_dtype, m.head_dim) +
                                           dtype_row_bytes(value_dtype, m.head_dim));
    const double share = held_share(c, r), bytes = row * share;
    // A point not compared is the exact KV itself (--plot refuses --no-compare): KL 0, top-1 100%.
    const double mean_kl = r.compared ? r.mean_kl() : 0,
                 agree = r.compared ? r.top1_agreement() : 1;
    kl.push_back({points[i].title, bytes, mean_kl});
    top1.push_back({points[i].title, bytes, 100 * agree});
    rows += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}</td><td>{:.1f}%</td><td>{:.0f}</td>"
        "<td>{:.4f}</td><td>{:.4f}</td><td>{:.1f}%</td></tr>\n",
        i + 1, escape_markup(points[i].title), kv_dtypes(c), bytes, 100 * share,
        1073741824.0 / bytes, r.ppl(), mean_kl, 100 * agree);
  }
  std::ofstream out(file);
  out << "<!doctype html><meta charset='utf-8'><title>kvlab perplexity: quality against KV "
         "memory</title><body><p>Each setting's quality against the KV bytes a token of context "
         "costs (its dtype's row bytes x the share of the full cache's positions it holds); the "
         "green line is the Pareto front.</p>"
      << scatter_svg("KL divergence from the exact KV", "KV bytes per token", "mean KL (nats)", kl,
                     true)
      << scatter_svg("top-1 agreement with the exact KV", "KV bytes per token", "top-1 (%)", top1,
                     false)
      << "<table border='1' cellpadding='4'><tr><th>#</th><th>setting</th><th>KV dtype</th>"
         "<th>KV bytes/token</th><th>held</th><th>tokens per GiB</th><th>PPL</th><th>KL</th>"
         "<th>top-1</th></tr>\n"
      << rows << "</table></body>\n";
  if (!out) throw Error(fmt::format("cannot write --plot {}", file));
  fmt::print(stderr, "wrote {}\n", file);
}

// --experiment takes every KV setting from its points: a KV flag beside it is an error.
void refuse_kv_flags_beside_an_experiment(const PerplexityCommand& c) {
  if (c.kv_dtype != "f32" || c.kv_rotation != "none" || c.window != 0 || !c.kv_policy.empty() ||
      !c.kv_params.empty() || c.options.kivi_residual != kKiviResidualDefault ||
      !c.kv_value_dtype.empty())
    throw Error(
        "--experiment takes the KV settings of each of its points: drop --kv-dtype, "
        "--kv-value-dtype, --kv-rotation, --kv-residual, --window, --kv-policy and --kv-param");
}

// --experiment FILE: each sweep point's KV settings ([kv_cache] dtype and rotation, a
// sliding_window's window, [kv_policy]) measured over the same text, on the file's model. The
// points of one K/V head count share one exact run, so N of them cost N + 1 forwards, not 2N.
void measure_experiment(PerplexityCommand c) {
  refuse_kv_flags_beside_an_experiment(c);
  const std::vector<ExperimentRun> runs = load_experiment(c.experiment, {});
  const std::string model = c.model.empty() ? runs.front().config.model : c.model;
  const TextAndModel m = load_text_and_model(model, c.file);
  std::map<std::vector<std::string>, std::unique_ptr<PluginRegistry>> registries;  // per paths
  std::vector<ExperimentPoint> points;
  points.reserve(runs.size());
  for (const ExperimentRun& run : runs) {
    const ExperimentConfig& e = run.config;
    auto& registry = registries[e.plugin_paths];
    if (!registry) {
      auto search = PluginRegistry::default_search_path();
      search.insert(search.end(), e.plugin_paths.begin(), e.plugin_paths.end());
      registry = std::make_unique<PluginRegistry>(search);
    }
    points.push_back(experiment_point(c, e, *registry, m));
  }
  std::vector<PointResult> results(points.size());
  std::vector<bool> measured(points.size(), false);
  ExperimentProgress at;
  std::set<std::int64_t> head_counts;
  for (const ExperimentPoint& point : points) head_counts.insert(point.kv_heads);
  at.groups = head_counts.size();
  const cpu::PerplexityOptions& options = points.front().command.options;
  const std::int64_t whole = static_cast<std::int64_t>(m.tokens.size()) / options.context;
  at.chunks = options.chunks > 0 ? std::min(options.chunks, whole) : whole;
  for (std::size_t first = 0; first < points.size(); ++first) {
    if (measured[first]) continue;
    std::vector<std::size_t> members;  // every point of first's K/V head count
    for (std::size_t i = first; i < points.size(); ++i)
      if (points[i].kv_heads == points[first].kv_heads) {
        members.push_back(i);
        measured[i] = true;
      }
    if (points[first].kv_heads == m.weights.config.num_key_value_heads)
      measure_together(members, points, m, m.weights, at, results);
    else
      measure_together(members, points, m, cpu::convert_kv_heads(m.weights, points[first].kv_heads),
                       at, results);
    ++at.group;
  }
  for (std::size_t i = 0; i < points.size(); ++i) {
    const PerplexityCommand& command = points[i].command;
    const PointResult& r = results[i];
    if (command.json) {
      print_json(command, r.config, static_cast<std::int64_t>(m.tokens.size()), r.result, r.seconds,
                 r.group);
    } else {
      fmt::print("\n{}\n", points[i].title);
      print_text(command, r.result);
    }
  }
  std::fflush(stdout);
  if (!c.plot.empty()) write_plot(c.plot, points, results);
}

void run_perplexity(PerplexityCommand c) {
  if (c.threads < 0)
    throw Error(fmt::format("--threads must be >= 0 (0 = all cores), got {}", c.threads));
  if (c.threads > 0) cpu::set_num_threads(c.threads);
  if (c.options.policy_step < 1)
    throw Error(fmt::format("--kv-step must be >= 1 token, got {}", c.options.policy_step));
  c.options.compare_with_exact = !c.no_compare;
  if (!c.plot.empty() && (c.experiment.empty() || c.no_compare))
    throw Error(
        "--plot draws the points of --experiment FILE against the exact KV: give one, "
        "without --no-compare");
  if (!c.experiment.empty()) return measure_experiment(std::move(c));
  if (c.model.empty()) throw Error("perplexity needs --model (or --experiment FILE)");
  c.options.kv_dtype = kv_pool_dtype(c.kv_dtype, "--kv-dtype");
  if (!c.kv_value_dtype.empty())
    c.options.kv_value_dtype = kv_pool_dtype(c.kv_value_dtype, "--kv-value-dtype");
  if (c.window < 0) throw Error(fmt::format("--window must be >= 0 (0 = off), got {}", c.window));
  if (c.window > 0) c.options.window = c.window;
  c.options.hadamard = c.kv_rotation == "hadamard";
  PluginObject<KvPolicy> policy = make_kv_policy(c);
  c.options.policy = policy.get();
  c.options.policy_name = c.kv_policy;
  const TextAndModel m = load_text_and_model(c.model, c.file);
  measure(c, m, m.weights);
}

}  // namespace

void register_perplexity(CLI::App& app) {
  auto c = std::make_shared<PerplexityCommand>();
  auto* sub = app.add_subcommand(
      "perplexity",
      "Perplexity over a text with the KV settings under test (llama-perplexity's protocol), "
      "and the KL divergence and top-1 agreement against the exact KV");
  sub->add_option("--model", c->model,
                  "A model folder or .gguf file (with its tokenizer); with --experiment, the "
                  "file's model unless given");
  sub->add_option("--experiment", c->experiment,
                  "Measure each point of an experiment file with its KV settings ([kv_cache] "
                  "dtype and rotation, a sliding window, [kv_policy])");
  sub->add_option("-f,--file", c->file,
                  "The text (data/wikitext-2-raw/wiki.test.raw is the standard one)")
      ->required();
  sub->add_option("-c,--context", c->options.context, "Tokens per chunk (llama.cpp's -c)")
      ->capture_default_str();
  sub->add_option("--chunks", c->options.chunks, "Chunks to score (0 = every whole chunk)")
      ->capture_default_str();
  sub->add_option("--parallel", c->options.parallel, "Chunks per forward")->capture_default_str();
  sub->add_option("--kv-dtype", c->kv_dtype, "The KV pool's dtype: " + kv_pool_dtype_names())
      ->capture_default_str();
  sub->add_option("--kv-value-dtype", c->kv_value_dtype,
                  "V's rows in a dtype of their own (llama.cpp's -ctv beside -ctk; default: "
                  "--kv-dtype): " +
                      kv_pool_dtype_names());
  sub->add_option("--kv-residual", c->options.kivi_residual,
                  "KIVI (--kv-dtype kivi2, kivi4): the newest tokens each chunk keeps in fp16 "
                  "(the paper's residual length R, a multiple of 32); KIVI's chunks are streamed "
                  "--kv-step tokens a forward, as its prefill reads fp16")
      ->capture_default_str();
  sub->add_option("--kv-rotation", c->kv_rotation,
                  "none, or hadamard: K and V rotated per head by a Walsh-Hadamard matrix before "
                  "they are stored (llama.cpp's attn_rot; head_dim a power of two)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "hadamard"}));
  sub->add_option("--window", c->window,
                  "Attend to the last W positions only (window attention; 0 = off)")
      ->capture_default_str();
  sub->add_option("--kv-policy", c->kv_policy,
                  "A KV policy: window, streaming_llm, h2o, snapkv, pyramidkv, adakv, or your own "
                  "kv_policy plugin. Each chunk is then streamed --kv-step tokens a forward and "
                  "each layer's K/V head keeps at most the policy's budget between forwards");
  sub->add_option("--kv-param", c->kv_params,
                  "The policy's parameters, key=value, repeatable (budget=256, sinks=4; kvlab "
                  "plugins shows each policy's)");
  sub->add_option("--kv-step", c->options.policy_step,
                  "Tokens a forward under a KV policy or a KIVI dtype (default 1: token by "
                  "token, as a generation meets it; a larger step is faster, and each query then "
                  "sees up to budget + step - 1 positions, or its step's tokens in fp16)")
      ->capture_default_str();
  sub->add_option("--weights", c->weights,
                  "The format the backend multiplies in: stored, f32, f16, bf16, q8_0, q4_0, q4_1")
      ->capture_default_str()
      ->check(CLI::IsMember(
          std::vector<std::string>(cpu::kWeightChoices.begin(), cpu::kWeightChoices.end())));
  sub->add_option("--activations", c->activations, "f32, q8 or bf16 (kvlab generate --help)")
      ->capture_default_str()
      ->check(CLI::IsMember(std::vector<std::string>(cpu::kActivationChoices.begin(),
                                                     cpu::kActivationChoices.end())));
  sub->add_flag("--no-compare", c->no_compare,
                "Skip the exact run (no KL divergence or top-1 agreement; half the time)");
  sub->add_flag("--json", c->json, "One JSON object with every figure");
  sub->add_option("--plot", c->plot,
                  "With --experiment: an HTML page of KL and top-1 against KV bytes per token, "
                  "every setting a point, the Pareto front marked, the table beside it");
  sub->add_option("--threads", c->threads, "CPU threads (0 = all cores)")->capture_default_str();
  sub->callback([c]() { run_perplexity(*c); });
}

}  // namespace kvlab::cli
