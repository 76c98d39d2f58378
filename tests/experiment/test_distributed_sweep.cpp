// Sweeps split across ranks: the balance of runs, their cost estimate, and the run records that
// travel to rank 0 (the MPI transport itself: ctest experiments.mpi_sweep).
#include "kvlab/experiment/distributed_sweep.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>

#include "kvlab/error.hpp"
#include "kvlab/workload/workload.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

TEST(BalanceRuns, EveryRunOnceLongestFirstToTheLightestRank) {
  const std::vector<double> costs{5, 1, 8, 3, 3, 7, 2};
  const auto shares = balance_runs(costs, 3);
  ASSERT_EQ(shares.size(), 3u);
  std::vector<std::size_t> all;
  std::vector<double> load;
  for (const auto& share : shares) {
    EXPECT_TRUE(std::is_sorted(share.begin(), share.end()));
    all.insert(all.end(), share.begin(), share.end());
    double sum = 0;
    for (const std::size_t i : share) sum += costs[i];
    load.push_back(sum);
  }
  std::sort(all.begin(), all.end());
  std::vector<std::size_t> expected(costs.size());
  std::iota(expected.begin(), expected.end(), std::size_t{0});
  EXPECT_EQ(all, expected);
  // Longest first: 8 -> r0, 7 -> r1, 5 -> r2, 3 -> r2 (8), 3 -> r1 (10), 2 -> r0 (10), 1 -> r2.
  EXPECT_EQ(shares[0], (std::vector<std::size_t>{2, 6}));
  EXPECT_EQ(shares[1], (std::vector<std::size_t>{4, 5}));
  EXPECT_EQ(shares[2], (std::vector<std::size_t>{0, 1, 3}));
  EXPECT_EQ(load, (std::vector<double>{10, 10, 9}));
}

TEST(BalanceRuns, MoreRanksThanRunsLeavesSomeIdleAndOneRankTakesAll) {
  const std::vector<double> costs{1, 1};
  const auto wide = balance_runs(costs, 4);
  EXPECT_EQ(wide[0].size() + wide[1].size(), 2u);
  EXPECT_TRUE(wide[2].empty() && wide[3].empty());
  EXPECT_EQ(balance_runs(costs, 1)[0], (std::vector<std::size_t>{0, 1}));
  test::expect_error_containing([&] { balance_runs(costs, 0); }, {"0 ranks"});
}

TEST(EstimatedRunCost, GrowsWithRequestsAndLengthsAndComputingBackendsCostMore) {
  ExperimentConfig c;
  c.workload.requests = 100;
  c.workload.prompt_tokens = {.kind = LengthKind::uniform, .min = 10, .max = 30};  // mean 20
  c.workload.output_tokens = {.kind = LengthKind::fixed, .value = 40};
  c.backend = "simulated";
  c.backend_kind = BackendKind::simulated;
  EXPECT_DOUBLE_EQ(estimated_run_cost(c), 100 * (20 + 2 * 40.0));
  ExperimentConfig more = c;
  more.workload.requests = 200;
  EXPECT_DOUBLE_EQ(estimated_run_cost(more), 2 * estimated_run_cost(c));
  ExperimentConfig cpu = c;
  cpu.backend = "cpu";
  cpu.backend_kind = BackendKind::cpu;
  EXPECT_DOUBLE_EQ(estimated_run_cost(cpu), 50 * estimated_run_cost(c));
}

RunRecord sample_record() {
  RunRecord r;
  r.index = 17;
  r.rank = 2;
  r.files = {{"summary.json", "{\"a\": 1}\n"}, {"steps.csv", std::string("x\0y", 3)}, {"e", ""}};
  r.row = {1.0 / 3.0, 2e-300, 12345.678};  // and a cell with no value below
  r.finished = 40;
  r.all_rejected = "";
  r.mismatches = {"request 3: token 7 differs"};
  r.checked_tokens = 96;
  r.off_argmax = 3;
  r.max_gap = 0.0625;
  r.logits = {12, 1.0 / 7.0, 0.75, 40, 183};
  r.logprobs = {33, 165, 1.0 / 3e5};
  r.wall_s = 0.25;
  r.engine_wall_s = 0.125;
  r.forward_wall_s = 0.0625;
  r.forwards = 640;
  r.forwards_with_chosen_tokens = 639;
  r.graph_replays = 600;
  r.graph_captures = 9;
  r.step_time_ratio_p50 = 4.8;
  r.machine_load_1m = 1.25;
  return r;
}

