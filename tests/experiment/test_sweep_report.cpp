// The sweep library under `kvlab run`, in process (no kvlab binary, no std::system): runs
// executed into a results folder's staging, the report's table, errors and exit code, and the
// index files (runs.json, manifest.json, summary.md) of the folder once committed.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const std::filesystem::path kSweepQuickstart =
    std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "quickstart.toml";

std::string file_text(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Two sweep points, the second asking for a scheduler that does not exist: it fails alone.
std::vector<ExperimentRun> two_points() {
  auto runs = load_experiment(
      kSweepQuickstart, {"model.name=\"tiny\"", "workload.requests=4",
                         "workload.prompt_tokens={dist=\"uniform\", min=4, max=8}",
                         "workload.output_tokens={dist=\"uniform\", min=2, max=4}",
                         std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
                         "experiment.repeats=1"});
  runs.resize(2);
  runs[1].config.scheduler = "no_such_scheduler";
  return runs;
}

TEST(SweepReport, RunsReportAndIndexTheResultsFolderInProcess) {
  const test::TempDir dir;
  const std::vector<ExperimentRun> runs = two_points();
  ResultsFolder folder(dir / "results", ResultsFolder::Options{false, {}});
  std::vector<RunRecord> records;
  for (std::size_t i = 0; i < runs.size(); ++i)
    records.push_back(
        execute_run(runs, i, false, folder.staging() / run_directory_name(runs[i], i), 0));
  EXPECT_TRUE(records[0].error.empty()) << records[0].error;
  EXPECT_NE(records[1].error.find("no_such_scheduler"), std::string::npos) << records[1].error;
  EXPECT_GT(records[0].finished, 0);

  const SweepReport report = report_sweep(false, 1, runs, records);
  EXPECT_EQ(report.exit_code, 1);  // a run failed
  std::string out, err;
  for (const SweepReport::Line& line : report.lines) (line.to_stderr ? err : out) += line.text;
  EXPECT_NE(out.find("| run |"), std::string::npos) << out;
  EXPECT_NE(err.find("kvlab: error: run 2"), std::string::npos) << err;
  EXPECT_EQ(report.index.size(), 1u);
  EXPECT_EQ(report.failed.size(), 1u);

  const ManifestInfo info{kSweepQuickstart.string(),
                          "# the file\n",
                          CommandLineChanges{{"workload.requests=4"}, {"seed=1,2"}},
                          "0.1",
                          "abc123",
                          machine_description(),
                          1};
  write_results_index(folder.staging(), report, info, runs.size());
  folder.commit();
  const std::filesystem::path results = dir / "results";
  const auto index = nlohmann::json::parse(file_text(results / "runs.json"));
  ASSERT_EQ(index.size(), 1u);
  const std::string run_dir = index[0].at("dir").get<std::string>();
  EXPECT_TRUE(std::filesystem::is_regular_file(results / run_dir / "summary.json")) << run_dir;
  EXPECT_TRUE(std::filesystem::is_regular_file(results / run_dir / "requests.csv"));
  const auto manifest = nlohmann::json::parse(file_text(results / "manifest.json"));
  EXPECT_EQ(manifest.at("runs").get<int>(), 2);
  EXPECT_EQ(manifest.at("kvlab_commit").get<std::string>(), "abc123");
  EXPECT_EQ(manifest.at("overrides"), nlohmann::json::array({"workload.requests=4"}));
  EXPECT_EQ(manifest.at("sweeps"), nlohmann::json::array({"seed=1,2"}));
  EXPECT_EQ(manifest.at("failed_runs").size(), 1u);
  EXPECT_EQ(file_text(results / "experiment.toml"), "# the file\n");
  EXPECT_EQ(file_text(results / "summary.md"), report.summary_md);
  EXPECT_NE(report.summary_md.find("| run |"), std::string::npos);
  // A notebook reads the runs without parsing TOML: typed swept values, one tidy CSV.
  EXPECT_EQ(index[0].at("swept"), nlohmann::json({{"scheduler.name", "static"}}));
  const std::string csv = file_text(results / "results.csv");
  const std::string header = csv.substr(0, csv.find('\n'));
  EXPECT_TRUE(header.starts_with("dir,repeat,seed,scheduler.name,submitted,finished,")) << header;
  for (const char* column : {",ttft_s.p50,", ",output_tokens_per_s,", ",steps,"})
    EXPECT_NE(header.find(column), std::string::npos) << column;
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 2) << csv;  // the run that finished
  EXPECT_NE(csv.find("\n" + run_dir + ",0,"), std::string::npos) << csv;
}

