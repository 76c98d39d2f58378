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
