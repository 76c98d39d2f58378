#pragma once
// Every metric a run reports, one row each: its name, what it means (one sentence, with the
// literature's name where it has one), its unit, how it is aggregated over the run, and how it
// is taken from the run. The summary table's columns (and the names [output] columns accepts),
// summary.json's metric keys, requests.csv's per-request latency columns and docs/metrics.md
// (`kvlab metrics --markdown`) all come from here: adding a metric is one row and its test.
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/engine/metrics.hpp"
#include "kvlab/experiment/experiment.hpp"

namespace kvlab {

// A summary-table column showing a metric (the value, or one statistic of a latency).
struct MetricColumn {
  MetricColumn(std::string_view option_name, std::string_view header_text,
               std::string_view statistic_name, int decimal_places, bool is_percent = false,
               double value_scale = 1)
      : option(option_name),
        header(header_text),
        statistic(statistic_name),
        decimals(decimal_places),
        percent(is_percent),
        scale(value_scale) {}
  std::string_view option;     // "": in every table; else the [output] columns name adding it
  std::string_view header;     // "{level}" is each priority level's number (per-level metrics)
  std::string_view statistic;  // "": the value itself; "p50", "p99", ...: of a latency
  int decimals = 0;
  bool percent = false;  // a fraction, shown x 100 with "%"
  double scale = 1;      // the value as shown = the metric x scale
};

struct RunMetric {
  std::string_view name;  // summary.json's key
  std::string_view unit;
  std::string_view definition;
  std::string_view aggregation;
  bool in_summary_json = true;
  // The run's value: a number, a latency summary ({count, mean, p50, p90, p99, max}), an array
  // of those per priority level, or an object; null when the run has none (the key is left out).
  nlohmann::json (*extract)(const ExperimentConfig& config, const RunOutput& out) = nullptr;
  std::vector<MetricColumn> columns;
};

// One request's metric (requests.csv), empty where it has none (no token yet, rejected).
struct RequestMetric {
  std::string_view name;
  std::string_view unit;
  std::string_view definition;
  std::optional<double> (*extract)(const RequestTimeline& request) = nullptr;
};

std::span<const RunMetric> run_metrics();
std::span<const RequestMetric> request_metrics();

nlohmann::json latency_json(const LatencySummary& latency);

// A run's swept keys and their typed values, as summary.json and runs.json record them.
nlohmann::json swept_json(const ExperimentConfig& config);

// The [output] columns names, in registry order.
std::vector<std::string> metric_column_options();

// The definitions as docs/metrics.md shows them (markdown tables).
std::string metrics_markdown();

}  // namespace kvlab
