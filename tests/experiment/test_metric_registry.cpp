// The metric registry: every row is complete and named once, docs/metrics.md is its output,
// summary.json carries each metric a run has, and the one metric added with the registry
// (normalized latency) is what its definition says.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const RunMetric& metric(std::string_view name) {
  for (const RunMetric& m : run_metrics())
    if (m.name == name) return m;
  throw std::runtime_error("no metric " + std::string(name));
}

RequestTimeline finished(double arrival, std::vector<double> token_times) {
  RequestTimeline r;
  r.arrival_s = arrival;
  r.first_scheduled_s = arrival;
  r.finish_s = token_times.back();
  r.token_times_s = std::move(token_times);
  r.finish_reason = "max_tokens";
  return r;
}

TEST(MetricRegistry, EveryRowIsDefinedAndNamedOnce) {
  std::set<std::string_view> names, headers;
  for (const RunMetric& m : run_metrics()) {
    EXPECT_TRUE(names.insert(m.name).second) << m.name;
    EXPECT_FALSE(m.unit.empty()) << m.name;
    EXPECT_GT(m.definition.size(), 10u) << m.name;
    EXPECT_FALSE(m.aggregation.empty()) << m.name;
    EXPECT_NE(m.extract, nullptr) << m.name;
    for (const MetricColumn& c : m.columns) EXPECT_TRUE(headers.insert(c.header).second);
  }
  for (const RequestMetric& m : request_metrics()) {
    EXPECT_FALSE(m.definition.empty()) << m.name;
    EXPECT_NE(m.extract, nullptr) << m.name;
  }
}

// docs/metrics.md holds `kvlab metrics`' table between its markers, byte for byte.
TEST(MetricRegistry, DocsShowTheRegistry) {
  std::ifstream file(std::string(KVLAB_SOURCE_DIR) + "/docs/metrics.md");
  std::stringstream text;
  text << file.rdbuf();
  const std::string doc = text.str();
  const std::string begin = "<!-- kvlab metrics: begin -->\n", end = "<!-- kvlab metrics: end -->";
  const auto from = doc.find(begin), to = doc.find(end);
  ASSERT_NE(from, std::string::npos);
  ASSERT_NE(to, std::string::npos);
  EXPECT_EQ(doc.substr(from + begin.size(), to - from - begin.size()), metrics_markdown())
      << "docs/metrics.md differs from the registry: paste `kvlab metrics` between its markers";
}

// vLLM's normalized latency: e2e / output tokens per finished request, averaged; rejected
// requests and requests without a token are left out.
TEST(MetricRegistry, NormalizedLatencyIsTheMeanOfEachRequestsLatencyPerToken) {
  RunOutput out;
  out.engine.requests = {finished(0, {1, 2, 3}), finished(1, {2, 5})};  // 3 s / 3, 4 s / 2
  RequestTimeline rejected;
  rejected.rejected = true;
  out.engine.requests.push_back(rejected);
  const ExperimentConfig config;
  EXPECT_DOUBLE_EQ(metric("normalized_latency_s").extract(config, out).get<double>(), 1.5);
  out.engine.requests.resize(1);
  EXPECT_DOUBLE_EQ(metric("normalized_latency_s").extract(config, out).get<double>(), 1.0);
  out.engine.requests.clear();
  EXPECT_DOUBLE_EQ(metric("normalized_latency_s").extract(config, out).get<double>(), 0.0);
}

