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

struct SummaryColumn {
  std::string header;
  int decimals = 0;
  bool percent = false;  // the value is a fraction, shown x 100 with "%"
};

// The columns of an experiment's table (every sweep point of a file shares them): the metric
// registry's (kvlab/experiment/metric_registry.hpp) shown always, then those the file's
// [output] columns names add.
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