TEST(RunRecord, RoundTripsExactlyFilesAndDoubles) {
  const RunRecord r = sample_record();
  const RunRecord back = decode_run_record(encode_run_record(r));
  EXPECT_EQ(back.index, r.index);
  EXPECT_EQ(back.rank, r.rank);
  EXPECT_EQ(back.files, r.files);
  EXPECT_EQ(back.row, r.row);  // bit for bit: the table rank 0 prints must not move
  RunRecord empty_cell = r;    // a latency over no request: NaN, "-" in the table
  empty_cell.row.push_back(std::numeric_limits<double>::quiet_NaN());
  const auto row = decode_run_record(encode_run_record(empty_cell)).row;
  ASSERT_EQ(row.size(), 4u);
  EXPECT_TRUE(std::isnan(row[3]));
  EXPECT_EQ(back.finished, r.finished);
  EXPECT_EQ(back.step_time_ratio_p50, r.step_time_ratio_p50);
  EXPECT_EQ(back.machine_load_1m, r.machine_load_1m);
  EXPECT_EQ(back.mismatches, r.mismatches);
  EXPECT_EQ(back.checked_tokens, r.checked_tokens);
  EXPECT_EQ(back.off_argmax, r.off_argmax);
  EXPECT_EQ(back.max_gap, r.max_gap);
  EXPECT_EQ(back.logits.rows, r.logits.rows);
  EXPECT_EQ(back.logits.max_abs_delta, r.logits.max_abs_delta);
  EXPECT_EQ(back.logits.sum_row_max_delta, r.logits.sum_row_max_delta);
  EXPECT_EQ(back.logits.top_positions, r.logits.top_positions);
  EXPECT_EQ(back.logits.top_shared, r.logits.top_shared);
  EXPECT_EQ(back.logprobs.tokens, r.logprobs.tokens);
  EXPECT_EQ(back.logprobs.entries, r.logprobs.entries);
  EXPECT_EQ(back.logprobs.max_abs_delta, r.logprobs.max_abs_delta);
  EXPECT_EQ(back.forward_wall_s, r.forward_wall_s);
  EXPECT_EQ(back.forwards, r.forwards);
  EXPECT_EQ(back.forwards_with_chosen_tokens, r.forwards_with_chosen_tokens);
  EXPECT_EQ(back.graph_replays, r.graph_replays);
  EXPECT_EQ(back.graph_captures, r.graph_captures);
  RunRecord failed;
  failed.index = 3;
  failed.error = "bad safetensors file x";
  EXPECT_EQ(decode_run_record(encode_run_record(failed)).error, failed.error);
}

TEST(RunRecord, MalformedBytesAreErrorsThatSayWhat) {
  const std::string good = encode_run_record(sample_record());
  test::expect_error_containing([&] { decode_run_record(good.substr(0, 5)); },
                                {"shorter than its length field"});
  test::expect_error_containing([&] { decode_run_record(good.substr(0, 20)); }, {"header in"});
  test::expect_error_containing([&] { decode_run_record(good.substr(0, good.size() - 1)); },
                                {"steps.csv needs 3 bytes"});
  test::expect_error_containing([&] { decode_run_record(good + "z"); },
                                {"1 bytes after its last file"});
  std::string bad_json = good;
  bad_json[9] = '[';
  test::expect_error_containing([&] { decode_run_record(bad_json); }, {"malformed header"});
  RunRecord escape = sample_record();
  escape.files = {{"../../etc/passwd", "x"}};
  test::expect_error_containing([&] { decode_run_record(encode_run_record(escape)); },
                                {"leaves its run folder"});
}

TEST(ReadFolderFiles, EveryFileRelativeAndSorted) {
  test::TempDir dir;
  std::filesystem::create_directories(dir.path() / "sub");
  std::ofstream(dir.path() / "b.txt") << "bee";
  std::ofstream(dir.path() / "sub" / "a.csv") << "x,y\n";
  std::ofstream(dir.path() / "empty");
  const auto files = read_folder_files(dir.path());
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0], (std::pair<std::string, std::string>{"b.txt", "bee"}));
  EXPECT_EQ(files[1], (std::pair<std::string, std::string>{"empty", ""}));
  EXPECT_EQ(files[2], (std::pair<std::string, std::string>{"sub/a.csv", "x,y\n"}));
}

}  // namespace
}  // namespace kvlab
