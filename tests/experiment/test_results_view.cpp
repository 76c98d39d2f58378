// kvlab view's data: step frames agree with the steps they were recorded at (the pool map's
// slots with the allocator's stats, the batch with the step's), a long run's frames thinned
// evenly within the budget, the page self-contained, and bad folders and files a clear error.
// (The page in a real browser: tests/view/view_browser.py.)
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/results_view.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

const fs::path kQuickstart = fs::path(KVLAB_SOURCE_DIR) / "experiments" / "quickstart.toml";

// The quickstart's point `point` (0: static batching, 1: fcfs) on `allocator`.
ExperimentConfig quickstart(std::size_t point, const std::string& allocator,
                            std::vector<std::string> more = {}) {
  std::vector<std::string> sets = {
      "model.name=\"tiny\"", "workload.requests=24", "kv_cache.slots=1024",
      "kv_cache.allocator=\"" + allocator + "\"",
      std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"};
  if (allocator != "paged") sets.push_back("kv_cache.params={}");
  sets.insert(sets.end(), more.begin(), more.end());
  return load_experiment(kQuickstart, sets).at(point).config;
}

std::int64_t slots_in(const StepFrame& frame, std::initializer_list<KvSlotState> states) {
  std::int64_t slots = 0;
  for (const KvSlotRun& run : frame.pool.runs)
    if (std::find(states.begin(), states.end(), run.state) != states.end()) slots += run.length;
  return slots;
}

// Every frame against its step's record: live KV, reserved, slack and cached slots equal the
// allocator's stats; the batch has the step's size and prefill and decode tokens.
void expect_frames_match_steps(const RunOutput& out) {
  ASSERT_FALSE(out.engine.frames.empty());
  std::map<std::int64_t, const StepRecord*> steps;
  for (const StepRecord& s : out.engine.steps) steps[s.step] = &s;
  for (const StepFrame& frame : out.engine.frames) {
    const StepRecord& s = *steps.at(frame.step);
    EXPECT_TRUE(frame.drawn_by_allocator);
    EXPECT_EQ(slots_in(frame, {KvSlotState::used, KvSlotState::shared, KvSlotState::copied}),
              s.kv.used)
        << "step " << frame.step;
    EXPECT_EQ(slots_in(frame, {KvSlotState::reserved}), s.kv.reserved_unused);
    EXPECT_EQ(slots_in(frame, {KvSlotState::slack}), s.kv.last_block_slack);
    EXPECT_EQ(slots_in(frame, {KvSlotState::cached}), s.kv.cached_free);
    EXPECT_EQ(static_cast<std::int64_t>(frame.batch.size()), s.batch);
    std::int64_t prefill = 0, decode = 0;
    for (const FrameEntry& e : frame.batch) (e.decode ? decode : prefill) += e.tokens;
    EXPECT_EQ(prefill, s.prefill_tokens) << "step " << frame.step;
    EXPECT_EQ(decode, s.decode_tokens) << "step " << frame.step;
  }
}

TEST(ResultsView, EachFrameDrawsItsStepsPoolAndBatch) {
  for (const std::string allocator : {"static", "dynamic", "paged"}) {
    SCOPED_TRACE(allocator);
    const RunOutput out = run_experiment(quickstart(1, allocator), false, nullptr);
    EXPECT_EQ(out.engine.frames.size(), out.engine.steps.size());  // a frame every step
    expect_frames_match_steps(out);
    std::int64_t reserved = 0, cached = 0;
    for (const StepFrame& f : out.engine.frames) {
      reserved += slots_in(f, {KvSlotState::reserved});
      cached += slots_in(f, {KvSlotState::cached});
    }
    // What tells the allocators apart on the map: static and dynamic reserve ahead; paged
    // keeps finished prompts' blocks as cached.
    EXPECT_EQ(reserved > 0, allocator != "paged");
    EXPECT_EQ(cached > 0, allocator == "paged");
  }
}

TEST(ResultsView, ALongRunsFramesAreThinnedEvenlyWithinTheBudget) {
  const RunOutput out =
      run_experiment(quickstart(1, "paged", {"output.frames=2000"}), false, nullptr);
  const std::int64_t stride = out.engine.frame_stride;
  EXPECT_GT(stride, 1);
  std::int64_t entries = 0;
  for (std::size_t i = 0; i < out.engine.frames.size(); ++i) {
    const StepFrame& f = out.engine.frames[i];
    EXPECT_EQ(f.step % stride, 0) << f.step;
    entries += static_cast<std::int64_t>(f.batch.size() + f.pool.runs.size()) + 1;
  }
  EXPECT_LE(entries, 2000);
  // Every step a multiple of the stride that ran a batch has its frame.
  std::int64_t due = 0;
  for (const StepRecord& s : out.engine.steps) due += s.step % stride == 0;
  EXPECT_EQ(static_cast<std::int64_t>(out.engine.frames.size()), due);
  expect_frames_match_steps(out);
  const RunOutput none =
      run_experiment(quickstart(1, "paged", {"output.frames=0"}), false, nullptr);
  EXPECT_TRUE(none.engine.frames.empty());
}

// A frame costs a pass over the pool: a pool of 2^20 slots starts on a frame every 16 steps
// (at most 65,536 slots of map work a step), whatever the budget leaves.
TEST(ResultsView, ABigPoolsFramesAreSpacedByItsSize) {
  const RunOutput out =
      run_experiment(quickstart(1, "paged", {"kv_cache.slots=1048576"}), false, nullptr);
  EXPECT_EQ(out.engine.frame_stride, 16);
  ASSERT_GT(out.engine.frames.size(), 1u);
  for (const StepFrame& f : out.engine.frames) EXPECT_EQ(f.step % 16, 0) << f.step;
  expect_frames_match_steps(out);
}

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream(file, std::ios::binary) << text;
}

