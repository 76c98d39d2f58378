// kvlab run / kvlab check as a user runs them: bad files fail before anything runs, with
// file:line:column and a suggestion; same file and seed give the same bytes; check catches a
// broken allocator.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "kvlab/sim/hardware_profile.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

struct Result {
  int exit_code = -1;
  std::string out, err;
};

Result kvlab(const std::string& arguments) {
  test::TempDir dir;
  const std::string command = std::string(KVLAB_BINARY) + " " + arguments + " > " +
                              (dir / "out").string() + " 2> " + (dir / "err").string();
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, test::read_file(dir / "out"),
          test::read_file(dir / "err")};
}

const std::string kSmall = R"(
[experiment]
name = "small"
seed = 3

[model]
name = "tiny"

[kv_cache]
allocator = "paged"
slots = 1024

[scheduler]
name = "fcfs"

[workload]
requests = 12
arrival = "poisson"
rate = 100.0
prompt_tokens = { dist = "uniform", min = 4, max = 40 }
output_tokens = { dist = "uniform", min = 1, max = 12 }
)";

std::string write_experiment(const test::TempDir& dir, const std::string& text,
                             const std::string& name = "e.toml") {
  test::write_file(dir / name, text);
  return (dir / name).string();
}

TEST(KvlabRun, RunsAndWritesResults) {
  test::TempDir dir;
  const auto file = write_experiment(
      dir,
      kSmall + "\n[[sweep]]\nkey = \"kv_cache.allocator\"\nvalues = [\"static\", \"paged\"]\n");
  const Result r = kvlab("run " + file + " --out " + (dir / "results").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| kv_cache.allocator=static | 12 | 0 |"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("| kv_cache.allocator=paged | 12 | 0 |"), std::string::npos) << r.out;
  for (const char* f : {"requests.csv", "steps.csv", "events.jsonl", "summary.json"})
    EXPECT_TRUE(std::filesystem::exists(dir / "results" / "001_kv_cache.allocator=paged" / f)) << f;
  EXPECT_TRUE(std::filesystem::exists(dir / "results" / "summary.md"));
  const auto summary = nlohmann::json::parse(
      test::read_file(dir / "results" / "001_kv_cache.allocator=paged" / "summary.json"));
  EXPECT_EQ(summary["submitted"], 12);
  EXPECT_EQ(summary["finished"].get<int>() + summary["rejected"].get<int>(), 12);
}

// Speculating too: its proposer's measured time stays out of a virtual run's files.
TEST(KvlabRun, SameFileAndSeedGiveTheSameBytes) {
  for (const bool speculating : {false, true}) {
    test::TempDir dir;
    const auto file = write_experiment(
        dir, std::string(kSmall) + (speculating ? "\n[speculation]\ntokens = 3\n" : ""));
    ASSERT_EQ(kvlab("run " + file + " --out " + (dir / "a").string()).exit_code, 0);
    ASSERT_EQ(kvlab("run " + file + " --out " + (dir / "b").string()).exit_code, 0);
    std::vector<std::string> files = {"requests.csv", "steps.csv", "events.jsonl", "summary.json"};
    if (speculating) files.emplace_back("verifies.csv");
    for (const std::string& f : files) {
      const std::string a = test::read_file(dir / "a" / "000" / f),
                        b = test::read_file(dir / "b" / "000" / f);
      EXPECT_FALSE(a.empty()) << f;
      EXPECT_EQ(a, b) << f << (speculating ? " (speculating)" : "");
    }
  }
}

TEST(KvlabRun, SetOverridesAKey) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const Result r =
      kvlab("run " + file + " --set workload.requests=5 --set scheduler.name=static --out " +
            (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto summary = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  EXPECT_EQ(summary["submitted"], 5);
  EXPECT_EQ(summary["scheduler"], "static");
}

// The issue's friction: --set on a swept key used to run the file's sweep without a word.
TEST(KvlabRun, SetOnASweptKeySaysItReplacesTheAxisAndSweepAddsOne) {
  test::TempDir dir;
  const auto file = write_experiment(
      dir, kSmall + "\n[[sweep]]\nkey = \"scheduler.name\"\nvalues = [\"static\", \"fcfs\"]\n");
  const Result r = kvlab("run " + file +
                         " --set scheduler.name=chunked --sweep kv_cache.allocator=static,paged"
                         " --out " +
                         (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("kvlab: --set scheduler.name=chunked replaces the file's [[sweep]] over "
                       "scheduler.name (2 values)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("| kv_cache.allocator=static | 12 | 0 |"), std::string::npos) << r.out;
  const auto runs = nlohmann::json::parse(test::read_file(dir / "o" / "runs.json"));
  ASSERT_EQ(runs.size(), 2u);
  const auto summary = nlohmann::json::parse(
      test::read_file(dir / "o" / runs[1].at("dir").get<std::string>() / "summary.json"));
  EXPECT_EQ(summary["scheduler"], "chunked");
  const auto manifest = nlohmann::json::parse(test::read_file(dir / "o" / "manifest.json"));
  EXPECT_EQ(manifest["sweeps"], nlohmann::json::array({"kv_cache.allocator=static,paged"}));
}

TEST(KvlabRun, BadFilesFailBeforeAnythingRuns) {
  test::TempDir dir;
  auto error_of = [&](const std::string& text, const std::string& extra = "") {
    const auto file = write_experiment(dir, text);
    const Result r = kvlab("run " + file + " --out " + (dir / "never").string() + extra);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_FALSE(std::filesystem::exists(dir / "never")) << "nothing may be written for a bad file";
    return r.err;
  };
  std::string e = error_of(kSmall + "\n[scheduler.paramz]\n");
  EXPECT_NE(e.find("e.toml:"), std::string::npos) << e;
  e = error_of("[experiment]\nname = \"x\"\nsede = 4\n");
  EXPECT_NE(e.find("e.toml:3:1: unknown key \"sede\" in [experiment] (did you mean \"seed\"?)"),
            std::string::npos)
      << e;
  e = error_of("[workload]\nrequests = \"many\"\n");
  EXPECT_NE(e.find("e.toml:2:12: workload.requests must be an integer"), std::string::npos) << e;
  e = error_of("[workload]\narrival = \"poison\"\n");
  EXPECT_NE(e.find("arrival \"poison\" is not one of"), std::string::npos) << e;
  e = error_of("[workload\n");
  EXPECT_NE(e.find("e.toml:1:"), std::string::npos) << e;
  e = error_of("[schedular]\nname = \"fcfs\"\n");
  EXPECT_NE(e.find("unknown key \"schedular\" in [top level] (did you mean \"scheduler\"?)"),
            std::string::npos)
      << e;
  e = error_of(kSmall, " --set scheduler.name=fcsf");
  EXPECT_NE(e.find("unknown scheduler plugin \"fcsf\" (did you mean \"fcfs\"?)"), std::string::npos)
      << e;
  e = error_of(kSmall + "\n[[sweep]]\nkey = \"scheduler.name\"\nvalues = []\n");
  EXPECT_NE(e.find("non-empty values"), std::string::npos) << e;
  e = error_of(kSmall, " --set kv_cache.params.block_size=0");
  EXPECT_NE(e.find("\"block_size\" = 0 is out of range"), std::string::npos) << e;
  const Result missing = kvlab("run /nonexistent/x.toml");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("cannot read experiment file /nonexistent/x.toml"), std::string::npos)
      << missing.err;
}

TEST(KvlabRun, RequestsThatCannotFitAreRejectedAndCounted) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const Result r =
      kvlab("run " + file + " --set 'workload.output_tokens={dist=\"fixed\",value=600}' --out " +
            (dir / "o").string());
  // Every request rejected: the results are written, and the run fails saying why.
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.out.find("| 0 | 12 |"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("kvlab: error: run 1 (base): all 12 requests were rejected:"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(" x prompt "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exceed the context of 512"), std::string::npos) << r.err;
  EXPECT_NE(test::read_file(dir / "o" / "000" / "events.jsonl").find("exceed the context"),
            std::string::npos);
  const Result check =
      kvlab("check " + file + " --set 'workload.output_tokens={dist=\"fixed\",value=600}'");
  EXPECT_EQ(check.exit_code, 1) << check.err;  // nothing finished: nothing was checked
  EXPECT_NE(check.err.find("no request finished, so nothing was checked"), std::string::npos)
      << check.err;
  EXPECT_EQ(check.out.find("every finished request's tokens equal"), std::string::npos);
}

// A results folder says what made it; an earlier run is replaced only with --force, and then
// only the files kvlab wrote: the user's notes stay.
TEST(KvlabRun, ResultsFolderDescribesItselfAndIsNotOverwritten) {
  test::TempDir dir;
  const auto file =
      write_experiment(dir, kSmall + "\n[[sweep]]\nkey = \"workload.requests\"\nvalues = [3, 4]\n");
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --set experiment.seed=4 --out " + out).exit_code, 0);
  const auto manifest = nlohmann::json::parse(test::read_file(dir / "o" / "manifest.json"));
  EXPECT_EQ(manifest["experiment_file"], file);
  EXPECT_EQ(manifest["overrides"][0], "experiment.seed=4");
  EXPECT_TRUE(manifest["failed_runs"].empty());
  EXPECT_FALSE(manifest["kvlab_commit"].get<std::string>().empty());
  EXPECT_NE(manifest["machine"].get<std::string>().find("processors"), std::string::npos);
  EXPECT_NE(
      test::read_file(dir / "o" / "000_workload.requests=3" / "config.toml").find("requests = 3"),
      std::string::npos);
  const auto marker = nlohmann::json::parse(test::read_file(dir / "o" / ".kvlab-results.json"));
  EXPECT_TRUE(marker["complete"].get<bool>());
  EXPECT_TRUE(std::any_of(marker["files"].begin(), marker["files"].end(), [](const auto& f) {
    return f["path"] == "001_workload.requests=4/requests.csv" && f["stamp"]["bytes"] > 0;
  }));

  const Result again = kvlab("run " + file + " --out " + out);
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("holds an earlier run: pass --force"), std::string::npos) << again.err;
  test::write_file(dir / "o" / "NOTES.md", "my notes");
  test::write_file(dir / "o" / "000_workload.requests=3" / "plot.png", "mine too");
  // The rerun sweeps one point only: the earlier 001_ folder was kvlab's and goes.
  const auto one_point = write_experiment(
      dir, kSmall + "\n[[sweep]]\nkey = \"workload.requests\"\nvalues = [3]\n", "one.toml");
  const Result forced = kvlab("run " + one_point + " --force --out " + out);
  ASSERT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_EQ(test::read_file(dir / "o" / "NOTES.md"), "my notes");
  EXPECT_EQ(test::read_file(dir / "o" / "000_workload.requests=3" / "plot.png"), "mine too");
  EXPECT_NE(forced.err.find("kept NOTES.md (not written by kvlab)"), std::string::npos)
      << forced.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "o" / "001_workload.requests=4"));
  EXPECT_TRUE(std::filesystem::exists(dir / "o" / "000_workload.requests=3" / "requests.csv"));
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename().string().find(".o.kvlab"), std::string::npos)
        << "left behind: " << entry.path();
}

// Folders kvlab did not write are never cleared, whatever they hold (a web app with a
// manifest.json, a thesis beside a runs.json), --force or not.
TEST(KvlabRun, ForceNeverClearsAFolderWithoutTheMarker) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  test::write_file(dir / "app" / "manifest.json", "{\"name\": \"my app\"}");
  test::write_file(dir / "app" / "index.html", "<html></html>");
  test::write_file(dir / "thesis" / "runs.json", "[]");
  test::write_file(dir / "thesis" / "thesis.tex", "\\documentclass{book}");
  for (const char* folder : {"app", "thesis"}) {
    const Result r = kvlab("run " + file + " --force --out " + (dir / folder).string());
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find("holds no .kvlab-results.json (it is not a kvlab results folder"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("nothing was changed"), std::string::npos) << r.err;
  }
  EXPECT_EQ(test::read_file(dir / "app" / "index.html"), "<html></html>");
  EXPECT_EQ(test::read_file(dir / "thesis" / "thesis.tex"), "\\documentclass{book}");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "app"), {}), 2);
}

