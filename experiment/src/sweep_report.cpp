// A sweep's runs and its report, for `kvlab run` / `kvlab check` (and anything else that runs
// experiment files): each run executed into its folder, the report (table, errors, kvlab
// check's verdict) as text, and the files that index a results folder.
#include "kvlab/experiment/sweep_report.hpp"

#include <fmt/format.h>
#include <sys/utsname.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "kvlab/error.hpp"
#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/results_view.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "kvlab/memory_limit.hpp"

namespace kvlab {
namespace {

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
void add_logprob_agreement(const LogprobAgreement& a, double tolerance, SweepReport& out) {
  if (a.tokens == 0) return;
  out.say(fmt::format(
      "kvlab check: log-probabilities of {} tokens and {} top entries beside them within {} of "
      "the reference's (max |engine - reference| {:.3g})\n",
      a.tokens, a.entries, logprob_tolerance(tolerance), a.max_abs_delta));
}

// kvlab check's verdict: exit 1 when nothing finished, a run rejected everything, or a token
// differs from the reference (beyond the tolerance).
int check_verdict(const CheckTotals& t, bool any_all_rejected, double tolerance, SweepReport& out) {
  if (t.finished == 0) {
    out.warn("kvlab check: no request finished, so nothing was checked\n");
    return 1;
  }
  if (any_all_rejected) return 1;
  if (t.mismatches > 0) {
    out.warn(fmt::format("kvlab check: {} request(s) differ from the reference{}\n", t.mismatches,
                         tolerance > 0 ? fmt::format(" beyond the tolerance {}", tolerance) : ""));
    return 1;
  }
  add_logprob_agreement(t.logprobs, tolerance, out);
  if (tolerance == 0) {
    out.say("kvlab check: every finished request's tokens equal the reference's\n");
    return 0;
  }
  out.say(fmt::format(
      "kvlab check: every finished request's tokens are within {} of the reference's best logit "
      "({} of {} tokens are not its argmax; largest gap {:.4g})\n",
      tolerance, t.off_argmax, t.tokens, t.max_gap));
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
// forwards returned the tokens the backend picked (ForwardResult::tokens) instead of logits, and
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

// The folder describes itself: the experiment file as given, how it was run, by which kvlab,
// on which machine, and which runs failed. Each run's folder gets its resolved config
// (config.toml).
void write_manifest(const std::filesystem::path& folder, const ManifestInfo& info, std::size_t runs,
                    const nlohmann::json& failed_runs) {
  write_file(folder / "experiment.toml", info.experiment_text);
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[32] = {};
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const nlohmann::json manifest = {{"experiment_file", info.experiment_file},
                                   {"overrides", info.changes.set},
                                   {"sweeps", info.changes.sweep},
                                   {"runs", runs},
                                   {"failed_runs", failed_runs},
                                   {"kvlab_version", info.kvlab_version},
                                   {"kvlab_commit", info.kvlab_commit},
                                   {"finished_utc", when},
                                   {"machine", machine_description()},
                                   {"load_average_1m", machine_load_1m()},
                                   {"cpu_mhz", mean_cpu_mhz()},
                                   {"ranks", info.ranks}};
  write_file(folder / "manifest.json", manifest.dump(2) + "\n");
}

}  // namespace

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

double machine_load_1m() {
  std::ifstream loadavg("/proc/loadavg");
  double load = -1;
  if (!(loadavg >> load)) return -1;
  return load;
}

double mean_cpu_mhz() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  double sum = 0;
  int count = 0;
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("cpu MHz", 0) == 0 && line.find(':') != std::string::npos) {
      sum += std::strtod(line.c_str() + line.find(':') + 1, nullptr);
      ++count;
    }
  return count > 0 ? sum / count : -1;
}

