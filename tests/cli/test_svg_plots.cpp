// kvlab's SVG figures (apps/kvlab/svg_plots.hpp): the Pareto front of quality against memory is
// the points no other beats on both axes, cheapest first, for either direction of "better"; the
// scatter is well-formed SVG with one dot per point, front dots coloured apart.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "svg_plots.hpp"

namespace kvlab::cli {
namespace {

std::size_t count(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(SvgPlots, TheParetoFrontIsWhatNothingBeatsOnBothAxes) {
  //                                    bytes, KL (lower is better)
  const std::vector<ScatterPoint> points = {
      {"f16 full", 23040, 0.0},   {"q8_0", 12240, 0.002},     {"window", 5760, 1.36},
      {"h2o pooled", 5760, 0.51}, {"q4_1 + h2o", 1620, 0.60}, {"int8 worse", 12240, 0.01}};
  EXPECT_EQ(pareto_front(points, true), (std::vector<std::size_t>{4, 3, 1, 0}));
  std::vector<ScatterPoint> accuracy = points;  // the same as accuracy: higher is better
  for (ScatterPoint& p : accuracy) p.y = 1 - p.y;
  EXPECT_EQ(pareto_front(accuracy, false), (std::vector<std::size_t>{4, 3, 1, 0}));
  EXPECT_TRUE(pareto_front({}, true).empty());
  const std::string svg = scatter_svg("KL", "bytes", "nats", points, true);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 6), "</svg>");
  EXPECT_EQ(count(svg, "<circle"), points.size());
  EXPECT_EQ(count(svg, "<circle cx='"), points.size());
  EXPECT_EQ(count(svg, "fill='rgb(40,140,70)'"), 4u);  // the front's dots
  EXPECT_NE(svg.find("<title>5: q4_1 + h2o"), std::string::npos);
  EXPECT_EQ(escape_markup("a<b & c>d"), "a&lt;b &amp; c&gt;d");
  const std::string named = scatter_svg("x<y", "b", "n", {{{"<script>", 1, 1}}}, true);
  EXPECT_EQ(named.find("<script>"), std::string::npos);  // labels cannot open an element
  EXPECT_NE(named.find("&lt;script&gt;"), std::string::npos);
}

}  // namespace
}  // namespace kvlab::cli
