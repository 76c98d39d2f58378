// kvlab metrics: every metric a run reports, with its definition, unit and aggregation, from
// the metric registry (docs/metrics.md is this command's output).
#include <fmt/format.h>

#include "cli_common.hpp"
#include "kvlab/experiment/metric_registry.hpp"

namespace kvlab::cli {

void register_metrics(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "metrics", "Define every metric a run reports (name, unit, definition, aggregation)");
  sub->callback([]() { fmt::print("{}", metrics_markdown()); });
}

}  // namespace kvlab::cli
