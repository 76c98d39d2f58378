// kvlab eval FILE.toml: answers, not only perplexity. The file's [eval] table builds a
// retrieval task (kvlab/experiment/eval_task.hpp: a key hidden in WikiText-2 filler at each
// length and depth), every sweep point (a KV policy, a KV dtype) serves the same prompts
// through the engine, and each answer is scored by exact match: a table and a length x depth
// heat map per setting, eval.csv and answers.jsonl beside an eval.html of the heat maps.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/eval_task.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "svg_plots.hpp"

namespace kvlab::cli {
namespace {

struct EvalOptions {
  std::string file;
  CommandLineChanges changes;  // --set, --sweep
  std::string out;
  bool json = false;
};

// One setting's outcome.
struct EvalSetting {
  std::string title;
  std::vector<EvalCell> cells;
  std::vector<std::string> answers;
  double seconds = 0;
  double kv_bytes_per_token = 0;  // the pool's row bytes x the share its policy held
  std::int64_t correct() const {
    std::int64_t n = 0;
    for (const EvalCell& c : cells) n += c.correct;
    return n;
  }
};

// accuracy in [0, 1] -> a red (0) to green (1) fill.
std::string heat_colour(double accuracy) {
  const auto red = static_cast<int>(std::lround(220 * (1 - accuracy) + 30 * accuracy));
  const auto green = static_cast<int>(std::lround(60 * (1 - accuracy) + 170 * accuracy));
  return fmt::format("rgb({},{},70)", red, green);
}

std::string heat_map_svg(const EvalSpec& spec, const EvalSetting& s) {
  constexpr int kCell = 46, kLeft = 70, kTop = 40;
  const auto cols = static_cast<int>(spec.depths.size()),
             rows = static_cast<int>(spec.lengths.size());
  std::string svg = fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' "
      "font-size='12'><text x='0' y='14' font-weight='bold'>{}</text>"
      "<text x='{}' y='32'>depth</text>",
      kLeft + cols * kCell + 10, kTop + rows * kCell + 20, escape_markup(s.title), kLeft);
  for (int c = 0; c < cols; ++c)
    svg += fmt::format("<text x='{}' y='{}' text-anchor='middle'>{:g}</text>",
                       kLeft + c * kCell + kCell / 2, kTop + rows * kCell + 14,
                       spec.depths[static_cast<std::size_t>(c)]);
  for (int r = 0; r < rows; ++r) {
    svg += fmt::format("<text x='{}' y='{}' text-anchor='end'>{}</text>", kLeft - 6,
                       kTop + r * kCell + kCell / 2 + 4, spec.lengths[static_cast<std::size_t>(r)]);
    for (int c = 0; c < cols; ++c) {
      const EvalCell& cell = s.cells[static_cast<std::size_t>(r * cols + c)];
      svg += fmt::format(
          "<rect x='{}' y='{}' width='{}' height='{}' fill='{}'><title>length {} depth {:g}: "
          "{}/{}</title></rect><text x='{}' y='{}' text-anchor='middle' "
          "fill='white'>{:.0f}%</text>",
          kLeft + c * kCell, kTop + r * kCell, kCell - 2, kCell - 2, heat_colour(cell.accuracy()),
          cell.length, cell.depth, cell.correct, cell.prompts, kLeft + c * kCell + kCell / 2 - 1,
          kTop + r * kCell + kCell / 2 + 4, 100 * cell.accuracy());
    }
  }
  return svg + "</svg>";
}

// One token's K and V in every layer, in the pool's dtype.
double kv_row_bytes(const ExperimentConfig& c) {
  const ModelConfig m = resolve_model(c.model).config;
  return static_cast<double>(m.num_hidden_layers * m.cache_kv_heads()) *
         static_cast<double>(c.kv_head_bytes(m.cache_head_dim()));
}

void print_table(const EvalSpec& spec, const EvalSetting& s) {
  fmt::print("\n{}: {}/{} right ({:.1f}%), {:.1f} s\n", s.title, s.correct(), s.answers.size(),
             100.0 * static_cast<double>(s.correct()) / static_cast<double>(s.answers.size()),
             s.seconds);
  fmt::print("{:>8} |", "length");
  for (const double d : spec.depths) fmt::print(" {:>6g}", d);
  fmt::print("   (depth: where the key sits in the filler; % of {} prompts right)\n", spec.samples);
  for (std::size_t r = 0; r < spec.lengths.size(); ++r) {
    fmt::print("{:>8} |", spec.lengths[r]);
    for (std::size_t c = 0; c < spec.depths.size(); ++c)
      fmt::print(" {:>5.0f}%", 100 * s.cells[r * spec.depths.size() + c].accuracy());
    fmt::print("\n");
  }
}

void write_outputs(const std::filesystem::path& dir, const EvalSpec& spec,
                   const std::vector<EvalPrompt>& prompts,
                   const std::vector<EvalSetting>& settings) {
  std::ofstream csv(dir / "eval.csv"), answers(dir / "answers.jsonl"), html(dir / "eval.html");
  csv << "setting,length,depth,prompts,correct,accuracy\n";
  html << "<!doctype html><meta charset='utf-8'><title>kvlab eval</title><body>"
       << fmt::format(
              "<p>{} task: the key hidden at each depth of filler of each length; "
              "exact match of the key in the answer.</p>",
              spec.task);
  for (const EvalSetting& s : settings) {
    for (const EvalCell& c : s.cells)
      csv << fmt::format("\"{}\",{},{:g},{},{},{:.4f}\n", s.title, c.length, c.depth, c.prompts,
                         c.correct, c.accuracy());
    for (std::size_t i = 0; i < prompts.size(); ++i)
      answers << nlohmann::json{{"setting", s.title},
                                {"length", prompts[i].length},
                                {"depth", prompts[i].depth},
                                {"tokens", prompts[i].tokens},
                                {"key", prompts[i].key},
                                {"answer", s.answers[i]},
                                {"correct", eval_answer_correct(s.answers[i], prompts[i].key)}}
                     .dump()
              << '\n';
    html << heat_map_svg(spec, s) << '\n';
  }
  std::vector<ScatterPoint> accuracy;
  for (const EvalSetting& s : settings)
    accuracy.push_back(
        {s.title, s.kv_bytes_per_token,
         100.0 * static_cast<double>(s.correct()) / static_cast<double>(s.answers.size())});
  html << "<p>Accuracy against the KV bytes a token of context costs (the pool's row bytes in its "
          "dtype x the share of a sequence's positions its KV policy held at its selections); "
          "the green line is the Pareto front.</p>"
       << scatter_svg("keys found", "KV bytes per token", "accuracy (%)", accuracy, false)
       << "</body>\n";
  if (!csv || !answers || !html) throw Error(fmt::format("cannot write into {}", dir.string()));
}

void run_eval(const EvalOptions& o) {
  const std::vector<ExperimentRun> runs = load_experiment(o.file, o.changes, nullptr);
  const ExperimentConfig& first = runs.front().config;
  if (first.eval.task.empty())
    throw Error(
        fmt::format("{} has no [eval] table: kvlab eval needs task, filler, lengths and "
                    "depths (docs/concepts/kv-eviction.md#answers-kvlab-eval)",
                    o.file));
  const std::filesystem::path dir = !o.out.empty()
                                        ? std::filesystem::path(o.out)
                                        : std::filesystem::path("results") / (first.name + "-eval");
  std::filesystem::create_directories(dir);
  const std::vector<EvalPrompt> prompts = write_eval_prompts(first, dir / "prompts.jsonl");
  std::vector<ExperimentRun> served;
  for (const ExperimentRun& run : runs) {
    if (run.config.eval.task != first.eval.task || run.config.eval.lengths != first.eval.lengths ||
        run.config.eval.depths != first.eval.depths ||
        run.config.eval.samples != first.eval.samples)
      throw Error("kvlab eval: every sweep point asks the same [eval] task and grid");
    served.push_back({eval_serving_config(run.config, dir / "prompts.jsonl"), run.repeat});
  }
  validate_experiment(served, false);
  std::vector<EvalSetting> settings;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < served.size(); ++i) {
    const ExperimentConfig& c = served[i].config;
    print_progress_line(
        fmt::format("[{}/{}] {} ({} prompts; ETA {})", i + 1, served.size(),
                    c.label.empty() ? c.name : c.label, prompts.size(),
                    eta_text(static_cast<double>(i), static_cast<double>(served.size()), start)));
    const RunOutput out = run_experiment(c, false, nullptr);
    EvalSetting s{c.label.empty() ? c.name : c.label, score_eval(c.eval, prompts, out.answer_texts),
                  out.answer_texts, out.wall_s,
                  kv_row_bytes(c) * out.engine.kv_policy.held_fraction()};
    if (o.json) {
      for (const EvalCell& cell : s.cells)
        fmt::print("{}\n", nlohmann::json{{"setting", s.title},
                                          {"task", c.eval.task},
                                          {"length", cell.length},
                                          {"depth", cell.depth},
                                          {"prompts", cell.prompts},
                                          {"correct", cell.correct},
                                          {"accuracy", cell.accuracy()}}
                               .dump());
    }
    settings.push_back(std::move(s));
  }
  print_progress_line(
      fmt::format("{} settings x {} prompts in {:.1f} s", served.size(), prompts.size(),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()),
      true);
  if (!o.json)
    for (const EvalSetting& s : settings) print_table(first.eval, s);
  write_outputs(dir, first.eval, prompts, settings);
  fmt::print(stderr, "wrote {}/eval.html, eval.csv, answers.jsonl, prompts.jsonl\n", dir.string());
}

}  // namespace

void register_eval(CLI::App& app) {
  auto options = std::make_shared<EvalOptions>();
  auto* sub = app.add_subcommand(
      "eval",
      "Score retrieval (a key hidden in WikiText-2 filler, RULER's design) through the engine "
      "under each sweep point's KV settings: accuracy per length x depth, a heat map each");
  sub->add_option("file", options->file, "Experiment TOML file with an [eval] table")
      ->required()
      ->check(CLI::ExistingFile);
  sub->add_option("--set", options->changes.set, "Override a key: dotted.key=toml_value");
  sub->add_option("--sweep", options->changes.sweep, "One more sweep axis: dotted.key=v1,v2");
  sub->add_option("--out", options->out, "Results folder (default results/<name>-eval)");
  sub->add_flag("--json", options->json, "One JSON line per setting and cell on stdout");
  sub->callback([options] { run_eval(*options); });
}

}  // namespace kvlab::cli