// A results folder of the quickstart's two points, as kvlab run leaves it (runs.json, each
// run's files and its config.toml's block size).
fs::path write_results(const test::TempDir& dir) {
  const fs::path folder = dir / "results";
  nlohmann::json runs = nlohmann::json::array();
  for (std::size_t point = 0; point < 2; ++point) {
    const ExperimentConfig config = quickstart(point, "paged");
    const std::string name = point == 0 ? "000_static" : "001_fcfs";
    write_run_outputs(folder / name, config, run_experiment(config, false, nullptr));
    write_text(folder / name / "config.toml",
               "[kv_cache.params]\nblock_size = 16\n");  // the sweep's
    runs.push_back({{"dir", name}, {"label", name}});
  }
  write_text(folder / "runs.json", runs.dump());
  return folder;
}

TEST(ResultsView, TheDataHoldsEveryRunsStepsRequestsEventsAndFrames) {
  const test::TempDir dir;
  const fs::path folder = write_results(dir);
  const nlohmann::json data = results_view_data(folder);
  ASSERT_EQ(data["runs"].size(), 2u);
  for (const nlohmann::json& run : data["runs"]) {
    const auto steps = run["steps"]["step"].size();
    EXPECT_GT(steps, 10u);
    EXPECT_EQ(run["steps"]["used"].size(), steps);
    EXPECT_EQ(run["requests"]["id"].size(), 24u);
    EXPECT_EQ(run["frames"].size(), steps);
    EXPECT_EQ(run["block_size"], 16);
    EXPECT_FALSE(run["events"].empty());
    // A frame's live slots, as the page sums them, equal its step's kv_used.
    const nlohmann::json& frame = run["frames"][steps / 2];
    std::int64_t live = 0;
    for (const auto& r : frame["runs"])
      if (r[3] == "used" || r[3] == "shared" || r[3] == "copied") live += r[1].get<std::int64_t>();
    EXPECT_EQ(live, run["steps"]["used"][frame["step"].get<std::size_t>()].get<std::int64_t>());
  }
  EXPECT_EQ(data["runs"][0]["name"], "000_static");
}

// No script or style comes from elsewhere, and no text in the data closes its script element.
TEST(ResultsView, ThePageIsSelfContained) {
  nlohmann::json data = {{"title", "t"}, {"runs", nlohmann::json::array()}};
  data["runs"].push_back({{"name", "</script><script>alert(1)</script>"}});
  const std::string page = results_view_html(data);
  EXPECT_EQ(page.find("<script src"), std::string::npos);
  EXPECT_EQ(page.find("<link rel=\"stylesheet"), std::string::npos);
  EXPECT_EQ(page.find("href=\"http"), std::string::npos);
  EXPECT_NE(page.find("<link rel=\"icon\" href=\"data:,\">"), std::string::npos);  // no fetch
  EXPECT_EQ(page.find("alert(1)</script>"), std::string::npos);
  EXPECT_NE(page.find("<\\/script><script>alert(1)<\\/script>"), std::string::npos);
  EXPECT_NE(page.find("Chart.js v3"), std::string::npos);  // embedded, license header and all
  EXPECT_NE(page.find("window.KVLAB_LIVE = false"), std::string::npos);
  EXPECT_NE(results_view_html(data, true).find("window.KVLAB_LIVE = true"), std::string::npos);
}

TEST(ResultsView, CsvCellsKeepQuotedCommasAndQuotes) {
  EXPECT_EQ(csv_row_cells("a,,b"), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_EQ(csv_row_cells("1,\"x, y\",2"), (std::vector<std::string>{"1", "x, y", "2"}));
  EXPECT_EQ(csv_row_cells("\"say \"\"hi\"\"\","), (std::vector<std::string>{"say \"hi\"", ""}));
  EXPECT_THROW(csv_row_cells("1,\"open"), Error);
}

std::string error_of(const fs::path& folder) {
  try {
    (void)results_view_data(folder);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ResultsView, BadFoldersAndFilesAreClearErrors) {
  const test::TempDir dir;
  EXPECT_NE(error_of(dir / "missing").find("is not a folder"), std::string::npos);
  EXPECT_NE(error_of(dir.path()).find("has no runs.json"), std::string::npos);
  const fs::path folder = write_results(dir);
  const fs::path run = folder / "001_fcfs";
  std::ifstream in(run / "steps.csv");
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  in.close();
  write_text(run / "steps.csv", header + "\n" + row + "\nx" + row + "\n");
  const std::string bad_number = error_of(folder);
  EXPECT_NE(bad_number.find("steps.csv line 3"), std::string::npos) << bad_number;
  EXPECT_NE(bad_number.find("not a number"), std::string::npos) << bad_number;
  write_text(run / "steps.csv", header + "\n" + row + ",1\n");
  EXPECT_NE(error_of(folder).find("cells, the header has"), std::string::npos);
  write_text(run / "steps.csv", header + "\n" + row + "\n");
  write_text(run / "frames.jsonl", "{\"step\": 0, \"batch\": [], \"runs\": []}\n[1, 2]\n");
  const std::string bad_frame = error_of(folder);
  EXPECT_NE(bad_frame.find("frames.jsonl line 2: not a step frame"), std::string::npos)
      << bad_frame;
  write_text(folder / "runs.json", "[{\"dir\": \"../elsewhere\"}]");
  EXPECT_NE(error_of(folder).find("not a run folder"), std::string::npos);
}

}  // namespace
}  // namespace kvlab