// A folder an older kvlab wrote (no marker, but its manifest.json and runs.json) is replaced by
// --force file by kvlab file name, so scripts/quickstart.sh still reruns; the rest is kept.
TEST(KvlabRun, ForceReplacesAnOlderKvlabsFolderKeepingTheRest) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --out " + out).exit_code, 0);
  std::filesystem::remove(dir / "o" / ".kvlab-results.json");  // as an older kvlab left it
  test::write_file(dir / "o" / "NOTES.md", "mine");
  const Result rerun = kvlab("run " + file + " --force --out " + out);
  ASSERT_EQ(rerun.exit_code, 0) << rerun.err;
  EXPECT_EQ(test::read_file(dir / "o" / "NOTES.md"), "mine");
  EXPECT_TRUE(std::filesystem::exists(dir / "o" / ".kvlab-results.json"));
  std::filesystem::remove(dir / "o" / ".kvlab-results.json");
  test::write_file(dir / "o" / "experiment.toml", "# edited\n");  // no stamp: never assumed ours
  const Result edited = kvlab("run " + file + " --force --out " + out);
  EXPECT_EQ(edited.exit_code, 1);
  EXPECT_NE(edited.err.find("holds experiment.toml, which kvlab did not write"), std::string::npos)
      << edited.err;
  EXPECT_EQ(test::read_file(dir / "o" / "experiment.toml"), "# edited\n");
}

// kvlab view writes its page into the results folder and lists it as kvlab's: a rerun with
// --force replaces it with the rest (no stale page of an earlier run left behind). A folder kvlab
// run did not write is a clear error.
TEST(KvlabView, ThePageJoinsTheResultsFolderAndForceReplacesIt) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --out " + out).exit_code, 0);
  const Result view = kvlab("view " + out);
  ASSERT_EQ(view.exit_code, 0) << view.err;
  EXPECT_NE(view.out.find("view.html"), std::string::npos) << view.out;
  ASSERT_TRUE(std::filesystem::is_regular_file(dir / "o" / "view.html"));
  EXPECT_NE(test::read_file(dir / "o" / ".kvlab-results.json").find("\"view.html\""),
            std::string::npos);
  ASSERT_EQ(kvlab("run " + file + " --force --out " + out).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(dir / "o" / "view.html"));
  const Result elsewhere = kvlab("view " + out + " --out " + (dir / "page.html").string());
  ASSERT_EQ(elsewhere.exit_code, 0) << elsewhere.err;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir / "page.html"));
  const Result bad = kvlab("view " + dir.path().string());
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("has no runs.json: not a results folder kvlab run wrote"),
            std::string::npos)
      << bad.err;
}

// kvlab view never writes over the folder's own files, nor an existing file without --force, and
// replaces a planted view.html symlink itself, never what it points to.
TEST(KvlabView, ThePageNeverOverwritesInputsOrOtherFiles) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --out " + out).exit_code, 0);
  const std::string runs = test::read_file(dir / "o" / "runs.json");
  for (const std::string input : {"runs.json", ".kvlab-results.json"}) {
    const Result r = kvlab("view " + out + " --force --out " + (dir / "o" / input).string());
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find("one of the results folder's own files"), std::string::npos) << r.err;
  }
  EXPECT_EQ(test::read_file(dir / "o" / "runs.json"), runs);
  test::write_file(dir / "mine.html", "mine");
  const Result taken = kvlab("view " + out + " --out " + (dir / "mine.html").string());
  EXPECT_EQ(taken.exit_code, 1);
  EXPECT_NE(taken.err.find("exists: pass --force"), std::string::npos) << taken.err;
  EXPECT_EQ(test::read_file(dir / "mine.html"), "mine");
  EXPECT_EQ(kvlab("view " + out + " --force --out " + (dir / "mine.html").string()).exit_code, 0);
  EXPECT_NE(test::read_file(dir / "mine.html").find("kvlab view"), std::string::npos);
  // Its own page, as kvlab wrote it, is replaced without --force; a planted link is not.
  ASSERT_EQ(kvlab("view " + out).exit_code, 0);
  ASSERT_EQ(kvlab("view " + out).exit_code, 0);
  test::write_file(dir / "credentials", "secret");
  std::filesystem::remove(dir / "o" / "view.html");
  std::filesystem::create_symlink(dir / "credentials", dir / "o" / "view.html");
  EXPECT_EQ(kvlab("view " + out).exit_code, 1);
  ASSERT_EQ(kvlab("view " + out + " --force").exit_code, 0);
  EXPECT_EQ(test::read_file(dir / "credentials"), "secret");
  EXPECT_FALSE(std::filesystem::is_symlink(dir / "o" / "view.html"));
}

