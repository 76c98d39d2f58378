// The experiment library called directly, as the CLI calls it: load (strict TOML, --set, sweep
// expansion), validate every point before anything runs, run one point, write its results.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const std::filesystem::path kQuickstart =
    std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "quickstart.toml";

// quickstart, small: the tiny preset, six short requests, the build's plugins.
std::vector<std::string> small(std::vector<std::string> more = {}) {
  std::vector<std::string> overrides{
      "model.name=\"tiny\"", "workload.requests=6",
      "workload.prompt_tokens={dist=\"uniform\", min=4, max=12}",
      "workload.output_tokens={dist=\"uniform\", min=2, max=6}",
      std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"};
  more.insert(more.begin(), overrides.begin(), overrides.end());
  return more;
}

TEST(ExperimentLibrary, LoadExpandsTheSweepWithLabelsAndOverrides) {
  const auto runs = load_experiment(kQuickstart, small());
  ASSERT_EQ(runs.size(), 2u);  // [[sweep]] scheduler.name = static, fcfs
  EXPECT_EQ(runs[0].config.scheduler, "static");
  EXPECT_EQ(runs[1].config.scheduler, "fcfs");
  EXPECT_EQ(runs[1].config.label, "scheduler.name=fcfs");
  EXPECT_EQ(runs[1].config.model, "tiny");
  EXPECT_EQ(runs[1].config.workload.requests, 6);
  EXPECT_NO_THROW(validate_experiment(runs, false));
}

TEST(ExperimentLibrary, ValidateNamesTheSweepPointThatCannotRun) {
  // max_batch 0 is out of fcfs's range; static's own max_batch is untouched and fine.
  const auto runs = load_experiment(kQuickstart, small({"scheduler.params.max_batch=0"}));
  const std::string message = test::error_of<Error>([&] { validate_experiment(runs, false); });
  EXPECT_NE(message.find("max_batch"), std::string::npos) << message;
  EXPECT_NE(message.find("scheduler.name="), std::string::npos) << message;
}

TEST(ExperimentLibrary, RunChecksEveryTokenAndWritesTheResults) {
  const auto runs = load_experiment(kQuickstart, small());
  validate_experiment(runs, true);
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(runs[1].config, true, &mismatches);
  EXPECT_TRUE(mismatches.empty()) << mismatches.front();
  EXPECT_EQ(out.summary.submitted, 6);
  EXPECT_EQ(out.summary.finished + out.summary.rejected, out.summary.submitted);
  EXPECT_GT(out.summary.finished, 0);
  test::TempDir dir;
  write_run_outputs(dir.path(), runs[1].config, out);
  for (const char* file : {"requests.csv", "steps.csv", "events.jsonl", "summary.json"})
    EXPECT_TRUE(std::filesystem::exists(dir / file)) << file;
  const auto summary = nlohmann::json::parse(test::read_file(dir / "summary.json"));
  EXPECT_EQ(summary["finished"], out.summary.finished);
  EXPECT_EQ(summary["steps"], out.engine.steps.size());
}

TEST(ExperimentLibrary, SameFileSameBytes) {
  const auto runs = load_experiment(kQuickstart, small());
  test::TempDir a, b;
  write_run_outputs(a.path(), runs[1].config, run_experiment(runs[1].config, false, nullptr));
  write_run_outputs(b.path(), runs[1].config, run_experiment(runs[1].config, false, nullptr));
  for (const char* file : {"requests.csv", "steps.csv", "events.jsonl", "summary.json"})
    EXPECT_EQ(test::read_file(a / file), test::read_file(b / file)) << file;
}

// The Azure trace as a workload: its first minute on the simulated H200.
TEST(ExperimentLibrary, AzureTraceReplaysTheTracesRequests) {
  const auto file =
      std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "azure_conv_replay.toml";
  const auto runs = load_experiment(
      file,
      {"workload.azure_trace.duration_s=60", "sweep=[{key=\"scheduler.name\", values=[\"fcfs\"]}]",
       std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"});
  ASSERT_EQ(runs.size(), 1u);
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(runs[0].config, false, nullptr);
  AzureTraceOptions options;
  options.duration_s = 60;
  const auto expected =
      load_azure_trace(std::filesystem::path(KVLAB_SOURCE_DIR) / "data" /
                           "azure-llm-inference-2023" / "AzureLLMInferenceTrace_conv.csv",
                       options);
  EXPECT_EQ(out.summary.submitted, static_cast<std::int64_t>(expected.requests.size()));
  EXPECT_EQ(out.summary.finished, out.summary.submitted);
  EXPECT_NE(out.workload_description.find("clipped to the 4096-token context"), std::string::npos)
      << out.workload_description;
}

TEST(ExperimentLibrary, RealWorkloadSectionsAreChecked) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(load_error({"workload.azure_trace={start_s=1}"}).find("needs file"), std::string::npos);
  EXPECT_NE(load_error({"workload.prompts={file=\"x.jsonl\", chatt=true}"})
                .find("unknown key \"chatt\" in [workload.prompts] (did you mean \"chat\"?)"),
            std::string::npos);
  EXPECT_NE(load_error({"workload.trace=\"t.csv\"", "workload.azure_trace={file=\"a.csv\"}"})
                .find("at most one of trace"),
            std::string::npos);
  EXPECT_NE(
      load_error({"workload.azure_trace={file=\"a.csv\", rate_scale=0}"}).find("rate_scale > 0"),
      std::string::npos);
  const auto prompts =
      std::filesystem::path(KVLAB_SOURCE_DIR) / "data" / "prompts" / "mt_bench_questions.jsonl";
  EXPECT_NE(load_error({"workload.prompts={file=\"" + prompts.string() + "\"}"})
                .find("needs a real model with a tokenizer; \"tiny\" is a preset"),
            std::string::npos);
  EXPECT_NE(load_error({"workload.azure_trace={file=\"/no/such.csv\"}"}).find("is not a file"),
            std::string::npos);
}

// [backend] weights and [kv_cache] dtype: what the cpu backend multiplies in and stores K/V as.
TEST(ExperimentLibrary, WeightFormatAndKvDtypeAreCheckedAndRun) {
  auto load_error = [](std::vector<std::string> more, bool check = false) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), check); });
  };
  EXPECT_NE(load_error({"backend.weights=\"q5_k\""}).find("backend.weights must be one of stored"),
            std::string::npos);
  EXPECT_NE(load_error({"kv_cache.dtype=\"fp8\""}).find("kv_cache.dtype must be"),
            std::string::npos);
  EXPECT_NE(load_error({"kv_cache.dtype=\"f16\""}, true).find("check with kv_cache.dtype"),
            std::string::npos);
  EXPECT_NE(load_error({"backend.weights=\"q4_0\""}, true).find("rounds them first"),
            std::string::npos);
  const auto runs =
      load_experiment(kQuickstart, small({"backend.weights=\"q8_0\"", "kv_cache.dtype=\"bf16\""}));
  EXPECT_EQ(runs[1].config.cpu_weights, "q8_0");
  EXPECT_EQ(runs[1].config.kv_dtype, DType::dtype_bf16);
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(runs[1].config, false, nullptr);
  EXPECT_EQ(out.summary.finished + out.summary.rejected, out.summary.submitted);
  EXPECT_GT(out.summary.finished, 0);
}

}  // namespace
}  // namespace kvlab
