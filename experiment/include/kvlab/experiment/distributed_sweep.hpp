#pragma once
// A sweep split across processes (MPI ranks, apps/kvlab/mpi_sweep.cpp): which runs each rank
// takes, and one run's outcome as bytes that travel to rank 0, which writes the results folder
// exactly as a single process would. No MPI here: the transport lives in the kvlab tool.
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/logit_agreement.hpp"
#include "kvlab/experiment/logprob_agreement.hpp"

namespace kvlab {

// A run's relative cost, to balance ranks: tokens it serves (requests x (prompt + 2 x output)
// means; decode tokens take a step each) x the backend's cost per token (the simulated backend
// computes nothing: 1; a computing backend: 50). A heuristic: only the ratios matter.
double estimated_run_cost(const ExperimentConfig& config);

// Runs (by index) for each of `ranks` ranks: longest first, each to the least loaded rank
// (ties: the lowest rank), each rank's list in ascending order. Deterministic.
std::vector<std::vector<std::size_t>> balance_runs(std::span<const double> costs, int ranks);

// One run's outcome: what rank 0 needs to write its folder and its row of the summary table.
struct RunRecord {
  std::uint64_t index = 0;  // in the expanded sweep
  int rank = 0;             // that ran it
  std::string error;        // non-empty: the run failed (why); nothing below is set
  std::vector<std::pair<std::string, std::string>> files;  // path in its folder -> contents
  std::vector<double> row;                                 // summary_values
  std::int64_t finished = 0;
  std::string all_rejected;             // all_rejected_reasons: set when no request finished
  std::vector<std::string> mismatches;  // kvlab check
  std::int64_t checked_tokens = 0, off_argmax = 0;  // kvlab check (RunOutput::Check)
  double max_gap = 0;
  LogitAgreement logits;      // kvlab check --tolerance
  LogprobAgreement logprobs;  // kvlab check of workload.logprobs
  double wall_s = 0, engine_wall_s = 0, forward_wall_s = 0;
  std::int64_t forwards = 0, forwards_with_chosen_tokens = 0;  // RunOutput's
  std::int64_t graph_replays = 0, graph_captures = 0;          // RunOutput's
  // The measured clock's trust: step time over the profile's price at the median (0: not
  // measured against a profile), and the machine's 1-minute load average as the run started
  // (-1: not read).
  double step_time_ratio_p50 = 0, machine_load_1m = -1;
};

// Bytes: an 8-byte little-endian header length, a JSON header, then every file's contents.
std::string encode_run_record(const RunRecord& record);
// Throws kvlab::Error naming what is wrong with a malformed or truncated record.
RunRecord decode_run_record(std::string_view bytes);

// Every regular file under `folder` (recursively) as (path relative to it, contents), sorted.
std::vector<std::pair<std::string, std::string>> read_folder_files(
    const std::filesystem::path& folder);

}  // namespace kvlab