namespace {

// False (with a warning) when a measured run's steps took far from the profile's price: the
// machine was busy, or the profile is another machine's.
bool measured_steps_trusted(const RunRecord& r, const std::string& label, SweepReport& out) {
  const double ratio = r.step_time_ratio_p50;
  if (ratio <= 0 || (ratio <= kUntrustedStepRatio && ratio >= 1 / kUntrustedStepRatio)) return true;
  out.warn(fmt::format(
      "kvlab: warning: run {} ({}): its steps took {:.2f}x the profile's price at the median "
      "(beyond {}x either way; the 1-minute load was {:.2f} as it started): the machine was "
      "busy or the profile is not this machine's, so its times are not this machine's speed; "
      "the table marks it (!)\n",
      r.index + 1, label, ratio, kUntrustedStepRatio, r.machine_load_1m));
  return false;
}

// A warning when the runs timed by the machine started under very different loads.
void warn_about_uneven_load(const std::vector<RunRecord>& records, SweepReport& out) {
  double low = -1, high = -1;
  for (const RunRecord& r : records)
    if (r.error.empty() && r.machine_load_1m >= 0) {
      low = low < 0 ? r.machine_load_1m : std::min(low, r.machine_load_1m);
      high = std::max(high, r.machine_load_1m);
    }
  if (high > 1 && high > 2 * std::max(low, 0.5))
    out.warn(fmt::format(
        "kvlab: warning: the runs started under 1-minute loads from {:.2f} to {:.2f}: a busy "
        "machine stretches some runs' steps and not others'; compare them on a quiet machine\n",
        low, high));
}

}  // namespace

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
  if (c.clock == EngineClock::paced)
    return fmt::format(
        "paced wall clock: real arrivals, each step lasting at least its price by {}", model);
  if (c.clock == EngineClock::offline)
    return fmt::format("offline (all at t = 0), steps timed by {}", model);
  return fmt::format("virtual clock, steps timed by {}", model);
}

RunRecord record_run(const std::vector<ExperimentRun>& runs, std::size_t i, const RunOutput& out,
                     const std::filesystem::path& folder, int rank) {
  RunRecord r;
  r.index = i;
  r.rank = rank;
  const ExperimentRun& run = runs[i];
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
  if (out.step_time_ratio) r.step_time_ratio_p50 = out.step_time_ratio->p50;
  r.machine_load_1m = out.machine_load_1m;
  r.checked_tokens = out.check.tokens;
  r.off_argmax = out.check.off_argmax;
  r.max_gap = out.check.max_gap;
  r.logits = out.check.logits;
  r.logprobs = out.check.logprobs;
  if (const std::string reasons = all_rejected_reasons(out); !reasons.empty())
    r.all_rejected = fmt::format("all {} requests were rejected:{}", out.summary.rejected, reasons);
  r.row = summary_values(runs.front().config, out);  // one column set
  return r;
}

// Runs `runs[i]` and writes its outputs into `folder` (none for kvlab check). A kvlab::Error
// becomes the record's error: the sweep's other runs go on and keep their results.
RunRecord execute_run(const std::vector<ExperimentRun>& runs, std::size_t i, bool check,
                      const std::filesystem::path& folder, int rank) {
  try {
    std::vector<std::string> mismatches;
    const RunOutput out = run_experiment(runs[i].config, check, &mismatches);
    RunRecord r = record_run(runs, i, out, folder, rank);
    r.mismatches = std::move(mismatches);
    return r;
  } catch (const WriteError&) {
    throw;  // the disk, not the run: the whole job stops
  } catch (const Error& e) {
    RunRecord r;
    r.index = i;
    r.rank = rank;
    r.error = e.what();
    return r;
  }
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

SweepReport report_sweep(bool check, int ranks, const std::vector<ExperimentRun>& runs,
                         std::vector<RunRecord> records) {
  std::sort(records.begin(), records.end(),
            [](const RunRecord& a, const RunRecord& b) { return a.index < b.index; });
  SweepReport out;
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
    const bool trusted = measured_steps_trusted(r, label, out);
    rows.push_back({trusted ? run.config.label : run.config.label + " (!)", r.row});
    out.index.push_back({{"dir", run_directory_name(run, r.index)},
                         {"label", run.config.label},
                         {"swept", swept_json(run.config)},
                         {"repeat", run.repeat}});
    for (const auto& m : r.mismatches) out.warn(fmt::format("mismatch [{}]: {}\n", label, m));
    if (check) logit_lines += logit_agreement_line(label, r.logits);
  }
  warn_about_uneven_load(records, out);
  const std::string name = runs.front().config.name;
  const std::string table = summary_table(summary_columns(runs.front().config), rows);
  out.say(fmt::format("{} ({} run{}; {})\n\n{}", name, runs.size(), runs.size() > 1 ? "s" : "",
                      clock_description(runs), table));
  if (!logit_lines.empty()) out.say(fmt::format("\n{}", logit_lines));
  out.warn(fmt::format("{}\n", wall_line(records)));
  for (const auto& message : errors) out.warn(fmt::format("kvlab: error: {}\n", message));
  out.summary_md = "# " + name + "\n\n" + table;
  out.exit_code =
      check ? check_verdict(totals, !errors.empty(), runs.front().config.check_tolerance, out)
      : errors.empty() ? 0
                       : 1;
  return out;
}

