#include "kvlab/experiment/summary_table.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/math/distributions/students_t.hpp>
#include <cmath>
#include <map>

namespace kvlab {
namespace {

// The workload's priority levels: 0 .. weights - 1.
int priority_levels(const ExperimentConfig& c) {
  return std::max<int>(1, static_cast<int>(c.workload.priority_weights.size()));
}

// TTFT p50 and p99 of the finished requests of one priority.
LatencySummary ttft_of_priority(const RunOutput& out, int priority) {
  std::vector<double> ttft;
  for (const auto& r : out.engine.requests)
    if (r.priority == priority)
      if (const auto t = r.ttft_s()) ttft.push_back(*t);
  return summarize_latencies(std::move(ttft));
}

void add_extra_columns(const ExperimentConfig& c, std::vector<SummaryColumn>& columns) {
  for (const std::string& name : c.table_columns) {
    if (name == "prefix_hit_rate") columns.push_back({"prefix hit", 1, true});
    if (name == "goodput") columns.push_back({"goodput req/s", 2, false});
    if (name == "slo_attainment") columns.push_back({"SLO met", 1, true});
    if (name == "ttft_by_priority")
      for (int p = 0; p < priority_levels(c); ++p) {
        columns.push_back({fmt::format("TTFT p50 prio {}", p), 3, false});
        columns.push_back({fmt::format("TTFT p99 prio {}", p), 3, false});
      }
    if (name == "recomputed_tokens") columns.push_back({"recomputed tok", 0, false});
    if (name == "swapped_mib") columns.push_back({"swapped MiB", 1, false});
    if (name == "e2e_p50") columns.push_back({"e2e p50 (s)", 3, false});
    if (name == "queue_p99") columns.push_back({"queue p99 (s)", 3, false});
  }
}

void add_extra_values(const ExperimentConfig& c, const RunOutput& out, std::vector<double>& v) {
  const RunSummary& s = out.summary;
  for (const std::string& name : c.table_columns) {
    if (name == "prefix_hit_rate") v.push_back(out.prefix_hit_rate);
    if (name == "goodput") v.push_back(s.goodput_per_s);
    if (name == "slo_attainment")
      v.push_back(s.submitted ? static_cast<double>(s.slo_met) / static_cast<double>(s.submitted)
                              : 0.0);
    if (name == "ttft_by_priority")
      for (int p = 0; p < priority_levels(c); ++p) {
        const LatencySummary t = ttft_of_priority(out, p);
        v.push_back(t.p50);
        v.push_back(t.p99);
      }
    if (name == "recomputed_tokens") v.push_back(static_cast<double>(s.recomputed_tokens));
    if (name == "swapped_mib") v.push_back(static_cast<double>(s.swapped_bytes) / (1 << 20));
    if (name == "e2e_p50") v.push_back(s.e2e_s.p50);
    if (name == "queue_p99") v.push_back(s.queue_delay_s.p99);
  }
}

std::string format_cell(const SummaryColumn& column, std::span<const double> values) {
  double mean = 0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(values.size());
  const double scale = column.percent ? 100.0 : 1.0;
  const char* unit = column.percent ? "%" : "";
  std::string cell = fmt::format("{:.{}f}{}", mean * scale, column.decimals, unit);
  if (values.size() > 1)
    cell += fmt::format(" ± {:.{}f}", confidence_half_width_95(values) * scale, column.decimals);
  return cell;
}

}  // namespace

std::vector<SummaryColumn> summary_columns(const ExperimentConfig& config) {
  std::vector<SummaryColumn> columns = {
      {"finished", 0, false},     {"rejected", 0, false},     {"req/s", 2, false},
      {"out tok/s", 1, false},    {"TTFT p50 (s)", 3, false}, {"TTFT p99", 3, false},
      {"TPOT p50", 4, false},     {"TPOT p99", 4, false},     {"ITL p99", 4, false},
      {"preempt", 0, false},      {"KV used", 1, true},       {"KV waste/held", 1, true},
      {"KV waste/pool", 1, true},
  };
  add_extra_columns(config, columns);
  return columns;
}

std::vector<double> summary_values(const ExperimentConfig& config, const RunOutput& out) {
  const RunSummary& s = out.summary;
  std::vector<double> v = {static_cast<double>(s.finished),
                           static_cast<double>(s.rejected),
                           s.requests_per_s,
                           s.output_tokens_per_s,
                           s.ttft_s.p50,
                           s.ttft_s.p99,
                           s.tpot_s.p50,
                           s.tpot_s.p99,
                           s.itl_s.p99,
                           static_cast<double>(s.preemptions),
                           out.mean_kv_used,
                           out.kv_waste_of_held,
                           out.mean_kv_waste};
  add_extra_values(config, out, v);
  return v;
}

double confidence_half_width_95(std::span<const double> values) {
  const std::size_t n = values.size();
  if (n < 2) return 0;
  double mean = 0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(n);
  double squares = 0;
  for (double v : values) squares += (v - mean) * (v - mean);
  const double sd = std::sqrt(squares / static_cast<double>(n - 1));
  const boost::math::students_t t(static_cast<double>(n - 1));
  return boost::math::quantile(boost::math::complement(t, 0.025)) * sd /
         std::sqrt(static_cast<double>(n));
}

std::string summary_table(std::span<const SummaryColumn> columns,
                          std::span<const SummaryRow> rows) {
  std::vector<std::string> order;  // labels as they first appear
  std::map<std::string, std::vector<const SummaryRow*>> repeats;
  for (const SummaryRow& row : rows) {
    if (!repeats.contains(row.label)) order.push_back(row.label);
    repeats[row.label].push_back(&row);
  }
  std::string table = "| run |";
  std::string rule = "|---|";
  for (const auto& c : columns) {
    table += fmt::format(" {} |", c.header);
    rule += "---|";
  }
  table += "\n" + rule + "\n";
  for (const std::string& label : order) {
    const auto& runs = repeats[label];
    table += fmt::format("| {}{} |", label.empty() ? "(base)" : label,
                         runs.size() > 1 ? fmt::format(" (n={})", runs.size()) : "");
    for (std::size_t c = 0; c < columns.size(); ++c) {
      std::vector<double> values;
      for (const SummaryRow* r : runs) values.push_back(r->values[c]);
      table += fmt::format(" {} |", format_cell(columns[c], values));
    }
    table += "\n";
  }
  return table;
}

}  // namespace kvlab
