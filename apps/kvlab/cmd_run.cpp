// kvlab run FILE.toml: run every expanded config of an experiment, write results, print the
// comparison table. kvlab check FILE.toml: the same runs, every greedy token checked against
// the full-recompute reference.
#include <fmt/format.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/distributed_sweep.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab_commit.hpp"
#include "mpi_sweep.hpp"

namespace kvlab::cli {
namespace {

struct RunOptions {
  std::string file;
  std::vector<std::string> overrides;
  std::string out;
  bool force = false;
  double tolerance = 0;  // kvlab check --tolerance (ExperimentConfig::check_tolerance)
};

std::string machine_description() {
  std::string cpu;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; cpu.empty() && std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) cpu = line.substr(line.find(':') + 2);
  utsname name{};
  uname(&name);
  return fmt::format("{} {} {}, {}, {} processors, {:.1f} GiB", name.sysname, name.release,
                     name.machine, cpu.empty() ? "unknown CPU" : cpu,
                     std::thread::hardware_concurrency(),
                     static_cast<double>(allocatable_bytes()) / (1024.0 * 1024.0 * 1024.0));
}

// The folder describes itself: the experiment file as given, how it was run, by which kvlab,
// on which machine, and which runs failed. Each run's folder gets its resolved config
// (config.toml).
void write_manifest(const std::filesystem::path& folder, const RunOptions& o,
                    const std::string& experiment_text, std::size_t runs, int ranks,
                    const nlohmann::json& failed_runs) {
  write_file(folder / "experiment.toml", experiment_text);
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[32] = {};
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const nlohmann::json manifest = {{"experiment_file", o.file},
                                   {"overrides", o.overrides},
                                   {"runs", runs},
                                   {"failed_runs", failed_runs},
                                   {"kvlab_version", KVLAB_VERSION},
                                   {"kvlab_commit", KVLAB_COMMIT},
                                   {"finished_utc", when},
                                   {"machine", machine_description()},
                                   {"ranks", ranks}};
  write_file(folder / "manifest.json", manifest.dump(2) + "\n");
}

// "N of M requests rejected: reason (xK), ..." from a run's events; empty when any finished.
std::string all_rejected_reasons(const RunOutput& out) {
  if (out.summary.finished > 0 || out.summary.rejected == 0) return "";
  std::map<std::string, int> reasons;
  for (const auto& event : out.engine.events)
    if (event.kind == EventKind::event_reject)
      ++reasons[event.reason.empty() ? "no reason given" : event.reason];
  constexpr std::size_t kShown = 5;  // events.jsonl has every one
  std::string text;
  std::size_t shown = 0;
  for (const auto& [reason, count] : reasons)
    if (shown++ < kShown) text += fmt::format("\n  {} x {}", count, reason);
  if (reasons.size() > kShown)
    text +=
        fmt::format("\n  ... {} more distinct reasons in events.jsonl", reasons.size() - kShown);
  return text;
}

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

// What the table's times are: the clock, and on the virtual clock what times each step.
std::string clock_description(const std::vector<ExperimentRun>& runs) {
  const ExperimentConfig& c = runs.front().config;
  for (const auto& run : runs)
    if (run.config.clock != c.clock || run.config.profile != c.profile)
      return "times: each run's own clock (see its summary.json)";
  const std::string model = fmt::format("the roofline cost model of profile {}", c.profile);
  if (c.clock == EngineClock::measured)
    return "measured clock: each step lasts what Backend::forward (and its swap copies) took";
  if (c.clock == EngineClock::wall) return "wall clock: arrivals and steps in real time";
  if (c.clock == EngineClock::offline)
    return fmt::format("offline (all at t = 0), steps timed by {}", model);
  return fmt::format("virtual clock, steps timed by {}", model);
}

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
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string eta =
      i == 0
          ? "?"
          : fmt::format("{:.0f}s", elapsed / static_cast<double>(i) * static_cast<double>(n - i));
  const std::string line = fmt::format("{}[{}/{}] {} {} (ETA {})", rank, i + 1, n, c.name,
                                       c.label.empty() ? "" : c.label, eta);
  if (tty)
    fmt::print(stderr, "\r\033[K{}", line);
  else
    fmt::print(stderr, "{}\n", line);
}