// results.csv quotes what CSV must quote: a swept table's JSON holds commas and quotes.
TEST(SweepReport, ResultsCsvQuotesTableValuesAndLeavesMissingCellsEmpty) {
  const test::TempDir dir;
  const nlohmann::json index =
      nlohmann::json::array({{{"dir", "a"},
                              {"repeat", 0},
                              {"swept", {{"kv_cache.params", {{"block_size", 16}, {"x", "y"}}}}}},
                             {{"dir", "b"}, {"repeat", 1}, {"swept", nlohmann::json::object()}}});
  test::write_file(dir / "a" / "summary.json",
                   R"({"seed": 1, "finished": 3, "ttft_s": {"p50": 0.5}})");
  test::write_file(dir / "b" / "summary.json", R"({"seed": 2, "finished": 4})");
  EXPECT_EQ(results_csv(dir.path(), index),
            "dir,repeat,seed,kv_cache.params,finished,ttft_s.p50\n"
            "a,0,1,\"{\"\"block_size\"\":16,\"\"x\"\":\"\"y\"\"}\",3,0.5\n"
            "b,1,2,,4,\n");
}

// A measured run whose steps took far from the profile's price is marked (!) in the table and
// named in a warning; runs that started under very different loads are warned about.
TEST(SweepReport, UntrustedMeasuredRunsAreMarkedAndWarned) {
  std::vector<ExperimentRun> runs = two_points();
  runs[1] = runs[0];
  runs[1].config.label = "second";
  std::vector<RunRecord> records{execute_run(runs, 0, false, {}, 0),
                                 execute_run(runs, 1, false, {}, 0)};
  records[0].step_time_ratio_p50 = 4.8;  // as a busy 2-core machine measured (issue 38)
  records[0].machine_load_1m = 3.5;
  records[1].step_time_ratio_p50 = 1.1;
  records[1].machine_load_1m = 0.2;
  const SweepReport report = report_sweep(false, 1, runs, records);
  std::string out, err;
  for (const SweepReport::Line& line : report.lines) (line.to_stderr ? err : out) += line.text;
  EXPECT_NE(out.find("| " + runs[0].config.label + " (!) |"), std::string::npos) << out;
  EXPECT_NE(out.find("| second |"), std::string::npos) << out;
  EXPECT_NE(err.find("run 1 (" + runs[0].config.label +
                     "): its steps took 4.80x the profile's "
                     "price at the median"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("run 2 (second): its steps"), std::string::npos) << err;
  EXPECT_NE(err.find("started under 1-minute loads from 0.20 to 3.50"), std::string::npos) << err;
  EXPECT_EQ(report.exit_code, 0);  // a warning, not a failure
}

// kvlab check's verdict comes with the report: every token equal, exit 0.
TEST(SweepReport, CheckVerdictIsPartOfTheReport) {
  std::vector<ExperimentRun> runs = two_points();
  runs.resize(1);
  std::vector<RunRecord> records = {execute_run(runs, 0, true, {}, 0)};
  ASSERT_TRUE(records[0].error.empty()) << records[0].error;
  const SweepReport report = report_sweep(true, 1, runs, records);
  EXPECT_EQ(report.exit_code, 0);
  EXPECT_NE(report.lines.back().text.find("equal the reference's"), std::string::npos)
      << report.lines.back().text;
}

}  // namespace
}  // namespace kvlab