// Re-running the experiment.toml a results folder holds, into that folder: the input is read
// before anything is replaced and is still there, byte for byte, afterwards.
TEST(KvlabRun, ForceKeepsTheInputBeingRun) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --out " + out).exit_code, 0);
  const std::string input = (dir / "o" / "experiment.toml").string();
  const Result rerun = kvlab("run " + input + " --force --out " + out);
  ASSERT_EQ(rerun.exit_code, 0) << rerun.err;
  EXPECT_EQ(test::read_file(input), kSmall);
  EXPECT_NE(rerun.out.find("results: "), std::string::npos);
  // An edited copy is the user's now (its size or time differs from what the marker lists):
  // never replaced, and the run says where its own results went instead.
  test::write_file(dir / "o" / "experiment.toml", kSmall + "\n# edited\n");
  const Result edited = kvlab("run " + file + " --force --out " + out);
  EXPECT_EQ(edited.exit_code, 1);
  EXPECT_NE(edited.err.find("holds experiment.toml, which kvlab did not write"), std::string::npos)
      << edited.err;
  EXPECT_NE(edited.err.find("this run's results are in"), std::string::npos) << edited.err;
  EXPECT_EQ(test::read_file(dir / "o" / "experiment.toml"), kSmall + "\n# edited\n");
}

// One writer per folder: a second kvlab run on a folder being written stops at once.
TEST(KvlabRun, ASecondWriterOfAResultsFolderIsRefused) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const auto lock_path = dir / ".o.kvlab-lock";
  const int fd = open(lock_path.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(write(fd, "4242", 4), 4);
  const Result second = kvlab("run " + file + " --force --out " + (dir / "o").string());
  EXPECT_EQ(second.exit_code, 1);
  EXPECT_NE(second.err.find("is being written by another kvlab run (pid 4242)"), std::string::npos)
      << second.err;
  EXPECT_EQ(second.out.find("results:"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir / "o"));
  close(fd);
  EXPECT_EQ(kvlab("run " + file + " --out " + (dir / "o").string()).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(lock_path)) << "the lock is removed with its writer";
}

// Two runs started together on one folder: one writes it, the other is refused or replaces it
// whole (never a folder holding a mix of both, never two "results:" for one set of files).
TEST(KvlabRun, TwoForcedRunsAtOnceLeaveOneWholeFolder) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  const std::string both = fmt::format(
      "( {0} run {1} --force --out {2} --set experiment.seed=1 > {3}/a 2>&1; echo $? > {3}/ra ) & "
      "( {0} run {1} --force --out {2} --set experiment.seed=2 > {3}/b 2>&1; echo $? > {3}/rb ) & "
      "wait",
      KVLAB_BINARY, file, out, dir.path().string());
  ASSERT_EQ(std::system(both.c_str()), 0);
  const int a = std::stoi(test::read_file(dir / "ra")), b = std::stoi(test::read_file(dir / "rb"));
  const std::string seed_line = test::read_file(dir / "o" / "000" / "config.toml");
  for (const auto& [code, log] : {std::pair{a, "a"}, std::pair{b, "b"}}) {
    const std::string text = test::read_file(dir / log);
    if (code != 0)
      EXPECT_NE(text.find("is being written by another kvlab run"), std::string::npos) << text;
    else
      EXPECT_NE(text.find("results: "), std::string::npos) << text;
  }
  EXPECT_TRUE(a == 0 || b == 0);
  const auto manifest = nlohmann::json::parse(test::read_file(dir / "o" / "manifest.json"));
  const std::string seed = manifest["overrides"][0];
  EXPECT_NE(seed_line.find(seed.substr(seed.find('=') + 1) == "1" ? "seed = 1" : "seed = 2"),
            std::string::npos)
      << "the run's config and the manifest come from one run";
}

// A disk that fills (a file-size limit stands in for it on every machine): a non-zero exit with
// the system's reason, no "results:", and the earlier results as they were.
TEST(KvlabRun, AFullDiskLeavesTheEarlierResultsAndExitsNonZero) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::string out = (dir / "o").string();
  ASSERT_EQ(kvlab("run " + file + " --out " + out).exit_code, 0);
  const std::string before = test::read_file(dir / "o" / "000" / "requests.csv");
  // dash's ulimit -f counts 512-byte blocks: 2 KiB per file, less than this requests.csv.
  const std::string command = fmt::format(
      "ulimit -f 4; {} run {} --set workload.requests=300 "
      "--force --out {} > {}/out 2> {}/err",
      KVLAB_BINARY, file, out, dir.path().string(), dir.path().string());
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string err = test::read_file(dir / "err");
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_EQ(test::read_file(dir / "out").find("results:"), std::string::npos);
  EXPECT_EQ(test::read_file(dir / "o" / "000" / "requests.csv"), before);
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename().string().find(".o.kvlab"), std::string::npos)
        << "left behind: " << entry.path();
}

// The same on a real full filesystem: a 64 KiB tmpfs (needs mount rights: root in CI).
TEST(KvlabRun, AFullFilesystemIsAnErrorNotResults) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const auto mount_point = dir / "small";
  std::filesystem::create_directories(mount_point);
  const std::string mount =
      fmt::format("mount -t tmpfs -o size=64k kvlab-test {} 2>/dev/null", mount_point.string());
  if (std::system(mount.c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN); "
                    "AFullDiskLeavesTheEarlierResultsAndExitsNonZero covers the same path";
  const Result r =
      kvlab("run " + file + " --set workload.requests=2000 --out " + (mount_point / "o").string());
  const int unmounted = std::system(("umount " + mount_point.string()).c_str());
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("results:"), std::string::npos);
  EXPECT_EQ(unmounted, 0);
}

// kvlab model init writes over a model folder only with --force.
TEST(KvlabRun, ModelInitDoesNotOverwriteWithoutForce) {
  test::TempDir dir;
  test::write_file(dir / "m" / "config.json", "{\"mine\": true}");
  const Result r = kvlab("model init --preset tiny --out " + (dir / "m").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("config.json exists: pass --force"), std::string::npos) << r.err;
  EXPECT_EQ(test::read_file(dir / "m" / "config.json"), "{\"mine\": true}");
  EXPECT_EQ(kvlab("model init --preset tiny --force --out " + (dir / "m").string()).exit_code, 0);
  EXPECT_NE(test::read_file(dir / "m" / "config.json").find("hidden_size"), std::string::npos);
}

