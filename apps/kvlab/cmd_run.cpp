// kvlab run FILE.toml: run every expanded config of an experiment, write results, print the
// comparison table. kvlab check FILE.toml: the same runs, every greedy token checked against
// the full-recompute reference.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/distributed_sweep.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "mpi_sweep.hpp"

namespace kvlab::cli {
namespace {

struct RunOptions {
  std::string file;
  CommandLineChanges changes;  // --set, --sweep
  std::string out;
  bool force = false;
  double tolerance = 0;  // kvlab check --tolerance (ExperimentConfig::check_tolerance)
};

// --out, else [output] dir, else results/<name>.
std::filesystem::path results_folder(const RunOptions& o, const ExperimentConfig& first) {
  if (!o.out.empty()) return o.out;
  if (!first.output_dir.empty()) return first.output_dir;
  return std::filesystem::path("results") / first.name;
}

// "[i/n] name label (ETA ...)" on stderr, rewritten in place on a terminal; "rank r: " first
// when several ranks share the sweep (i and n count this rank's runs).
void print_progress(std::size_t i, std::size_t n, const ExperimentConfig& c,
                    std::chrono::steady_clock::time_point start, bool tty,
                    const std::string& rank) {
  const std::string eta = eta_text(static_cast<double>(i), static_cast<double>(n), start);
  const std::string line = fmt::format("{}[{}/{}] {} {} (ETA {})", rank, i + 1, n, c.name,
                                       c.label.empty() ? "" : c.label, eta);
  if (tty)
    fmt::print(stderr, "\r\033[K{}", line);
  else
    fmt::print(stderr, "{}\n", line);
}

// This rank's share of the sweep. Rank 0 writes into the results folder; another rank writes
// each run into a staging folder of its own and carries the files in the record to rank 0.
std::vector<RunRecord> run_share(const std::vector<ExperimentRun>& runs,
                                 const std::vector<std::size_t>& share, bool check,
                                 const std::filesystem::path& out_dir, const SweepRanks& ranks) {
  const bool tty = isatty(STDERR_FILENO) != 0 && ranks.size() == 1;
  const std::string prefix = ranks.size() > 1 ? fmt::format("rank {}: ", ranks.rank()) : "";
  const auto start = std::chrono::steady_clock::now();
  std::vector<RunRecord> records;
  for (std::size_t k = 0; k < share.size(); ++k) {
    const std::size_t i = share[k];
    print_progress(k, share.size(), runs[i].config, start, tty, prefix);
    if (check || ranks.rank() == 0) {
      records.push_back(
          execute_run(runs, i, check,
                      check ? std::filesystem::path{} : out_dir / run_directory_name(runs[i], i),
                      ranks.rank()));
      continue;
    }
    const auto staging = std::filesystem::temp_directory_path() /
                         fmt::format("kvlab-rank{}-{}-{}", ranks.rank(), getpid(), i);
    std::filesystem::remove_all(staging);
    RunRecord record = execute_run(runs, i, check, staging, ranks.rank());
    if (record.error.empty()) record.files = read_folder_files(staging);
    std::filesystem::remove_all(staging);
    records.push_back(std::move(record));
  }
  if (tty) fmt::print(stderr, "\n");
  return records;
}

// Every rank loads and validates the file; rank 0 takes the results folder (its lock and a
// staging folder), and no rank starts unless all of that worked everywhere. Each rank runs its
// share (balance_runs by estimated cost); rank 0 gathers the outcomes, writes what the others
// carried, reports, and moves the results into place only when every file is written.
int run_all(const RunOptions& o, bool check) {
  SweepRanks ranks;
  std::vector<ExperimentRun> runs;
  std::optional<ResultsFolder> folder;
  std::filesystem::path out_dir;  // where this rank writes: the staging folder on rank 0
  std::string experiment_text;
  std::exception_ptr not_ready;
  try {
    std::vector<std::string> notes;
    runs = load_experiment(o.file, o.changes, &notes);  // every error before anything runs
    if (ranks.rank() == 0)
      for (const std::string& note : notes) fmt::print(stderr, "kvlab: {}\n", note);
    for (auto& run : runs) run.config.check_tolerance = o.tolerance;
    validate_experiment(runs, check);
    if (!check && ranks.rank() == 0) {
      experiment_text = read_experiment_text(o.file);
      folder.emplace(results_folder(o, runs.front().config),
                     ResultsFolder::Options{o.force, {o.file}});
      out_dir = folder->staging();
    }
  } catch (const Error&) {
    not_ready = std::current_exception();
  }
  if (!ranks.all(not_ready == nullptr)) {
    if (not_ready && ranks.rank() == 0) std::rethrow_exception(not_ready);  // one report
    return 1;
  }
  std::vector<double> costs;
  for (const ExperimentRun& run : runs) costs.push_back(estimated_run_cost(run.config));
  const auto shares = balance_runs(costs, ranks.size());
  try {
    std::vector<RunRecord> records = ranks.gather(
        run_share(runs, shares[static_cast<std::size_t>(ranks.rank())], check, out_dir, ranks));
    if (ranks.rank() != 0) return 0;
    if (!check) write_carried_files(runs, records, out_dir);
    const SweepReport r = report_sweep(check, ranks.size(), runs, std::move(records));
    for (const SweepReport::Line& line : r.lines)
      fmt::print(line.to_stderr ? stderr : stdout, "{}", line.text);
    if (!check && !r.index.empty())  // a folder of failed runs only is not written at all
      finish_results(*folder, r, o.file, experiment_text, o.changes, runs.size(), ranks.size());
    return r.exit_code;
  } catch (const std::exception& e) {  // not one run's error: the job cannot finish
    if (ranks.size() == 1) throw;
    fmt::print(stderr, "kvlab: error on rank {}: {}\n", ranks.rank(), e.what());
    ranks.abort(1);
  }
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
    sub->add_option("--set", o->changes.set,
                    "Set a key in every run: --set scheduler.params.max_batch=64 (repeatable; "
                    "on a key the file sweeps it replaces that axis)");
    sub->add_option("--sweep", o->changes.sweep,
                    "Add a sweep axis: --sweep scheduler.name=fcfs,static (repeatable; crossed "
                    "with the file's axes, replacing one over the same key)");
    if (check)
      sub->add_option("--tolerance", o->tolerance,
                      "Accept a token whose reference logit is within this of the reference's "
                      "largest (teacher forcing goes on with the engine's token); 0 (default): "
                      "it must be the argmax. Lets rounded weights, KV dtypes and activations be "
                      "checked")
          ->check(CLI::Validator(
              [](const std::string& text) -> std::string {
                double value = 0;  // NonNegativeNumber alone lets "nan" and "inf" through
                if (!CLI::detail::lexical_cast(text, value) || !std::isfinite(value) || value < 0)
                  return "must be a finite number >= 0, not " + text;
                return {};
              },
              "TAU >= 0"));
    if (!check) {
      sub->add_option("--out", o->out, "Results folder (default: [output] dir, or results/<name>)");
      sub->add_flag("--force", o->force,
                    "Replace the runs of an earlier kvlab run in the results folder");
    }
    sub->callback([o, check, &exit_code]() { exit_code = run_all(*o, check); });
  }
}

}  // namespace kvlab::cli
