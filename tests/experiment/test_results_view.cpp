// kvlab view's data: step frames agree with the steps they were recorded at (the pool map's
// slots with the allocator's stats, the batch with the step's), a long run's frames thinned
// evenly within the budget, the page self-contained, and bad folders and files a clear error.
// (The page in a real browser: tests/view/view_browser.py.)
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "kvlab/engine/frames.hpp"
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

// With KV groups (gemma3-tiny: its global layer a group, its local layers five) the map draws
// every group's slots with the request as owner and the group beside it: each live request holds
// runs in the global group and in local ones, and the frame's JSON carries the group.
TEST(ResultsView, KvGroupsAreDrawnWithTheirGroup) {
  const RunOutput out = run_experiment(
      quickstart(1, "paged", {"model.name=\"gemma3-tiny\"", "kv_cache.groups=\"per_kind\""}), false,
      nullptr);
  expect_frames_match_steps(out);
  std::map<SequenceId, std::set<std::int32_t>> groups_of;
  bool json_has_groups = false;
  for (const StepFrame& frame : out.engine.frames) {
    for (const KvSlotRun& run : frame.pool.runs) {
      if (run.owner >= 0) groups_of[run.owner].insert(run.group);
      EXPECT_TRUE(run.group >= 0 && run.group < 6) << run.group;
    }
    const nlohmann::json j = nlohmann::json::parse(frame_json(frame));
    for (const auto& run : j["runs"]) json_has_groups = json_has_groups || run.size() == 5;
  }
  ASSERT_FALSE(groups_of.empty());
  for (const auto& [request, groups] : groups_of)
    EXPECT_EQ(groups.size(), 6u) << "request " << request << " holds slots in every group";
  EXPECT_TRUE(json_has_groups);
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

// No script or style comes from elsewhere, no text in the data closes its script element or
// changes how the HTML parser reads it, and a Content-Security-Policy runs only the page's own
// scripts (each carries the page's nonce).
TEST(ResultsView, ThePageIsSelfContainedAndItsDataIsInertText) {
  nlohmann::json data = {{"title", "t"}, {"runs", nlohmann::json::array()}};
  const std::string hostile = "</script><script>alert(1)</script><!--<script>&amp;\xE2\x80\xA8";
  data["runs"].push_back({{"name", hostile}});
  const std::string page = results_view_html(data);
  EXPECT_EQ(page.find("<script src"), std::string::npos);
  EXPECT_EQ(page.find("<link rel=\"stylesheet"), std::string::npos);
  EXPECT_EQ(page.find("href=\"http"), std::string::npos);
  EXPECT_NE(page.find("<link rel=\"icon\" href=\"data:,\">"), std::string::npos);  // no fetch
  EXPECT_EQ(page.find("alert(1)"), page.find("alert(1)\\u003c"));  // only inside the data
  EXPECT_EQ(page.find("<!--<script>"), std::string::npos);
  EXPECT_NE(page.find("Chart.js v3"), std::string::npos);  // embedded, license header and all
  // The data element's text parses back to the same strings.
  const std::string open = "type=\"application/json\" data-live=\"false\">";
  const std::size_t from = page.find(open);
  ASSERT_NE(from, std::string::npos);
  const std::size_t start = from + open.size();
  const std::size_t end = page.find("</script>", start);
  const auto parsed = nlohmann::json::parse(page.substr(start, end - start));
  EXPECT_EQ(parsed["runs"][0]["name"], hostile);
  EXPECT_NE(results_view_html(data, true).find("data-live=\"true\""), std::string::npos);
  // The policy: scripts and the style by nonce only, no remote loads, no connections.
  const std::size_t csp = page.find("Content-Security-Policy\" content=\"default-src 'none'; ");
  ASSERT_NE(csp, std::string::npos);
  const std::size_t nonce_at = page.find("'nonce-", csp) + 7;
  const std::string nonce = page.substr(nonce_at, page.find('\'', nonce_at) - nonce_at);
  EXPECT_EQ(nonce.size(), 32u);
  std::size_t scripts = 0, carrying = 0;
  for (std::size_t at = page.find("<script"); at != std::string::npos;
       at = page.find("<script", at + 1)) {
    ++scripts;
    if (page.compare(at, 8 + 7 + nonce.size(), "<script nonce=\"" + nonce) == 0) ++carrying;
  }
  EXPECT_EQ(carrying, scripts - 1);  // all but the data element, which is not run
  EXPECT_NE(page.find("connect-src 'none'"), std::string::npos);
  EXPECT_NE(results_view_html(data, true).find("connect-src 'self'"), std::string::npos);
  EXPECT_EQ(results_view_html(data).find(nonce), std::string::npos);  // a new page, a new nonce
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

// kvlab view reads only the folder's own regular files: a symlink (to a credentials file the page
// would embed) is an error naming it, never followed; so is a run folder that is a symlink.
TEST(ResultsView, SymlinksAreNeverFollowed) {
  const test::TempDir dir;
  const fs::path folder = write_results(dir);
  write_text(dir / "secret.txt", "{\"ttft_s\": {\"mean\": 1}, \"password\": \"hunter2\"}");
  fs::remove(folder / "001_fcfs" / "summary.json");
  fs::create_symlink(dir / "secret.txt", folder / "001_fcfs" / "summary.json");
  const std::string linked = error_of(folder);
  EXPECT_NE(linked.find("summary.json is a symbolic link, not a regular file"), std::string::npos)
      << linked;
  fs::remove(folder / "001_fcfs" / "summary.json");
  fs::rename(folder / "001_fcfs" / "events.jsonl", dir / "events.jsonl");
  fs::create_symlink(dir / "events.jsonl", folder / "001_fcfs" / "events.jsonl");
  EXPECT_NE(error_of(folder).find("events.jsonl is a symbolic link"), std::string::npos);
  fs::rename(dir / "events.jsonl", folder / "001_fcfs" / "events.jsonl.real");
  fs::remove(folder / "001_fcfs" / "events.jsonl");
  fs::rename(folder / "001_fcfs" / "events.jsonl.real", folder / "001_fcfs" / "events.jsonl");
  EXPECT_EQ(error_of(folder), "");  // as it was: it reads again
  fs::rename(folder / "001_fcfs", dir / "elsewhere");
  fs::create_symlink(dir / "elsewhere", folder / "001_fcfs");
  EXPECT_NE(error_of(folder).find("not a folder of the results folder"), std::string::npos);
}

// A value nested 100,000 deep in any JSON file the view reads is an error naming the file (and
// the line of a JSON-lines file), not a stack overflow; the summary keeps only the numbers the
// page shows.
TEST(ResultsView, DeeplyNestedJsonIsAClearErrorNotACrash) {
  const test::TempDir dir;
  const fs::path folder = write_results(dir);
  const fs::path run = folder / "001_fcfs";
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  const std::string summary = test::read_file(run / "summary.json");
  write_text(run / "summary.json", "{\"x\": " + deep + "}");
  const std::string in_summary = error_of(folder);
  EXPECT_NE(in_summary.find("summary.json is nested deeper than 32 levels"), std::string::npos)
      << in_summary;
  write_text(run / "summary.json", summary);
  const std::string events = test::read_file(run / "events.jsonl");
  write_text(run / "events.jsonl", events + "{\"step\": 1, \"event\": " + deep + "}\n");
  const std::string in_events = error_of(folder);
  EXPECT_NE(in_events.find("events.jsonl line"), std::string::npos) << in_events;
  EXPECT_NE(in_events.find("nested deeper than 32"), std::string::npos) << in_events;
  write_text(run / "events.jsonl", events);
  const std::string frames = test::read_file(run / "frames.jsonl");
  write_text(run / "frames.jsonl", "{\"step\": 0, \"batch\": " + deep + ", \"runs\": []}\n");
  EXPECT_NE(error_of(folder).find("frames.jsonl line 1: nested deeper"), std::string::npos);
  write_text(run / "frames.jsonl", frames);
  write_text(folder / "runs.json", deep);
  EXPECT_NE(error_of(folder).find("runs.json is nested deeper"), std::string::npos);
  write_text(folder / "runs.json", "[{\"dir\": \"001_fcfs\"}]");
  const nlohmann::json data = results_view_data(folder);
  const nlohmann::json& kept = data["runs"][0]["summary"];
  EXPECT_TRUE(kept["ttft_s"]["mean"].is_number());
  EXPECT_EQ(kept["ttft_s"].size(), 1u);  // the mean only: nothing else of the file is embedded
}

// A tenant name with a comma, a quote and a line break: requests.csv quotes it (RFC 4180) and
// the view reads the row whole.
TEST(ResultsView, QuotedCellsMaySpanLines) {
  EXPECT_EQ(csv_field("plain"), "plain");
  EXPECT_EQ(csv_field("a,b\"c\nd"), "\"a,b\"\"c\nd\"");
  const test::TempDir dir;
  const fs::path folder = write_results(dir);
  const fs::path file = folder / "001_fcfs" / "requests.csv";
  std::string text = test::read_file(file);
  const std::size_t second_row = text.find('\n') + 1;
  const std::size_t tenant = text.find(',', text.find(',', second_row) + 1) + 1;  // id,priority,
  text.insert(tenant, csv_field("evil,\"tenant\"\nrow"));
  write_text(file, text);
  const nlohmann::json data = results_view_data(folder);
  EXPECT_EQ(data["runs"][1]["requests"]["id"].size(), 24u);
}

}  // namespace
}  // namespace kvlab