// Arrivals so late that a step's duration vanishes in the clock (a rate of 1e-300 or 1e-320,
// a trace row at 1e308 s) are an error naming the request, never a table of zero latencies.
TEST(KvlabRun, ArrivalsPastDoublePrecisionTimeAreRefused) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  for (const char* rate : {"1e-300", "1e-320"}) {
    const Result r =
        kvlab("run " + file + " --set workload.rate=" + rate + " --out " + (dir / "o").string());
    EXPECT_EQ(r.exit_code, 1) << rate;
    EXPECT_NE(r.err.find("request 0 arrives at"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("outside [0, 1e+09] s"), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "o")) << "no run finished: no results folder";
  }
  test::write_file(dir / "late.csv", "arrival_s,prompt_len,output_len\n0,5,3\n1e308,5,3\n");
  const Result trace =
      kvlab("run " + file + " --set 'workload={trace=\"late.csv\"}' --out " + (dir / "t").string());
  EXPECT_EQ(trace.exit_code, 1);
  EXPECT_NE(trace.err.find("arrival_s must be in [0, 1e+09] seconds, got 1e+308"),
            std::string::npos)
      << trace.err;
}

// Sizes no machine holds name the input that asked and how much: a legal 2^31-position
// context (its RoPE table), 1,024 replicas each with its own KV pool (under an 8 GB limit).
TEST(KvlabRun, OutOfMemoryNamesTheInputAndTheSize) {
  test::TempDir dir;
  ASSERT_EQ(kvlab("model init --preset tiny --out " + (dir / "m").string()).exit_code, 0);
  auto config = nlohmann::json::parse(test::read_file(dir / "m" / "config.json"));
  config["max_position_embeddings"] = std::int64_t{1} << 31;
  test::write_file(dir / "m" / "config.json", config.dump());
  const Result rope =
      kvlab("generate --model " + (dir / "m").string() + " --prompt-ids 1,2,3 --max-tokens 2");
  EXPECT_EQ(rope.exit_code, 1);
  EXPECT_NE(rope.err.find("the RoPE cos/sin table for max_position_embeddings = 2147483648"),
            std::string::npos)
      << rope.err;
  EXPECT_NE(rope.err.find("needs 128.0 GiB"), std::string::npos) << rope.err;

  const auto file = write_experiment(dir, kSmall + "\n[cluster]\nreplicas = 1024\n");
  const std::string command =
      fmt::format("ulimit -v 8000000; {} check {} --set kv_cache.slots=65536 > {}/out 2> {}/err",
                  KVLAB_BINARY, file, dir.path().string(), dir.path().string());
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string err = test::read_file(dir / "err");
  EXPECT_NE(err.find("1024 replicas ([cluster] replicas), each with its own KV pool of 65536 "
                     "slots"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("out of memory: the input asks"), std::string::npos) << err;
}

// Inputs that used to run with a value nobody gave: each is refused before anything runs.
TEST(KvlabRun, InputsThatRanSilentlyWrongAreRefused) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run " + file + " --set 'experiment.seed=-1'", "experiment.seed must be >= 0"},
      {"run " + file + " --set slo.ttft_s=nan", "slo.ttft_s must be a finite number of seconds"},
      {"run " + file + " --set 'workload.requests=5\nscheduler.name=\"static\"'",
       "the value is more than one TOML value"},
      {"run " +
           write_experiment(dir, kSmall + "\n[[sweep]]\nkey = \"sweep\"\nvalues = [1]\n", "s.toml"),
       "[[sweep]] cannot sweep the sweep itself"},
      {"memory --model llama-7b --seq-len 2048 --gpu-mem 1e308", "--gpu-mem"},
  };
  for (const auto& [arguments, expected] : cases) {
    const Result r = kvlab(arguments + " --out " + (dir / "o").string());
    EXPECT_NE(r.exit_code, 0) << arguments;
    EXPECT_NE(r.err.find(expected), std::string::npos) << arguments << ": " << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "o"));
}

// A static allocator whose max_seq_len is below a request's length: the reason names the
// allocator's limit, not a pool that would hold the request many times over.
TEST(KvlabRun, AStaticAllocatorsLimitIsNotBlamedOnThePool) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const Result r = kvlab("run " + file +
                         " --set kv_cache.allocator=static --set kv_cache.params.max_seq_len=4 "
                         "--out " +
                         (dir / "o").string());
  EXPECT_NE(r.err.find("fit the pool (1024 slots), but allocator plugin \"static\""),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the static allocator's max_seq_len"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("need more KV than the pool holds"), std::string::npos) << r.err;
}

TEST(KvlabRun, EveryPointIsValidatedBeforeTheFirstRuns) {
  test::TempDir dir;
  const auto file = write_experiment(
      dir, kSmall + "\n[[sweep]]\nkey = \"scheduler.name\"\nvalues = [\"fcfs\", \"fcsf\"]\n");
  const Result r = kvlab("run " + file + " --out " + (dir / "o").string());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("sweep point 2 (scheduler.name=fcsf): unknown scheduler plugin"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "o")) << "the first point must not have run";
  const Result params =
      kvlab("run " + file + " --set scheduler.params.nope=1 --out " + (dir / "p").string());
  EXPECT_NE(params.err.find("plugin \"fcfs\" has no parameter \"nope\""), std::string::npos)
      << params.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "p"));
}

TEST(KvlabRun, SizesAndFoldersFromInputAreBounded) {
  test::TempDir dir;
  auto error_of = [&](const std::string& arguments) {
    const Result r = kvlab(arguments);
    EXPECT_EQ(r.exit_code, 1) << arguments;
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
    return r.err;
  };
  const auto file = write_experiment(dir, kSmall);
  EXPECT_NE(error_of("check " + file + " --set workload.requests=1000000000000")
                .find("workload.requests = 1000000000000 is outside [1, 10000000]"),
            std::string::npos);
  EXPECT_NE(error_of("check " + file + " --set experiment.repeats=1000000000")
                .find("experiment.repeats = 1000000000 is outside"),
            std::string::npos);
  EXPECT_NE(error_of("check " + file + " --set workload.top_k=4294967297")
                .find("workload.top_k = 4294967297 is outside"),
            std::string::npos);
  EXPECT_NE(error_of("check " + file + " --set kv_cache.slots=1099511627776")
                .find("more than this machine can hold"),
            std::string::npos);
  std::string sweeps = kSmall;
  for (int axis = 0; axis < 8; ++axis)  // 10^8 points used to hang while expanding
    sweeps +=
        fmt::format("[[sweep]]\nkey = \"workload.seed{}\"\nvalues = [0,1,2,3,4,5,6,7,8,9]\n", axis);
  const auto big = write_experiment(dir, sweeps, "big.toml");
  EXPECT_NE(error_of("check " + big).find("more than 10000 points"), std::string::npos);
  EXPECT_NE(error_of("run " + dir.path().string()).find("is a folder"), std::string::npos);
}

// Paths in an experiment file are relative to the file, not to where kvlab runs.
TEST(KvlabRun, RelativePathsResolveAgainstTheFile) {
  test::TempDir dir;
  test::write_file(dir / "sub" / "trace.csv",
                   "arrival_s,prompt_len,output_len\n0.0,5,3\n0.01,7,2\n");
  const std::string replay = kSmall.substr(0, kSmall.find("[workload]")) +  // a trace's table
                             "[workload]\ntrace = \"trace.csv\"\n";
  const auto file = write_experiment(dir, replay, "sub/e.toml");
  const Result r = kvlab("run " + file + " --out " + (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| 2 | 0 |"), std::string::npos) << r.out;
}

TEST(KvlabRun, WallClockReplaysArrivalsInRealTime) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const auto start = std::chrono::steady_clock::now();
  const Result r =
      kvlab("run " + file + " --set experiment.clock=wall --set workload.rate=40.0 --out " +
            (dir / "o").string());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("| 12 | 0 |"), std::string::npos) << r.out;
  const auto summary = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  // 12 Poisson arrivals at 40/s span ~0.3 s of real time, which the run must have waited for.
  EXPECT_GT(summary["duration_s"].get<double>(), 0.1);
  EXPECT_GE(seconds, summary["duration_s"].get<double>());
}

