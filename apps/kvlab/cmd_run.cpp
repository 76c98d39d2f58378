// kvlab run FILE.toml: run every expanded config of an experiment, write results, print the
// comparison table. kvlab check FILE.toml: the same runs, every greedy token checked against
// the full-recompute reference.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "experiment.hpp"
#include "kvlab/error.hpp"

namespace kvlab::cli {
namespace {

struct RunOptions {
  std::string file;
  std::vector<std::string> overrides;
  std::string out;
};

std::string run_directory_name(const ExperimentRun& run, std::size_t index) {
  std::string name = fmt::format("{:03d}", index);
  if (!run.config.label.empty()) name += "_";
  for (char ch : run.config.label)
    if (ch != ' ')
      name += std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '=' || ch == '-'
                  ? ch
                  : '_';
  if (run.config.repeats > 1) name += fmt::format("_r{}", run.repeat);
  return name;
}

std::string table_row(const std::string& label, const RunSummary& s, const RunOutput& out) {
  return fmt::format(
      "| {} | {}/{} | {:.2f} | {:.1f} | {:.3f} | {:.3f} | {:.4f} | {:.4f} | {:.4f} | {} | {:.1f}% "
      "| {:.1f}% |",
      label.empty() ? "(base)" : label, s.finished, s.rejected, s.requests_per_s,
      s.output_tokens_per_s, s.ttft_s.p50, s.ttft_s.p99, s.tpot_s.p50, s.tpot_s.p99, s.itl_s.p99,
      s.preemptions, 100 * out.mean_kv_used, 100 * out.mean_kv_waste);
}

int run_all(const RunOptions& o, bool check) {
  const auto runs = load_experiment(o.file, o.overrides);  // every error before anything runs
  const std::string name = runs.front().config.name;
  const std::filesystem::path out_dir = !o.out.empty() ? std::filesystem::path(o.out)
                                        : !runs.front().config.output_dir.empty()
                                            ? std::filesystem::path(runs.front().config.output_dir)
                                            : std::filesystem::path("results") / name;
  const bool tty = isatty(STDERR_FILENO) != 0;
  std::vector<std::string> rows;
  nlohmann::json index = nlohmann::json::array();
  std::int64_t total_mismatches = 0;
  double wall = 0, engine_wall = 0, forward_wall = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ExperimentRun& run = runs[i];
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string eta = i == 0
                                ? "?"
                                : fmt::format("{:.0f}s", elapsed / static_cast<double>(i) *
                                                             static_cast<double>(runs.size() - i));
    const std::string line = fmt::format("[{}/{}] {} {} (ETA {})", i + 1, runs.size(), name,
                                         run.config.label.empty() ? "" : run.config.label, eta);
    if (tty)
      fmt::print(stderr, "\r\033[K{}", line);
    else
      fmt::print(stderr, "{}\n", line);
    std::vector<std::string> mismatches;
    const RunOutput out = run_experiment(run.config, check, &mismatches);
    wall += out.wall_s;
    engine_wall += out.engine_wall_s;
    forward_wall += out.forward_wall_s;
    const std::string directory = run_directory_name(run, i);
    if (!check) write_run_outputs(out_dir / directory, run.config, out);
    rows.push_back(table_row(
        run.config.label + (run.config.repeats > 1 ? fmt::format(" #{}", run.repeat) : ""),
        out.summary, out));
    index.push_back({{"dir", directory}, {"label", run.config.label}, {"repeat", run.repeat}});
    if (check) {
      for (const auto& m : mismatches)
        fmt::print(stderr, "{}mismatch [{}]: {}\n", tty ? "\n" : "", run.config.label, m);
      total_mismatches += static_cast<std::int64_t>(mismatches.size());
    }
  }
  if (tty) fmt::print(stderr, "\n");
  const std::string header =
      "| run | finished/rejected | req/s | out tok/s | TTFT p50 (s) | TTFT p99 | TPOT p50 | TPOT "
      "p99 | ITL p99 | "
      "preempt | KV used | KV waste |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::string table = header;
  for (const auto& row : rows) table += row + "\n";
  fmt::print("{} ({} run{}, virtual-clock times)\n\n{}", name, runs.size(),
             runs.size() > 1 ? "s" : "", table);
  fmt::print(stderr,
             "wall {:.1f} s ({:.1f} s in the engine, {:.1f}% of that outside Backend::forward)\n",
             wall, engine_wall,
             engine_wall > 0 ? 100.0 * (engine_wall - forward_wall) / engine_wall : 0.0);
  if (check) {
    if (total_mismatches > 0) {
      fmt::print(stderr, "kvlab check: {} request(s) differ from the reference\n",
                 total_mismatches);
      return 1;
    }
    fmt::print("kvlab check: every finished request's tokens equal the reference's\n");
    return 0;
  }
  std::ofstream(out_dir / "summary.md") << "# " << name << "\n\n" << table;
  std::ofstream(out_dir / "runs.json") << index.dump(2) << "\n";
  fmt::print("\nresults: {}\n", out_dir.string());
  return 0;
}

}  // namespace

void register_run(CLI::App& app, int& exit_code) {
  for (const bool check : {false, true}) {
    auto o = std::make_shared<RunOptions>();
    auto* sub = app.add_subcommand(
        check ? "check" : "run",
        check ? "Run an experiment and check every greedy token against the reference"
              : "Run an experiment file: sweeps, results, summary table");
    sub->add_option("file", o->file, "Experiment file (TOML)")->required();
    sub->add_option("--set", o->overrides,
                    "Override a key: --set scheduler.name=fcfs (repeatable)");
    if (!check)
      sub->add_option("--out", o->out, "Results folder (default: [output] dir, or results/<name>)");
    sub->callback([o, check, &exit_code]() { exit_code = run_all(*o, check); });
  }
}

}  // namespace kvlab::cli
