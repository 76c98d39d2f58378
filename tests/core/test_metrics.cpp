#include <gtest/gtest.h>

#include "kvlab/engine/metrics.hpp"
#include "kvlab/error.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

RequestTimeline finished(std::int64_t id, double arrival, double scheduled,
                         std::vector<double> tokens) {
  RequestTimeline r;
  r.id = id;
  r.prompt_tokens = 10;
  r.arrival_s = arrival;
  r.first_scheduled_s = scheduled;
  r.token_times_s = std::move(tokens);
  r.finish_s = r.token_times_s.back();
  return r;
}

TEST(Metrics, PercentilesInterpolateLikeNumpy) {
  const std::vector<double> sorted{1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(percentile_of_sorted(sorted, 50), 2.5);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(sorted, 90), 3.7);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(sorted, 0), 1);
  EXPECT_DOUBLE_EQ(percentile_of_sorted(sorted, 100), 4);
  const auto s = summarize_latencies({4, 1, 3, 2});
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.p99, 3.97);
  EXPECT_DOUBLE_EQ(s.max, 4);
  EXPECT_EQ(summarize_latencies({}).count, 0);
}

TEST(Metrics, PerRequestDefinitions) {
  const RequestTimeline r = finished(0, 1.0, 1.5, {2.0, 2.5, 3.5});
  EXPECT_DOUBLE_EQ(*r.ttft_s(), 1.0);
  EXPECT_DOUBLE_EQ(*r.tpot_s(), 0.75);  // (3.5 - 2.0) / 2
  EXPECT_DOUBLE_EQ(*r.e2e_s(), 2.5);
  EXPECT_DOUBLE_EQ(*r.queue_delay_s(), 0.5);
  RequestTimeline one = finished(1, 0, 0, {1.0});
  EXPECT_FALSE(one.tpot_s().has_value());  // TPOT needs two tokens
}

TEST(Metrics, RunSummaryThroughputItlAndGoodput) {
  std::vector<RequestTimeline> runs{finished(0, 0.0, 0.0, {0.5, 1.0, 1.5}),
                                    finished(1, 0.0, 1.0, {2.0, 4.0})};
  RequestTimeline rejected;
  rejected.id = 2;
  rejected.rejected = true;
  rejected.reject_reason = "prompt + max tokens exceed the context";
  runs.push_back(rejected);
  ServiceLevelObjectives slo;
  slo.ttft_s = 1.0;  // request 1 (TTFT 2.0) misses it
  const RunSummary s = summarize_run(runs, 4.0, slo);
  EXPECT_EQ(s.submitted, 3);
  EXPECT_EQ(s.finished, 2);
  EXPECT_EQ(s.rejected, 1);
  EXPECT_DOUBLE_EQ(s.requests_per_s, 0.5);
  EXPECT_DOUBLE_EQ(s.output_tokens_per_s, 5.0 / 4.0);
  EXPECT_DOUBLE_EQ(s.total_tokens_per_s, 25.0 / 4.0);
  EXPECT_EQ(s.itl_s.count, 3);  // 0.5, 0.5, 2.0
  EXPECT_DOUBLE_EQ(s.itl_s.max, 2.0);
  EXPECT_EQ(s.slo_met, 1);
  EXPECT_DOUBLE_EQ(s.goodput_per_s, 0.25);
  EXPECT_DOUBLE_EQ(s.queue_delay_s.mean, 0.5);
}

// Each request is held to its own targets (its tenant's over [slo]); targets passed to
// summarize_run replace them, to score the run against others.
TEST(Metrics, RequestsOwnSlosUnlessReplaced) {
  std::vector<RequestTimeline> runs{finished(0, 0.0, 0.0, {0.5, 1.0}),
                                    finished(1, 0.0, 1.0, {2.0, 4.0})};
  runs[0].slo.ttft_s = 0.25;  // TTFT 0.5: missed
  runs[1].slo.ttft_s = 3.0;   // TTFT 2.0: met
  EXPECT_EQ(summarize_run(runs, 4.0).slo_met, 1);
  EXPECT_FALSE(meets_slo(runs[0], {}));
  ServiceLevelObjectives instead;
  instead.ttft_s = 1.0;
  EXPECT_TRUE(meets_slo(runs[0], instead));
  EXPECT_FALSE(meets_slo(runs[1], instead));
}