TEST(KvlabRun, EvictionsAreLogged) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  const Result r = kvlab(
      "run " + file +
      " --set kv_cache.slots=128 --set workload.prefix_groups=6 --set workload.prefix_tokens=16 " +
      "--set workload.requests=30 --out " + (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string events = test::read_file(dir / "o" / "000" / "events.jsonl");
  EXPECT_NE(events.find("\"event\":\"evict\""), std::string::npos);
  EXPECT_NE(events.find("\"event\":\"admit\""), std::string::npos);
  EXPECT_NE(events.find("\"event\":\"finish\""), std::string::npos);
}

// A Hugging Face folder that declares its own sliding window (Mistral-style) runs with that
// window under any attention variant, and `check` compares the same model: the engine used to
// drop the window unless the variant was sliding_window, while the reference kept it (10 of 12
// requests differed).
TEST(KvlabCheck, HonoursTheModelsOwnSlidingWindow) {
  test::TempDir dir;
  ASSERT_EQ(kvlab("model init --preset tiny --seed 0 --out " + (dir / "m").string()).exit_code, 0);
  auto config = nlohmann::json::parse(test::read_file(dir / "m" / "config.json"));
  config["sliding_window"] = 8;  // prompts of 4-40 tokens: most attend past it
  config["architectures"] = {"MistralForCausalLM"};
  config["model_type"] = "mistral";
  test::write_file(dir / "m" / "config.json", config.dump(2));
  std::string experiment = kSmall;
  experiment.replace(experiment.find("name = \"tiny\""), 13, "name = \"m\"");
  const auto file = write_experiment(dir, experiment);
  for (const char* variant : {"gqa", "mha"}) {
    const Result r = kvlab("check " + file + " --set attention.variant=" + variant);
    EXPECT_EQ(r.exit_code, 0) << variant << "\n" << r.err;
    EXPECT_NE(r.out.find("every finished request's tokens equal the reference's"),
              std::string::npos)
        << r.out;
  }
}

// The number printed right after `label` in `text` (NaN when it is not there).
double number_after(const std::string& text, const std::string& label) {
  const auto at = text.find(label);
  if (at == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + at + label.size(), nullptr);
}
const std::string kMaxLogitDelta = "max |engine - reference| ";

// --tolerance TAU checks rounded settings: a token passes when its reference logit is within TAU
// of the best. Without it they are refused (and say where to go); with a tolerance too small
// for 4-bit weights the check fails naming the gap; a broken allocator still fails at any
// sensible tolerance (its tokens come from other sequences' K/V).
TEST(KvlabCheck, ToleranceAcceptsNearTiesOfRoundedSettingsOnly) {
  // One thread: two OpenMP threads per process under ctest -j2 took 2-3x as long.
  const std::string quickstart = std::string("check ") + KVLAB_SOURCE_DIR +
                                 "/experiments/quickstart.toml --set workload.requests=12 " +
                                 "--set backend.threads=1 ";
  const Result refused = kvlab(quickstart + "--set 'kv_cache.dtype=\"f16\"'");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.err.find("--tolerance TAU"), std::string::npos) << refused.err;
  const Result f16 = kvlab(quickstart + "--set 'kv_cache.dtype=\"f16\"' --tolerance 0.01");
  EXPECT_EQ(f16.exit_code, 0) << f16.err;
  EXPECT_NE(f16.out.find("within 0.01 of the reference's best logit"), std::string::npos)
      << f16.out;
  // The logits are measured too: f16 K/V move them (> 0), by less than half of TAU (so any
  // argmax of them is within TAU of the reference's best), every top 5 stays.
  const double f16_delta = number_after(f16.out, kMaxLogitDelta);
  EXPECT_GT(f16_delta, 0) << f16.out;
  EXPECT_LT(2 * f16_delta, 0.01) << f16.out;
  EXPECT_NE(f16.out.find("top-5 overlap 100.0%"), std::string::npos) << f16.out;
  const Result exact = kvlab(quickstart);
  EXPECT_EQ(exact.exit_code, 0) << exact.err;
  EXPECT_EQ(exact.out.find(kMaxLogitDelta), std::string::npos) << exact.out;  // tokens only
  // 4-bit weights, every token accepted: each gap is at most twice the largest logit error
  // (engine argmax c, reference argmax a: e_c >= e_a, so r_a - r_c <= (r_a - e_a) + (e_c - r_c)).
  const Result q4_all =
      kvlab(quickstart + "--set 'backend.weights=\"q4_0\"' --set 'backend.activations=\"q8\"' " +
            "--tolerance 100");
  EXPECT_EQ(q4_all.exit_code, 0) << q4_all.err;
  const double q4_delta = number_after(q4_all.out, kMaxLogitDelta);
  const double q4_gap = number_after(q4_all.out, "largest gap ");
  EXPECT_GT(q4_gap, 0) << q4_all.out;
  EXPECT_LE(q4_gap, 2 * q4_delta) << q4_all.out;
  EXPECT_GT(q4_delta, 10 * f16_delta) << q4_all.out;
  const Result q4 =
      kvlab(quickstart + "--set 'backend.weights=\"q4_0\"' --set 'backend.activations=\"q8\"' " +
            "--tolerance 1e-9");
  EXPECT_EQ(q4.exit_code, 1) << q4.out;
  EXPECT_NE(q4.err.find("beyond the tolerance 1e-09"), std::string::npos) << q4.err;
  for (const char* bad : {"-1", "nan", "inf"}) {
    const Result refused_value = kvlab(quickstart + "--tolerance " + bad);
    EXPECT_EQ(refused_value.exit_code, 2) << bad;
    EXPECT_NE(refused_value.err.find("--tolerance"), std::string::npos) << refused_value.err;
  }
}

