#include "kvlab/experiment/summary_table.hpp"

#include <fmt/format.h>

#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/workload/workload.hpp"

#include <algorithm>
#include <boost/math/distributions/students_t.hpp>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace kvlab {
namespace {

constexpr double kNone = std::numeric_limits<double>::quiet_NaN();  // a cell with no value: "-"

bool per_level(const MetricColumn& column) {
  return std::string_view(column.header).find("{level}") != std::string_view::npos;
}
// A column per tenant of [[workload.tenants]] (the metric's value: an object by tenant name).
bool per_tenant(const MetricColumn& column) {
  return std::string_view(column.header).find("{tenant}") != std::string_view::npos;
}

// Calls add(metric, columns) for each metric shown, with its columns in the table: every
// metric's columns shown always (registry order), then those of each [output] columns name
// (the file's order).
template <typename Add>
void for_each_metric_shown(const ExperimentConfig& c, Add&& add) {
  auto columns_of = [](const RunMetric& m, std::string_view option) {
    std::vector<const MetricColumn*> columns;
    for (const MetricColumn& column : m.columns)
      if (column.option == option) columns.push_back(&column);
    return columns;
  };
  for (const RunMetric& m : run_metrics())
    if (const auto columns = columns_of(m, ""); !columns.empty()) add(m, columns);
  for (const std::string& name : c.table_columns)
    for (const RunMetric& m : run_metrics())
      if (const auto columns = columns_of(m, name); !columns.empty()) add(m, columns);
}

// A column's number from the metric's value: the value, or one statistic of a latency; NaN
// where there is none (a latency over no request: a priority level nobody was in).
double column_value(const nlohmann::json& value, const MetricColumn& column) {
  if (!column.statistic.empty() && value.value("count", std::int64_t{1}) == 0) return kNone;
  const nlohmann::json& v = column.statistic.empty() ? value : value.at(column.statistic);
  return v.is_number() ? v.get<double>() * column.scale : kNone;
}

// The mean (± the 95% interval over repeats) of the values that exist; "-" when none does.
std::string format_cell(const SummaryColumn& column, std::span<const double> all) {
  std::vector<double> values;
  for (double v : all)
    if (!std::isnan(v)) values.push_back(v);
  if (values.empty()) return "-";
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
  std::vector<SummaryColumn> table;
  const RunOutput empty;  // a per-level metric's levels come from the config
  for_each_metric_shown(config, [&](const RunMetric& m, const auto& columns) {
    if (per_tenant(*columns.front())) {  // tenant-major, as levels
      for (const TenantSpec& tenant : config.tenants)
        for (const MetricColumn* column : columns)
          table.push_back(
              {fmt::format(fmt::runtime(column->header), fmt::arg("tenant", tenant.name)),
               column->decimals, column->percent});
      return;
    }
    const bool levels = per_level(*columns.front());
    const std::size_t count = levels ? m.extract(config, empty).size() : 1;
    for (std::size_t level = 0; level < count; ++level)  // level-major: p50, p99 of level 0, ...
      for (const MetricColumn* column : columns)
        table.push_back({levels
                             ? fmt::format(fmt::runtime(column->header), fmt::arg("level", level))
                             : std::string(column->header),
                         column->decimals, column->percent});
  });
  return table;
}

std::vector<double> summary_values(const ExperimentConfig& config, const RunOutput& out) {
  std::vector<double> values;
  for_each_metric_shown(config, [&](const RunMetric& m, const auto& columns) {
    const nlohmann::json value = m.extract(config, out);
    if (per_tenant(*columns.front())) {
      for (const TenantSpec& tenant : config.tenants)
        for (const MetricColumn* column : columns)
          values.push_back(value.is_object() && value.contains(tenant.name)
                               ? column_value(value.at(tenant.name), *column)
                               : kNone);
      return;
    }
    if (!per_level(*columns.front())) {
      for (const MetricColumn* column : columns) values.push_back(column_value(value, *column));
      return;
    }
    for (const nlohmann::json& level : value)
      for (const MetricColumn* column : columns) values.push_back(column_value(level, *column));
  });
  return values;
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