namespace {

// A run's summary.json, which the run wrote into the folder.
nlohmann::json read_summary(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) throw Error(fmt::format("results.csv: cannot read {}", file.string()));
  return nlohmann::json::parse(text.str());
}

// A JSON value as one CSV cell: a string bare, anything else as JSON.
std::string csv_cell(const nlohmann::json& value) {
  return csv_field(value.is_string() ? value.get<std::string>() : value.dump());
}

// A metric's value flattened into columns: "name" for a number, "name.p50" for a latency's
// statistic, "name.0.p50" for a priority level's.
void flatten(const std::string& name, const nlohmann::json& value,
             std::vector<std::pair<std::string, nlohmann::json>>& cells) {
  if (value.is_object()) {
    for (const auto& [key, item] : value.items()) flatten(name + "." + key, item, cells);
  } else if (value.is_array()) {
    for (std::size_t i = 0; i < value.size(); ++i)
      flatten(name + "." + std::to_string(i), value[i], cells);
  } else {
    cells.emplace_back(name, value);
  }
}

// The column names of every row in order of first appearance.
std::vector<std::string> union_of_columns(
    const std::vector<std::vector<std::pair<std::string, nlohmann::json>>>& rows) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const auto& row : rows)
    for (const auto& [name, value] : row)
      if (seen.insert(name).second) names.push_back(name);
  return names;
}

}  // namespace

std::string results_csv(const std::filesystem::path& folder, const nlohmann::json& index) {
  std::vector<std::vector<std::pair<std::string, nlohmann::json>>> rows;
  for (const auto& entry : index) {
    const std::string dir = entry.at("dir").get<std::string>();
    const nlohmann::json summary = read_summary(folder / dir / "summary.json");
    std::vector<std::pair<std::string, nlohmann::json>> row{
        {"dir", dir}, {"repeat", entry.at("repeat")}, {"seed", summary.at("seed")}};
    for (const auto& [key, value] : entry.at("swept").items()) row.emplace_back(key, value);
    for (const RunMetric& m : run_metrics())
      if (summary.contains(m.name)) flatten(std::string(m.name), summary.at(m.name), row);
    rows.push_back(std::move(row));
  }
  const std::vector<std::string> columns = union_of_columns(rows);
  std::string csv;
  for (std::size_t i = 0; i < columns.size(); ++i) csv += (i ? "," : "") + csv_field(columns[i]);
  csv += "\n";
  for (const auto& row : rows) {
    const std::map<std::string, nlohmann::json> cells(row.begin(), row.end());
    for (std::size_t i = 0; i < columns.size(); ++i) {
      const auto cell = cells.find(columns[i]);
      csv += (i ? "," : "") + (cell == cells.end() ? std::string() : csv_cell(cell->second));
    }
    csv += "\n";
  }
  return csv;
}

void write_results_index(const std::filesystem::path& staging, const SweepReport& report,
                         const ManifestInfo& info, std::size_t runs) {
  write_file(staging / "summary.md", report.summary_md);
  write_file(staging / "results.csv", results_csv(staging, report.index));
  write_file(staging / "runs.json", report.index.dump(2) + "\n");
  write_manifest(staging, info, runs, report.failed);
}

}  // namespace kvlab
