#pragma once
// Small SVG figures kvlab writes beside its tables (no plotting dependency on the machine):
// scatter plots with their Pareto front marked, for quality against memory.
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab::cli {

struct ScatterPoint {
  std::string label;
  double x = 0, y = 0;
};

// `text` with &, < and > as entities: safe inside an SVG or HTML element.
std::string escape_markup(std::string_view text);

// The points no other point beats on both axes (x lower is better; y lower when
// `lower_y_is_better`, else higher), by increasing x.
std::vector<std::size_t> pareto_front(std::span<const ScatterPoint> points, bool lower_y_is_better);

// A scatter of `points` (axes from 0 to a little past the largest value), each point numbered
// as its index + 1 with its label in a tooltip, the Pareto front joined by a line.
std::string scatter_svg(std::string_view title, std::string_view x_label, std::string_view y_label,
                        std::span<const ScatterPoint> points, bool lower_y_is_better);

}  // namespace kvlab::cli