// summary.json has a key for each metric of the registry a run has (the measured-clock step
// figures, the trace's ideal prefix hit rate, the KV tiers', speculation's and a KV policy's
// totals only when set),
// requests.csv a column for each request metric.
TEST(MetricRegistry, SummaryJsonAndRequestsCsvComeFromTheRegistry) {
  RunOutput out;
  out.engine.requests = {finished(0, {1, 2, 3})};
  out.summary = summarize_run(out.engine.requests, 3.0);
  const ExperimentConfig config;
  const test::TempDir dir;
  write_run_outputs(dir.path(), config, out);
  std::ifstream summary_file(dir / "summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  for (const RunMetric& m : run_metrics()) {
    const bool absent = m.name == "step_prediction_error" || m.name == "step_time_ratio" ||
                        m.name == "ideal_prefix_hit_rate" || m.name.starts_with("tier_") ||
                        m.name.ends_with("_by_tenant") || m.name == "max_service_gap_tokens" ||
                        m.name.starts_with("spec_") ||     // a run without [speculation]
                        m.name.starts_with("kv_policy_");  // ... and without [kv_policy]
    EXPECT_EQ(summary.contains(std::string(m.name)), m.in_summary_json && !absent) << m.name;
  }
  out.engine.kv_policy.add(HeadSelection{{1, 2, 3, 4}, {}, 1, 2, 8}, 6);  // a policy's selection
  out.ideal_prefix_hit_rate = 0.25;                                       // a Mooncake trace's
  out.kv_tiers = RunOutput::KvTierTotals{0.125, 0.0625, 4096, 2048, 3, 0.5};  // a run with tiers
  write_run_outputs(dir.path(), config, out);
  std::ifstream again(dir / "summary.json");
  const nlohmann::json with = nlohmann::json::parse(again);
  EXPECT_DOUBLE_EQ(with.at("ideal_prefix_hit_rate").get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(with.at("kv_policy_held").get<double>(), 4.0);  // positions in the slots
  EXPECT_DOUBLE_EQ(with.at("kv_policy_seen").get<double>(), 4.0);  // 8 cells over 2 heads
  EXPECT_DOUBLE_EQ(with.at("tier_host_hit_rate").get<double>(), 0.125);
  EXPECT_DOUBLE_EQ(with.at("tier_disk_hit_rate").get<double>(), 0.0625);
  EXPECT_EQ(with.at("tier_bytes_stored").get<std::int64_t>(), 4096);
  EXPECT_EQ(with.at("tier_bytes_loaded").get<std::int64_t>(), 2048);
  EXPECT_EQ(with.at("tier_dropped_blocks").get<std::int64_t>(), 3);
  EXPECT_DOUBLE_EQ(with.at("tier_time_s").get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(summary.at("normalized_latency_s").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(summary.at("ttft_s").at("p50").get<double>(), 1.0);
  std::ifstream requests_file(dir / "requests.csv");
  std::string header;
  std::getline(requests_file, header);
  for (const RequestMetric& m : request_metrics())
    EXPECT_NE(header.find(fmt::format(",{},", m.name)), std::string::npos) << header;
}

// With tenants, summary.json has each one's figures by name, the table a column per listed
// tenant ("-" for one that sent nothing), and requests.csv each request's tenant.
TEST(MetricRegistry, TenantsGetTheirOwnFiguresColumnsAndCsvCells) {
  RunOutput out;
  out.engine.requests = {finished(0, {1, 2, 3}), finished(0, {2, 4})};
  out.engine.requests[0].tenant = "heavy";
  out.engine.requests[0].prompt_tokens = 10;
  out.engine.requests[1].tenant = "light";
  out.engine.requests[1].slo.ttft_s = 1.0;  // its TTFT is 2 s: missed
  out.engine.duration_s = 4.0;
  out.summary = summarize_run(out.engine.requests, 4.0);
  out.tenants = summarize_tenants(out.engine.requests, 4.0);  // as run_experiment fills them
  out.service_gap_tokens = max_service_gap_tokens(out.engine.requests);
  ExperimentConfig config;
  config.tenants = {{"heavy", 1.0, {}}, {"light", 1.0, {}}, {"absent", 1.0, {}}};
  config.table_columns = {"tenants", "tenant_slo"};
  const test::TempDir dir;
  write_run_outputs(dir.path(), config, out);
  std::ifstream summary_file(dir / "summary.json");
  const nlohmann::json summary = nlohmann::json::parse(summary_file);
  EXPECT_EQ(summary.at("served_tokens_by_tenant").at("heavy").get<std::int64_t>(), 13);
  EXPECT_EQ(summary.at("served_tokens_by_tenant").at("light").get<std::int64_t>(), 2);
  EXPECT_DOUBLE_EQ(summary.at("ttft_by_tenant").at("light").at("p50").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(summary.at("slo_attainment_by_tenant").at("heavy").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(summary.at("slo_attainment_by_tenant").at("light").get<double>(), 0.0);
  EXPECT_EQ(summary.at("requests_by_tenant").at("light").get<std::int64_t>(), 1);
  EXPECT_TRUE(summary.contains("max_service_gap_tokens"));
  std::vector<std::string> headers;
  for (const SummaryColumn& c : summary_columns(config)) headers.push_back(c.header);
  for (const char* h : {"TTFT p50 heavy", "TTFT p99 light", "served tok absent", "SLO met light",
                        "service gap (tok)"})
    EXPECT_NE(std::find(headers.begin(), headers.end(), h), headers.end()) << h;
  const std::vector<double> values = summary_values(config, out);
  ASSERT_EQ(values.size(), headers.size());
  const auto at = [&](const char* h) {
    return values[static_cast<std::size_t>(std::find(headers.begin(), headers.end(), h) -
                                           headers.begin())];
  };
  EXPECT_DOUBLE_EQ(at("served tok heavy"), 13);
  EXPECT_DOUBLE_EQ(at("SLO met light"), 0.0);
  EXPECT_TRUE(std::isnan(at("TTFT p50 absent")));  // printed "-"
  std::ifstream requests_file(dir / "requests.csv");
  std::string header, first;
  std::getline(requests_file, header);
  std::getline(requests_file, first);
  EXPECT_TRUE(header.starts_with("id,priority,tenant,")) << header;
  EXPECT_TRUE(first.starts_with("0,0,heavy,")) << first;
}

}  // namespace
}  // namespace kvlab