// Runs `runs[i]` and writes its outputs into `folder` (none for kvlab check). A kvlab::Error
// becomes the record's error: the sweep's other runs go on and keep their results.
RunRecord execute_run(const std::vector<ExperimentRun>& runs, std::size_t i, bool check,
                      const std::filesystem::path& folder, int rank) {
  RunRecord r;
  r.index = i;
  r.rank = rank;
  const ExperimentRun& run = runs[i];
  try {
    const RunOutput out = run_experiment(run.config, check, &r.mismatches);
    if (!folder.empty()) {
      write_run_outputs(folder, run.config, out);
      write_file(folder / "config.toml", run.config.resolved_toml + "\n");
    }
    r.wall_s = out.wall_s;
    r.engine_wall_s = out.engine_wall_s;
    r.forward_wall_s = out.forward_wall_s;
    r.forwards = out.forwards;
    r.forwards_with_chosen_tokens = out.forwards_with_chosen_tokens;
    r.graph_replays = out.graph_replays;
    r.graph_captures = out.graph_captures;
    r.finished = out.summary.finished;
    r.checked_tokens = out.check.tokens;
    r.off_argmax = out.check.off_argmax;
    r.max_gap = out.check.max_gap;
    r.logits = out.check.logits;
    r.logprobs = out.check.logprobs;
    if (const std::string reasons = all_rejected_reasons(out); !reasons.empty())
      r.all_rejected =
          fmt::format("all {} requests were rejected:{}", out.summary.rejected, reasons);
    r.row = summary_values(runs.front().config, out);  // one column set
  } catch (const WriteError&) {
    throw;  // the disk, not the run: the whole job stops
  } catch (const Error& e) {
    r = RunRecord{};
    r.index = i;
    r.rank = rank;
    r.error = e.what();
  }
  return r;
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

// Rank 0: writes the files other ranks carried into their runs' folders.
void write_carried_files(const std::vector<ExperimentRun>& runs,
                         const std::vector<RunRecord>& records,
                         const std::filesystem::path& out_dir) {
  for (const RunRecord& r : records) {
    const std::filesystem::path folder = out_dir / run_directory_name(runs[r.index], r.index);
    for (const auto& [path, contents] : r.files) {
      std::filesystem::create_directories((folder / path).parent_path());
      write_file(folder / path, contents);
    }
  }
}

// What kvlab check counted over every run.
struct CheckTotals {
  std::int64_t finished = 0, mismatches = 0, tokens = 0, off_argmax = 0;
  double max_gap = 0;
  LogprobAgreement logprobs;
  void add(const RunRecord& r) {
    finished += r.finished;
    mismatches += static_cast<std::int64_t>(r.mismatches.size());
    tokens += r.checked_tokens;
    off_argmax += r.off_argmax;
    max_gap = std::max(max_gap, r.max_gap);
    logprobs.merge(r.logprobs);
  }
};

// kvlab check of requests that asked for log-probabilities: how many were compared, how closely.
void print_logprob_agreement(const LogprobAgreement& a, double tolerance) {
  if (a.tokens == 0) return;
  fmt::print(
      "kvlab check: log-probabilities of {} tokens and {} top entries beside them within {} of "
      "the reference's (max |engine - reference| {:.3g})\n",
      a.tokens, a.entries, logprob_tolerance(tolerance), a.max_abs_delta);
}

// kvlab check's verdict: exit 1 when nothing finished, a run rejected everything, or a token
// differs from the reference (beyond the tolerance).
int check_verdict(const CheckTotals& t, bool any_all_rejected, double tolerance) {
  if (t.finished == 0) {
    fmt::print(stderr, "kvlab check: no request finished, so nothing was checked\n");
    return 1;
  }
  if (any_all_rejected) return 1;
  if (t.mismatches > 0) {
    fmt::print(stderr, "kvlab check: {} request(s) differ from the reference{}\n", t.mismatches,
               tolerance > 0 ? fmt::format(" beyond the tolerance {}", tolerance) : "");
    return 1;
  }
  print_logprob_agreement(t.logprobs, tolerance);
  if (tolerance == 0) {
    fmt::print("kvlab check: every finished request's tokens equal the reference's\n");
    return 0;
  }
  fmt::print(
      "kvlab check: every finished request's tokens are within {} of the reference's best logit "
      "({} of {} tokens are not its argmax; largest gap {:.4g})\n",
      tolerance, t.off_argmax, t.tokens, t.max_gap);
  return 0;
}

// kvlab check --tolerance, one run: how far its logits were from the reference's.
std::string logit_agreement_line(const std::string& label, const LogitAgreement& a) {
  if (a.top_positions == 0) return {};
  const std::string rows =
      a.rows == a.top_positions
          ? fmt::format("{} positions", a.rows)
          : fmt::format("the first {} of {} positions (the rows that fit the memory kept)", a.rows,
                        a.top_positions);
  return fmt::format(
      "logits [{}]: max |engine - reference| {:.3g} over {} (each position's max: mean {:.3g}); "
      "top-5 overlap {:.1f}% over {} tokens. An argmax of logits within {:.3g} of the "
      "reference's is within {:.3g} of its best\n",
      label, a.max_abs_delta, rows, a.mean_row_max_delta(), 100.0 * a.top_overlap(),
      a.top_positions, a.max_abs_delta, 2 * a.max_abs_delta);
}

// Where the runs' time went: wall, engine, the share outside Backend::forward, and how many
// forwards returned the tokens the backend picked (Backend::choose_tokens) instead of logits, and
// how many replayed a CUDA graph.
std::string wall_line(const std::vector<RunRecord>& records) {
  double wall = 0, engine = 0, forward = 0;
  std::int64_t forwards = 0, chosen = 0, replays = 0, captures = 0;
  for (const RunRecord& r : records) {
    if (!r.error.empty()) continue;
    wall += r.wall_s;
    engine += r.engine_wall_s;
    forward += r.forward_wall_s;
    forwards += r.forwards;
    chosen += r.forwards_with_chosen_tokens;
    replays += r.graph_replays;
    captures += r.graph_captures;
  }
  return fmt::format(
      "wall {:.1f} s ({:.1f} s in the engine, {:.1f}% of that outside Backend::forward{}{})", wall,
      engine, engine > 0 ? 100.0 * (engine - forward) / engine : 0.0,
      chosen > 0
          ? fmt::format("; the backend picked the tokens in {} of {} forwards", chosen, forwards)
          : "",
      captures > 0 ? fmt::format("; {} replayed a CUDA graph ({} captured)", replays, captures)
                   : "");
}

// What rank 0 reports once every run is in, and the files that index the results folder.
struct Report {
  int exit_code = 0;
  std::string summary_md;
  nlohmann::json index = nlohmann::json::array();   // runs.json: the runs that finished
  nlohmann::json failed = nlohmann::json::array();  // manifest.json: the runs that failed
};

// Prints the table, the errors and kvlab check's verdict.
Report report(bool check, int ranks, const std::vector<ExperimentRun>& runs,
              std::vector<RunRecord> records) {
  std::sort(records.begin(), records.end(),
            [](const RunRecord& a, const RunRecord& b) { return a.index < b.index; });
  Report out;
  std::vector<std::string> errors;  // runs that failed, or in which no request finished
  std::string logit_lines;          // kvlab check --tolerance: each run's logit agreement
  CheckTotals totals;
  std::vector<SummaryRow> rows;
  for (const RunRecord& r : records) {
    const ExperimentRun& run = runs[r.index];
    const std::string label = run.config.label.empty() ? "base" : run.config.label;
    if (!r.error.empty()) {
      errors.push_back(fmt::format("run {} ({}) failed{}: {}", r.index + 1, label,
                                   ranks > 1 ? fmt::format(" on rank {}", r.rank) : "", r.error));
      out.failed.push_back({{"run", r.index + 1}, {"label", run.config.label}, {"error", r.error}});
      continue;
    }
    totals.add(r);
    if (!r.all_rejected.empty())
      errors.push_back(fmt::format("run {} ({}): {}", r.index + 1, label, r.all_rejected));
    rows.push_back({run.config.label, r.row});
    out.index.push_back({{"dir", run_directory_name(run, r.index)},
                         {"label", run.config.label},
                         {"repeat", run.repeat}});
    for (const auto& m : r.mismatches) fmt::print(stderr, "mismatch [{}]: {}\n", label, m);
    if (check) logit_lines += logit_agreement_line(label, r.logits);
  }
  const std::string name = runs.front().config.name;
  const std::string table = summary_table(summary_columns(runs.front().config), rows);
  fmt::print("{} ({} run{}; {})\n\n{}", name, runs.size(), runs.size() > 1 ? "s" : "",
             clock_description(runs), table);
  if (!logit_lines.empty()) fmt::print("\n{}", logit_lines);
  fmt::print(stderr, "{}\n", wall_line(records));
  for (const auto& message : errors) fmt::print(stderr, "kvlab: error: {}\n", message);
  out.summary_md = "# " + name + "\n\n" + table;
  out.exit_code = check
                      ? check_verdict(totals, !errors.empty(), runs.front().config.check_tolerance)
                  : errors.empty() ? 0
                                   : 1;
  return out;
}

// The index files into the staging folder, then the folder into place.
void finish_results(ResultsFolder& folder, const Report& r, const RunOptions& o,
                    const std::string& experiment_text, std::size_t runs, int ranks) {
  write_file(folder.staging() / "summary.md", r.summary_md);
  write_file(folder.staging() / "runs.json", r.index.dump(2) + "\n");
  write_manifest(folder.staging(), o, experiment_text, runs, ranks, r.failed);
  folder.commit();
  for (const std::string& note : folder.notes()) fmt::print(stderr, "kvlab: {}\n", note);
  fmt::print("\nresults: {}\n", folder.path().string());
}

std::string read_experiment_text(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw Error(fmt::format("cannot read {}", file));
  return text.str();
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
    runs = load_experiment(o.file, o.overrides);  // every error before anything runs
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
    const Report r = report(check, ranks.size(), runs, std::move(records));
    if (!check && !r.index.empty())  // a folder of failed runs only is not written at all
      finish_results(*folder, r, o, experiment_text, runs.size(), ranks.size());
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
    sub->add_option("--set", o->overrides,
                    "Override a key: --set scheduler.name=fcfs (repeatable)");
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