TEST(KvlabCheck, CatchesABrokenAllocator) {
  test::TempDir dir;
  const auto file = write_experiment(dir, kSmall);
  std::filesystem::create_directories(dir / "plugins");
  std::filesystem::copy_file(
      std::filesystem::path(KVLAB_TEST_PLUGIN_DIR) / "kvlab_plugin_test_broken_allocator.so",
      dir / "plugins" / "kvlab_plugin_test_broken_allocator.so");
  const std::string command =
      "check " + file +
      " --set kv_cache.allocator=broken_shared_slots --set 'experiment.plugin_paths=[\"" +
      (dir / "plugins").string() + "\"]'";
  const Result r = kvlab(command);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("mismatch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("differ from the reference"), std::string::npos) << r.err;
  // The tolerance that covers 16-bit KV pools does not hide it. (A random model's logits are
  // nearly flat: its wrong tokens are within 0.35 of the best, so a tolerance of 1 would.)
  const Result tolerant = kvlab(command + " --tolerance 0.01");
  EXPECT_EQ(tolerant.exit_code, 1) << tolerant.out << tolerant.err;
  EXPECT_NE(tolerant.err.find("beyond the tolerance 0.01"), std::string::npos) << tolerant.err;
  // Its logits are off by orders of magnitude more than a 16-bit KV pool's on the same requests.
  const Result f16 = kvlab("check " + file + " --set 'kv_cache.dtype=\"f16\"' --tolerance 0.01");
  EXPECT_EQ(f16.exit_code, 0) << f16.out << f16.err;
  EXPECT_GT(number_after(tolerant.out, kMaxLogitDelta), 100 * number_after(f16.out, kMaxLogitDelta))
      << tolerant.out << f16.out;
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

TEST(KvlabSimulated, ScaleExperimentRunsWithTheRealPluginsAndNoWeights) {
  test::TempDir dir;
  const Result r = kvlab("run " + std::string(KVLAB_SOURCE_DIR) +
                         "/experiments/simulated_scale.toml --set workload.requests=400 --out " +
                         (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto s = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  EXPECT_EQ(s["finished"], 400);
  EXPECT_EQ(s["backend"], "simulated");
  EXPECT_EQ(s["model"], "llama2-7b");
  // 140 GiB x 0.9 - 12.55 GiB of bf16 weights - 2 GiB, in 512 KiB tokens, whole blocks of 256.
  EXPECT_EQ(s["kv_slots"], 228246 / 256 * 256);
  EXPECT_GT(s["output_tokens_per_s"].get<double>(), 0);
  // Virtual-clock steps carry the cost model's prediction; no measured time leaks into files.
  const std::string steps = test::read_file(dir / "o" / "000" / "steps.csv");
  EXPECT_NE(steps.find("step,start_s,duration_s,predicted_s,"), std::string::npos);
  EXPECT_EQ(steps.find("measured"), std::string::npos);
}

TEST(KvlabSimulated, BackendAndProfileErrorsAreClear) {
  test::TempDir dir;
  auto run = [&](const std::string& text, const std::string& command = "run") {
    test::write_file(dir / "s.toml", text);
    return kvlab(command + " " + (dir / "s.toml").string() +
                 (command == "run" ? " --out " + (dir / "o").string() : std::string()));
  };
  const std::string base = "[model]\nname = \"llama2-7b\"\n[workload]\nrequests = 3\n";
  Result r = run(base + "[backend]\nname = \"simulated\"\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("needs backend.profile"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("h200"), std::string::npos) << r.err;
  r = run(base + "[backend]\nname = \"simulated\"\nprofile = \"h2000\"\n");
  EXPECT_NE(r.err.find("unknown hardware profile \"h2000\" (did you mean h200?)"),
            std::string::npos)
      << r.err;
  r = run(base +
          "[backend]\nname = \"simulated\"\nprofile = \"h200\"\n[backend.params]\ndtype = "
          "\"bf16\"\n");
  // Checked against the backend plugin's parameters, as every plugin's are.
  EXPECT_NE(r.err.find("plugin \"simulated\" has no parameter \"dtype\"; it takes no parameters"),
            std::string::npos)
      << r.err;
  r = run(base + "[backend]\nname = \"tpu\"\n");
  EXPECT_NE(r.err.find("unknown backend plugin \"tpu\""), std::string::npos) << r.err;
  r = run(base + "[backend]\nname = \"simulated\"\nprofile = \"h200\"\n", "check");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("needs backend \"cpu\""), std::string::npos) << r.err;
  // LLaMA-65B in bf16 does not fit on one 80 GiB card: said, not crashed.
  r =
      run("[model]\nname = \"llama-65b\"\n[backend]\nname = \"simulated\"\nprofile = "
          "\"a100-80gb\"\n[workload]\nrequests = 3\n");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("llama-65b does not fit on a100-80gb"), std::string::npos) << r.err;
}

// kvlab calibrate's "roofline: SHAPE took T ms = Rx its roofline (L ms ..." line for `shape`:
// the ratio printed is the time printed over the roofline printed (each rounded to 3 digits).
void expect_roofline_line(const std::string& out, const std::string& shape) {
  const std::string start = "roofline: " + shape + " took ";
  const auto line = out.find(start);
  ASSERT_NE(line, std::string::npos) << out;
  double took_ms = 0, ratio = 0, roofline_ms = 0;
  ASSERT_EQ(std::sscanf(out.c_str() + line + start.size(), "%lf ms = %lfx its roofline (%lf ms",
                        &took_ms, &ratio, &roofline_ms),
            3)
      << out;
  ASSERT_GT(roofline_ms, 0);
  EXPECT_NEAR(ratio, took_ms / roofline_ms, 0.01 * ratio + 0.01) << out;
}

TEST(KvlabCalibrate, WritesAProfileThatTheSimulatedBackendLoads) {
  test::TempDir dir;
  const auto profile = (dir / "new_folder" / "cpu.toml").string();  // --out creates the folder
  const Result r =
      kvlab("calibrate --backend cpu --model tiny --threads 1 --repeats 1 --out " + profile);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("grid shapes mean |error|"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode 8 x ctx 128"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("x roofline"), std::string::npos) << r.out;
  expect_roofline_line(r.out, "decode 32 x ctx 128");  // the CPU grid's largest decode batch
  // The [link] from the engine's own swap copy, out and in, by size.
  EXPECT_NE(r.out.find("out 1 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("in 64 tokens"), std::string::npos) << r.out;
  // The engine replay's steps join the fit, reported by kind; the kernel regimes are fitted.
  EXPECT_NE(r.err.find("replaying 96 requests on the engine"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("engine steps mean |error|"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefill + decodes"), std::string::npos) << r.out;
  const std::string fitted = test::read_file(profile);
  EXPECT_NE(fitted.find("[[gemm_regime]]"), std::string::npos) << fitted;
  // 4 sequences per thread, 1 thread: decode attention switches kernel at 4 sequences.
  const auto attention = fitted.find("[[decode_attention_regime]]");
  ASSERT_NE(attention, std::string::npos) << fitted;
  EXPECT_NE(fitted.find("min_rows = 4", attention), std::string::npos) << fitted;
  EXPECT_NE(fitted.find("engine steps"), std::string::npos) << fitted;
  // The FMA probe runs before and after the measurements; the profile keeps the larger as its
  // peak (a ceiling the fit does not raise). The printout rounds to 0.1 GFLOP/s.
  double before = 0, after = 0, peak_tflops = 0;
  const auto probe = r.err.find("FMA probe: ");
  ASSERT_NE(probe, std::string::npos) << r.err;
  ASSERT_EQ(
      std::sscanf(r.err.c_str() + probe,
                  "FMA probe: %lf GFLOP/s before the measurements, %lf after", &before, &after),
      2)
      << r.err;
  const auto peak = fitted.find("peak_tflops = ");
  ASSERT_NE(peak, std::string::npos) << fitted;
  ASSERT_EQ(std::sscanf(fitted.c_str() + peak, "peak_tflops = %lf", &peak_tflops), 1);
  EXPECT_NEAR(peak_tflops * 1e3, std::max(before, after), 0.051) << r.err;
  test::write_file(dir / "e.toml",
                   kSmall + "[backend]\nname = \"simulated\"\nprofile = \"" + profile + "\"\n");
  const Result run = kvlab("run " + (dir / "e.toml").string() + " --out " + (dir / "o").string());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto s = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  EXPECT_EQ(s["finished"], 12);

  const Result grid_only = kvlab(
      "calibrate --model tiny --threads 1 --repeats 1 --engine-requests 0 "
      "--out " +
      (dir / "grid.toml").string());
  ASSERT_EQ(grid_only.exit_code, 0) << grid_only.err;
  EXPECT_EQ(grid_only.out.find("engine steps"), std::string::npos) << grid_only.out;
  const Result cuda_replay =
      kvlab("calibrate --backend cuda --profile h200 --engine-requests 8 --out " +
            (dir / "gpu.toml").string());
  EXPECT_NE(cuda_replay.exit_code, 0);
  EXPECT_NE(cuda_replay.err.find("the engine replay runs on the cpu backend only"),
            std::string::npos)
      << cuda_replay.err;
  const Result no_profile = kvlab("calibrate --backend cuda --out " + (dir / "gpu.toml").string());
  EXPECT_NE(no_profile.exit_code, 0);
  EXPECT_NE(no_profile.err.find("give --profile"), std::string::npos) << no_profile.err;
  const Result cuda = kvlab("calibrate --backend cuda --profile h200 --model tiny --out " +
                            (dir / "gpu.toml").string());
  if (cuda.exit_code != 0) {  // no GPU here (or no CUDA build): said, nothing written
    EXPECT_TRUE(cuda.err.find("no CUDA device") != std::string::npos ||
                cuda.err.find("unknown backend plugin \"cuda\"") != std::string::npos)
        << cuda.err;
    EXPECT_FALSE(std::filesystem::exists(dir / "gpu.toml"));
  }
}

// kvlab calibrate --vidur: its argument errors, and (with ../shared's Vidur data) a profile and
// a report of every measurement, the held-out models named.
TEST(KvlabCalibrate, VidurFitsAGpuProfileAndReportsEveryMeasurement) {
  test::TempDir dir;
  const std::string out = " --out " + (dir / "a100.toml").string();
  const Result no_gpu =
      kvlab("calibrate --vidur " + dir.path().string() + " --profile a100-80gb" + out);
  EXPECT_NE(no_gpu.exit_code, 0);
  EXPECT_NE(no_gpu.err.find("--vidur needs --gpu a100 or h100"), std::string::npos) << no_gpu.err;
  const Result no_profile = kvlab("calibrate --vidur " + dir.path().string() + " --gpu a100" + out);
  EXPECT_NE(no_profile.err.find("give --profile"), std::string::npos) << no_profile.err;
  const Result not_vidur =
      kvlab("calibrate --vidur " + dir.path().string() + " --gpu a100 --profile a100-80gb" + out);
  EXPECT_NE(not_vidur.exit_code, 0);
  EXPECT_NE(not_vidur.err.find("not Vidur's profiling folder"), std::string::npos) << not_vidur.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "a100.toml"));
  const Result stray = kvlab("calibrate --report r.csv --profile a100-80gb" + out);
  EXPECT_NE(stray.err.find("--report is an option of --vidur"), std::string::npos) << stray.err;
  const Result both = kvlab("calibrate --vidur " + dir.path().string() +
                            " --carry-from h100-sxm --gpu a100 --profile a100-80gb" + out);
  EXPECT_NE(both.err.find("--vidur and --carry-from: give one"), std::string::npos) << both.err;
  const Result measures = kvlab("calibrate --carry-from h100-sxm --threads 4 --profile h200" + out);
  EXPECT_NE(measures.err.find("--threads measures a backend"), std::string::npos) << measures.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "a100.toml"));

  // --carry-from: another GPU's kernel terms and host overhead on this one's peaks, each term's
  // source said (onto l4: a profile of datasheet terms, so every carried term differs).
  const Result carry = kvlab("calibrate --carry-from h100-sxm --profile l4" + out);
  ASSERT_EQ(carry.exit_code, 0) << carry.err;
  const HardwareProfile carried = load_hardware_profile_file(dir / "a100.toml");
  const HardwareProfile h100 = load_hardware_profile("h100-sxm"), l4 = load_hardware_profile("l4");
  EXPECT_DOUBLE_EQ(carried.memory_gb_per_s, l4.memory_gb_per_s);  // the L4's own peaks
  EXPECT_DOUBLE_EQ(carried.peak_tflops, l4.peak_tflops);
  ASSERT_NE(l4.gemm_kernel.knee, h100.gemm_kernel.knee);
  EXPECT_DOUBLE_EQ(carried.gemm_kernel.knee, h100.gemm_kernel.knee);
  EXPECT_DOUBLE_EQ(carried.efficiency.gemm_compute, h100.efficiency.gemm_compute);
  ASSERT_NE(l4.step_overhead_s, h100.step_overhead_s);
  EXPECT_DOUBLE_EQ(carried.step_overhead_s, h100.step_overhead_s);
  EXPECT_EQ(carried.allreduce.size(), h100.allreduce.size());
  EXPECT_NE(carried.provenance.at("gemm").find("carried from h100-sxm"), std::string::npos);
  std::filesystem::remove(dir / "a100.toml");

  const char* env = std::getenv("KVLAB_SHARED_DATA");
  const std::filesystem::path vidur =
      (env != nullptr
           ? std::filesystem::path(env)
           : std::filesystem::path(KVLAB_FIXTURES_DIR) / ".." / ".." / ".." / "shared" / "data") /
      "vidur-profiling";
  if (!std::filesystem::exists(vidur)) GTEST_SKIP() << "no Vidur data at " << vidur.string();
  const Result fit =
      kvlab("calibrate --vidur " + vidur.string() + " --gpu a100 --profile a100-80gb --report " +
            (dir / "new" / "report.csv").string() + out);  // its folder made
  ASSERT_EQ(fit.exit_code, 0) << fit.err;
  EXPECT_NE(fit.out.find("Llama-2-70b-hf               held out"), std::string::npos) << fit.out;
  EXPECT_NE(fit.out.find("layer + attention_decode"), std::string::npos) << fit.out;
  const HardwareProfile written = load_hardware_profile_file(dir / "a100.toml");
  EXPECT_GT(written.gemm_kernel.floor_s, 0);
  EXPECT_EQ(written.allreduce.size(), 3u);
  const std::string report = test::read_file(dir / "new" / "report.csv");
  EXPECT_EQ(
      report.rfind("gpu,model,role,kind,name,tp,tokens,kv_cache,bytes,measured_s,predicted_s\n", 0),
      0u);
  EXPECT_NE(report.find("a100,Llama-2-70b-hf,held_out,layer,layer,8,"), std::string::npos);
}

TEST(KvlabCalibrate, MeasuredClockRecordsPredictionErrors) {
  test::TempDir dir;
  const auto profile = (dir / "cpu.toml").string();
  ASSERT_EQ(kvlab("calibrate --model tiny --threads 1 --repeats 1 --out " + profile).exit_code, 0);
  test::write_file(dir / "e.toml", kSmall + "[backend]\nprofile = \"" + profile + "\"\n");
  const Result r = kvlab("run " + (dir / "e.toml").string() +
                         " --set experiment.clock='\"measured\"' --out " + (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto s = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  ASSERT_TRUE(s.contains("step_prediction_error")) << s.dump();
  EXPECT_EQ(s["step_prediction_error"]["count"], s["steps"]);
  EXPECT_GE(s["step_prediction_error"]["mean"].get<double>(), 0);
  // measured / predicted per step, signed: a step's error is |1 - 1 / ratio|, so every ratio
  // lies in [1 / (1 + the largest error), 1 / (1 - it)].
  ASSERT_TRUE(s.contains("step_time_ratio")) << s.dump();
  EXPECT_EQ(s["step_time_ratio"]["count"], s["steps"]);
  const double max_error = s["step_prediction_error"]["max"].get<double>();
  EXPECT_GE(s["step_time_ratio"]["p50"].get<double>(), 1 / (1 + max_error) - 1e-12);
  if (max_error < 1) {
    EXPECT_LE(s["step_time_ratio"]["max"].get<double>(), 1 / (1 - max_error) + 1e-9);
  }
}

TEST(KvlabMemory, PlannerPrintsStaticVersusPaged) {
  const Result r =
      kvlab("memory --model llama2-7b --gpu h200 --prompt-len 512 --output-len 256 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["kv_capacity_tokens"], 228246);
  EXPECT_EQ(j["max_static_requests"], 228246 / 4096);
  EXPECT_EQ(j["max_paged_requests"], 228246 / 16 * 16 / 768);
  EXPECT_EQ(j["variants"].size(), 3u);  // MHA, GQA-8, MQA
  const Result bad = kvlab("memory --model llama2-7b --gpu h200");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--prompt-len"), std::string::npos) << bad.err;
}

TEST(KvlabCluster, CpuReplicasPassCheckAndTheOutputsSayWhereEachRequestWent) {
  test::TempDir dir;
  const auto file =
      write_experiment(dir, kSmall + "[cluster]\nreplicas = 3\nrouter = \"least_loaded\"\n");
  const Result check = kvlab("check " + file);
  EXPECT_EQ(check.exit_code, 0) << check.err;
  EXPECT_NE(check.out.find("every finished request's tokens equal the reference's"),
            std::string::npos)
      << check.out;
  const Result run = kvlab("run " + file + " --out " + (dir / "o").string());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto s = nlohmann::json::parse(test::read_file(dir / "o" / "000" / "summary.json"));
  EXPECT_EQ(s["router"], "least_loaded");
  ASSERT_EQ(s["replicas"].size(), 3u);
  std::int64_t served = 0;
  for (const auto& r : s["replicas"]) served += r["finished"].get<std::int64_t>();
  EXPECT_EQ(served, s["finished"].get<std::int64_t>());
  const std::string events = test::read_file(dir / "o" / "000" / "events.jsonl");
  std::size_t routes = 0;
  for (std::size_t at = events.find("\"event\":\"route\""); at != std::string::npos;
       at = events.find("\"event\":\"route\"", at + 1))
    ++routes;
  EXPECT_EQ(routes, s["submitted"].get<std::size_t>());
  EXPECT_NE(events.find("least loaded by prefill_tokens"), std::string::npos);
  EXPECT_EQ(test::read_file(dir / "o" / "000" / "steps.csv").rfind("replica,step,", 0), 0u);

  const Result zero = kvlab("run " + write_experiment(dir, kSmall + "[cluster]\nreplicas = 0\n"));
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.err.find("cluster.replicas"), std::string::npos) << zero.err;
  const Result unknown = kvlab(
      "run " + write_experiment(dir, kSmall + "[cluster]\nreplicas = 2\nrouter = \"random\"\n"));
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.err.find("random"), std::string::npos) << unknown.err;
  EXPECT_NE(unknown.err.find("round_robin"), std::string::npos) << unknown.err;
  const Result bad_param =
      kvlab("run " + write_experiment(dir, kSmall + "[cluster]\nreplicas = 2\n"
                                                    "router = \"round_robin\"\n"
                                                    "[cluster.params]\nby = 1\n"));
  EXPECT_NE(bad_param.exit_code, 0);
  EXPECT_NE(bad_param.err.find("round_robin\" has no parameter \"by\""), std::string::npos)
      << bad_param.err;
  const Result wall = kvlab("run " + write_experiment(dir, kSmall + "[cluster]\nreplicas = 2\n") +
                            " --set experiment.clock='\"wall\"'");
  EXPECT_NE(wall.exit_code, 0);
  EXPECT_NE(wall.err.find("use the virtual, offline or measured clock"), std::string::npos)
      << wall.err;
}

TEST(KvlabMemory, TensorParallelPlansOneGpusShare) {
  // bf16 Llama-2-70B does not fit one H200; on 8 it leaves each ~108 GiB of KV.
  const Result one =
      kvlab("memory --model llama2-70b --gpu h200 --prompt-len 512 --output-len 256 --json");
  const Result eight =
      kvlab("memory --model llama2-70b --gpu h200 --prompt-len 512 --output-len 256 --tp 8 --json");
  ASSERT_EQ(one.exit_code, 0) << one.err;
  ASSERT_EQ(eight.exit_code, 0) << eight.err;
  const auto a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(eight.out);
  EXPECT_EQ(a["kv_capacity_tokens"], 0);
  EXPECT_EQ(b["tensor_parallel"], 8);
  EXPECT_EQ(b["kv_heads_per_gpu"], 1);
  EXPECT_EQ(b["kv_bytes_per_token"], 40960);
  EXPECT_GT(b["kv_capacity_tokens"].get<std::int64_t>(), 2'000'000);
  EXPECT_LT(b["weight_bytes"].get<double>(), a["weight_bytes"].get<double>() / 7.9);
  const Result text =
      kvlab("memory --model llama2-70b --gpu h200 --prompt-len 512 --output-len 256 --tp 8");
  EXPECT_NE(text.out.find("llama2-70b on 8 x h200"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("every figure below is one GPU's"), std::string::npos) << text.out;
  const Result no_gpu = kvlab("memory --model llama2-70b --seq-len 100 --tp 8");
  EXPECT_NE(no_gpu.exit_code, 0);
  EXPECT_NE(no_gpu.err.find("--tp and --cp shard a model over the GPUs of --gpu"),
            std::string::npos)
      << no_gpu.err;
  // Context parallelism: 4 groups hold 4 times one GPU's tokens, and the header says 4 GPUs.
  const Result cp = kvlab(
      "memory --model llama3.1-8b --gpu h200 --prompt-len 126195 --output-len 332 --cp 4 --json");
  const Result single =
      kvlab("memory --model llama3.1-8b --gpu h200 --prompt-len 126195 --output-len 332 --json");
  const auto cp_json = nlohmann::json::parse(cp.out), one_json = nlohmann::json::parse(single.out);
  EXPECT_EQ(cp_json["context_parallel"].get<std::int64_t>(), 4);
  EXPECT_EQ(cp_json["kv_capacity_tokens"].get<std::int64_t>(),
            4 * one_json["kv_capacity_tokens"].get<std::int64_t>());
  EXPECT_NE(kvlab("memory --model llama3.1-8b --gpu h200 --prompt-len 126195 --cp 4")
                .out.find("llama3.1-8b on 4 x h200"),
            std::string::npos);
  EXPECT_NE(kvlab("memory --model llama3.1-8b --gpu h200 --prompt-len 10 --cp 0").exit_code, 0);
  const Result odd =
      kvlab("memory --model llama2-70b --gpu h200 --prompt-len 512 --output-len 256 --tp 3");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.err.find("does not divide the 64 query heads"), std::string::npos) << odd.err;
}

TEST(KvlabSimulated, TensorParallelShortensTheStepAndNeedsTheSimulatedBackend) {
  test::TempDir dir;
  const std::string file = std::string(KVLAB_SOURCE_DIR) +
                           "/experiments/simulated_tensor_parallel.toml --set workload.requests=64 "
                           "--set workload.output_tokens='{ dist = \"fixed\", value = 128 }'";
  const Result r = kvlab("run " + file + " --out " + (dir / "o").string());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // FP8 on 1, 2, 4, 8 GPUs: each step splits its weight read and KV over more GPUs, so decode
  // steps shorten and output tok/s rises; bf16 on 8 reads twice the bytes of FP8 on 8.
  std::vector<double> tpot, throughput;
  const auto runs = nlohmann::json::parse(test::read_file(dir / "o" / "runs.json"));
  ASSERT_EQ(runs.size(), 5u);
  for (const auto& run : runs) {
    const auto s = nlohmann::json::parse(
        test::read_file(dir / "o" / run["dir"].get<std::string>() / "summary.json"));
    EXPECT_EQ(s["finished"], 64) << run;
    tpot.push_back(s["tpot_s"]["p50"].get<double>());
    throughput.push_back(s["output_tokens_per_s"].get<double>());
  }
  for (std::size_t i = 1; i < 4; ++i) {
    EXPECT_LT(tpot[i], tpot[i - 1]) << i;
    EXPECT_GT(throughput[i], throughput[i - 1]) << i;
  }
  EXPECT_GT(tpot[4], tpot[3]);
  const Result cpu = kvlab("run " + std::string(KVLAB_SOURCE_DIR) +
                           "/experiments/quickstart.toml --set backend.tensor_parallel=2 --out " +
                           (dir / "c").string());
  EXPECT_NE(cpu.exit_code, 0);
  EXPECT_NE(cpu.err.find("backend.tensor_parallel is the simulated backend's GPUs per model"),
            std::string::npos)
      << cpu.err;
  test::write_file(dir / "no_link.toml", kSmall +
                                             "[backend]\nname = \"simulated\"\nprofile = \"cpu\"\n"
                                             "tensor_parallel = 2\n");
  const Result no_link =
      kvlab("run " + (dir / "no_link.toml").string() + " --out " + (dir / "l").string());
  EXPECT_NE(no_link.exit_code, 0);
  EXPECT_NE(no_link.err.find("tensor parallelism 2 on cpu: the profile has no [interconnect]"),
            std::string::npos)
      << no_link.err;
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

TEST(KvlabCuda, TheGpuExperimentParsesAndWithoutADeviceSaysWhy) {
  test::TempDir dir;
  const Result r = kvlab("run " + std::string(KVLAB_SOURCE_DIR) +
                         "/experiments/cuda_fcfs_vs_static.toml --set 'model.name=\"tiny\"' "
                         "--set kv_cache.slots=4096 --set workload.requests=4 --out " +
                         (dir / "o").string());
  if (r.exit_code == 0) GTEST_SKIP() << "a GPU ran it";
  // The file is valid: the only complaint is the missing device (or a missing CUDA build).
  const bool no_device = r.err.find("no CUDA device") != std::string::npos;
  const bool no_plugin = r.err.find("unknown backend plugin \"cuda\"") != std::string::npos;
  EXPECT_TRUE(no_device || no_plugin) << r.err;
}

}  // namespace
}  // namespace kvlab
