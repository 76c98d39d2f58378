#include "svg_plots.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace kvlab::cli {

std::string escape_markup(std::string_view text) {
  std::string out;
  for (const char c : text) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else
      out += c;
  }
  return out;
}

std::vector<std::size_t> pareto_front(std::span<const ScatterPoint> points,
                                      bool lower_y_is_better) {
  std::vector<std::size_t> order(points.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  const auto better = [&](double a, double b) { return lower_y_is_better ? a < b : a > b; };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (points[a].x != points[b].x) return points[a].x < points[b].x;
    return better(points[a].y, points[b].y);
  });
  std::vector<std::size_t> front;
  for (const std::size_t i : order)
    if (front.empty() || better(points[i].y, points[front.back()].y)) front.push_back(i);
  return front;
}

std::string scatter_svg(std::string_view title, std::string_view x_label, std::string_view y_label,
                        std::span<const ScatterPoint> points, bool lower_y_is_better) {
  constexpr double kWidth = 520, kHeight = 340, kLeft = 60, kBottom = 40, kTop = 30, kRight = 20;
  double x_max = 0, y_max = 0;
  for (const ScatterPoint& p : points) {
    x_max = std::max(x_max, p.x);
    y_max = std::max(y_max, p.y);
  }
  x_max = x_max > 0 ? x_max * 1.08 : 1;
  y_max = y_max > 0 ? y_max * 1.08 : 1;
  const auto px = [&](double x) { return kLeft + x / x_max * (kWidth - kLeft - kRight); };
  const auto py = [&](double y) {
    return kHeight - kBottom - y / y_max * (kHeight - kBottom - kTop);
  };
  std::string svg = fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{0}' height='{1}' font-family='sans-serif' "
      "font-size='12'><text x='{2}' y='18' font-weight='bold'>{3}</text>"
      "<line x1='{2}' y1='{4}' x2='{5}' y2='{4}' stroke='black'/>"
      "<line x1='{2}' y1='{4}' x2='{2}' y2='{6}' stroke='black'/>"
      "<text x='{7}' y='{8}' text-anchor='middle'>{9}</text>"
      "<text x='14' y='{10}' text-anchor='middle' transform='rotate(-90 14 {10})'>{11}</text>",
      kWidth, kHeight, kLeft, escape_markup(title), kHeight - kBottom, kWidth - kRight, kTop,
      (kLeft + kWidth - kRight) / 2, kHeight - 8, x_label, (kTop + kHeight - kBottom) / 2, y_label);
  for (int t = 0; t <= 4; ++t) {  // ticks at fifths of each axis
    const double x = x_max * t / 5, y = y_max * t / 5;
    svg += fmt::format(
        "<text x='{}' y='{}' text-anchor='middle'>{:.3g}</text><text x='{}' y='{}' "
        "text-anchor='end'>{:.3g}</text>",
        px(x), kHeight - kBottom + 16, x, kLeft - 4, py(y) + 4, y);
  }
  const std::vector<std::size_t> front = pareto_front(points, lower_y_is_better);
  std::string line;
  for (const std::size_t i : front)
    line += fmt::format("{:.1f},{:.1f} ", px(points[i].x), py(points[i].y));
  svg += fmt::format("<polyline points='{}' fill='none' stroke='rgb(40,140,70)' stroke-width='2'/>",
                     line);
  for (std::size_t i = 0; i < points.size(); ++i) {
    const bool on_front = std::find(front.begin(), front.end(), i) != front.end();
    svg += fmt::format(
        "<circle cx='{:.1f}' cy='{:.1f}' r='5' fill='{}'><title>{}: {} ({:.4g}, {:.4g})</title>"
        "</circle><text x='{:.1f}' y='{:.1f}'>{}</text>",
        px(points[i].x), py(points[i].y), on_front ? "rgb(40,140,70)" : "rgb(120,120,120)", i + 1,
        escape_markup(points[i].label), points[i].x, points[i].y, px(points[i].x) + 7,
        py(points[i].y) - 5, i + 1);
  }
  return svg + "</svg>";
}

}  // namespace kvlab::cli