// Per-tenant summaries in order of first arrival; none without tenant names.
TEST(Metrics, TenantSummariesSplitTheRun) {
  std::vector<RequestTimeline> runs{finished(0, 0.0, 0.0, {1.0, 2.0}), finished(1, 0.0, 0.0, {1.0}),
                                    finished(2, 1.0, 1.0, {3.0})};
  EXPECT_TRUE(summarize_tenants(runs, 4.0).empty());
  const std::string a = "a", b = "b";
  runs[0].tenant = runs[2].tenant = b;
  runs[1].tenant = a;
  const auto tenants = summarize_tenants(runs, 4.0);
  ASSERT_EQ(tenants.size(), 2u);
  EXPECT_EQ(tenants[0].tenant, "b");
  EXPECT_EQ(tenants[0].run.finished, 2);
  EXPECT_EQ(tenants[0].served_tokens, 10 + 2 + 10 + 1);
  EXPECT_EQ(tenants[1].served_tokens, 10 + 1);
  EXPECT_DOUBLE_EQ(tenants[1].run.ttft_s.p50, 1.0);
}

// The VTC paper's service gap, by hand. a and b both wait from 0 until b's second request is
// first scheduled at 5 (a waits until 6). Service a: 11 at 1 (prompt 10 + token), 1 at 2;
// b: 11 at 4. Difference a - b over [0, 5]: 0 -> 11 -> 12 -> 1: range 12. b's third request
// arrives at 7, when a no longer waits: its service after that is outside any shared period.
TEST(Metrics, ServiceGapIsTheLargestDifferenceWhileBothWait) {
  RequestTimeline a0 = finished(0, 0.0, 0.5, {1.0, 2.0});
  RequestTimeline a1 = finished(1, 0.0, 6.0, {6.5});
  RequestTimeline b0 = finished(2, 0.0, 3.5, {4.0});
  RequestTimeline b1 = finished(3, 0.0, 5.0, {9.0});
  RequestTimeline b2 = finished(4, 7.0, 7.0, {8.0, 8.5, 8.7});
  const std::string a = "a", b = "b";  // assigned as strings: GCC 12 misreads literals here
  for (RequestTimeline* r : {&a0, &a1}) r->tenant = a;
  for (RequestTimeline* r : {&b0, &b1, &b2}) r->tenant = b;
  const std::vector<RequestTimeline> runs{a0, a1, b0, b1, b2};
  EXPECT_DOUBLE_EQ(max_service_gap_tokens(runs), 12.0);
  const std::vector<RequestTimeline> one{a0, a1};
  EXPECT_DOUBLE_EQ(max_service_gap_tokens(one), 0.0);
  // A trace naming a thousand users: pairs of the 64 busiest only (a and b among them), the
  // same gap; the others' single requests never wait beside another.
  std::vector<RequestTimeline> crowd = runs;
  for (int u = 0; u < 1000; ++u) {
    RequestTimeline r = finished(5 + u, 100.0 + u, 100.0 + u, {100.5 + u});
    r.tenant = "user" + std::to_string(u);
    crowd.push_back(r);
  }
  EXPECT_DOUBLE_EQ(max_service_gap_tokens(crowd), 12.0);
  // Service at one instant counts at once: two tenants served alike at the same times never
  // differ, whichever of their events comes first in a list.
  RequestTimeline x = finished(0, 0.0, 1.0, {2.0, 3.0}), y = finished(1, 0.0, 1.0, {2.0, 3.0});
  RequestTimeline x2 = finished(2, 0.0, 4.0, {5.0}), y2 = finished(3, 0.0, 4.0, {5.0});
  x.tenant = x2.tenant = a;
  y.tenant = y2.tenant = b;
  EXPECT_DOUBLE_EQ(max_service_gap_tokens(std::vector<RequestTimeline>{x, y, x2, y2}), 0.0);
  EXPECT_DOUBLE_EQ(max_service_gap_tokens(std::vector<RequestTimeline>{y, x, y2, x2}), 0.0);
}

TEST(Metrics, ALostRequestIsAnError) {
  RequestTimeline lost;
  lost.id = 7;
  const std::vector<RequestTimeline> runs{lost};
  EXPECT_NE(test::error_of<Error>([&] {
              summarize_run(runs, 1.0);
            }).find("request 7 was neither finished nor rejected"),
            std::string::npos);
}

}  // namespace
}  // namespace kvlab
