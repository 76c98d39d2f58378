#pragma once
// A sweep's runs and its report, as a library (the kvlab CLI is a thin layer over it):
//   execute_run          one expanded run, its files written into its folder
//   report_sweep         the summary table, errors and kvlab check's verdict, as lines to print
//   write_results_index  summary.md, runs.json, manifest.json and experiment.toml of the folder
#include <cstddef>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvlab/experiment/distributed_sweep.hpp"
#include "kvlab/experiment/experiment.hpp"

namespace kvlab {

// "NNN_label[_rR]": a run's folder in the results folder.
std::string run_directory_name(const ExperimentRun& run, std::size_t index);

// "N x reason" lines of a run in which no request finished; empty when any did.
std::string all_rejected_reasons(const RunOutput& out);

// What the table's times are: the clock, and on the virtual clock what times each step.
std::string clock_description(const std::vector<ExperimentRun>& runs);

// The record of a run that ran (kvlab run's, or a served one), its files written into `folder`
// (none when empty).
RunRecord record_run(const std::vector<ExperimentRun>& runs, std::size_t i, const RunOutput& out,
                     const std::filesystem::path& folder, int rank);
// Runs `runs[i]` and writes its outputs into `folder` (none: empty, as kvlab check). A
// kvlab::Error becomes the record's error (the sweep's other runs go on); a WriteError (the
// disk, not the run) is thrown.
RunRecord execute_run(const std::vector<ExperimentRun>& runs, std::size_t i, bool check,
                      const std::filesystem::path& folder, int rank);

// Writes the files other ranks carried (RunRecord::files) into their runs' folders.
void write_carried_files(const std::vector<ExperimentRun>& runs,
                         const std::vector<RunRecord>& records,
                         const std::filesystem::path& out_dir);

struct SweepReport {
  struct Line {
    bool to_stderr = false;
    std::string text;  // printed as is (its own newlines)
  };
  int exit_code = 0;
  std::vector<Line> lines;  // in order
  std::string summary_md;
  nlohmann::json index = nlohmann::json::array();   // runs.json: the runs that finished
  nlohmann::json failed = nlohmann::json::array();  // manifest.json: the runs that failed
  void say(std::string text) { lines.push_back({false, std::move(text)}); }
  void warn(std::string text) { lines.push_back({true, std::move(text)}); }
};

// Once every run is in (records in any order): the table of the runs that finished, each error,
// kvlab check's verdict (`check`), and the exit code (1 when a run failed or, for check, a
// token differs). `ranks`: how many processes ran the sweep (named in errors when > 1).
SweepReport report_sweep(bool check, int ranks, const std::vector<ExperimentRun>& runs,
                         std::vector<RunRecord> records);

// How the folder was made, for manifest.json.
struct ManifestInfo {
  std::string experiment_file;  // as given
  std::string experiment_text;  // its contents (experiment.toml)
  CommandLineChanges changes;   // --set and --sweep
  std::string kvlab_version, kvlab_commit;
  std::string machine;  // machine_description()
  int ranks = 1;
};

// results.csv of a results folder whose run folders `index` (runs.json) lists: a row per run
// (each repeat its own), columns dir, repeat, seed, each swept key (typed: a string bare,
// anything else as JSON), then every metric of the registry its summary.json reports (a
// latency as name.mean, name.p50, ...; an object's fields as name.field, an array's items as
// name.0, ...); a cell is empty where a run has no such value.
std::string results_csv(const std::filesystem::path& folder, const nlohmann::json& index);

// "Linux 6.1 x86_64, CPU model, N processors, M GiB".
std::string machine_description();
// The 1-minute load average (/proc/loadavg), and the processors' current clock averaged
// (/proc/cpuinfo "cpu MHz"); -1 where the system does not say.
double machine_load_1m();
double mean_cpu_mhz();

// A measured run's steps took this many times the profile's price at the median, or its
// inverse: beyond it, kvlab warns that its times are not this machine's speed.
constexpr double kUntrustedStepRatio = 2.0;

// summary.md, runs.json, manifest.json (with the failed runs) and experiment.toml into `staging`.
void write_results_index(const std::filesystem::path& staging, const SweepReport& report,
                         const ManifestInfo& info, std::size_t runs);

}  // namespace kvlab
