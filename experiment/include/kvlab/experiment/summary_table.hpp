#pragma once
// The comparison table `kvlab run` prints and writes to summary.md: one row per sweep point,
// the columns every run has, then the ones an experiment asks for ([output] columns). Repeats
// of a point (experiment.repeats) are one row: each number is the mean with its 95% interval
// (Student's t over the repeats), "mean ± half-width".
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/experiment/experiment.hpp"

namespace kvlab {

// What [output] columns accepts.
//   prefix_hit_rate    prompt tokens served from the prefix cache / prompt tokens looked up
//   goodput            requests per second that met every SLO in [slo]
//   slo_attainment     share of submitted requests that met every SLO
//   ttft_by_priority   TTFT p50 and p99 of each priority level of the workload
//   recomputed_tokens  tokens computed again after recompute preemptions
//   swapped_mib        KV copied to and from the host swap pool (MiB, in the pool's dtype)
//   e2e_p50            end-to-end latency, median
//   queue_p99          queue delay (arrival to first scheduled), p99
inline constexpr std::string_view kExtraColumns[] = {
    "prefix_hit_rate",   "goodput",     "slo_attainment", "ttft_by_priority",
    "recomputed_tokens", "swapped_mib", "e2e_p50",        "queue_p99"};

struct SummaryColumn {
  std::string header;
  int decimals = 0;
  bool percent = false;  // the value is a fraction, shown x 100 with "%"
};

// The columns of an experiment's table (every sweep point of a file shares them).
std::vector<SummaryColumn> summary_columns(const ExperimentConfig& config);

// One run's values, in summary_columns(config) order.
std::vector<double> summary_values(const ExperimentConfig& config, const RunOutput& out);

struct SummaryRow {
  std::string label;           // the sweep point; rows with equal labels are its repeats
  std::vector<double> values;  // summary_values
};

// The markdown table: repeats of one label merged into "mean ± half-width" (95%, t with n-1
// degrees of freedom), in the order labels first appear.
std::string summary_table(std::span<const SummaryColumn> columns, std::span<const SummaryRow> rows);

// The 95% interval's half-width of the mean of `values` (0 for fewer than 2).
double confidence_half_width_95(std::span<const double> values);

}  // namespace kvlab
