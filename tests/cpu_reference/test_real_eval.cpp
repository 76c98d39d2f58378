// Lessons on answers, not perplexity (kvlab eval, experiments/kv_retrieval.toml): SmolLM2-135M
// finds a passkey hidden in 512 tokens of WikiText-2 with its full cache; under a budget of 128
// positions a head, the plain window and StreamingLLM lose it once it sits outside their recent
// positions (StreamingLLM's perplexity is fine: KvEvictionLesson), while SnapKV compressing the
// prompt once with the question in its observation window keeps it. 8 prompts (depths 0.25 and
// 0.5, 4 keys each), greedy answers through the engine, exact match.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <map>

#include "kvlab/experiment/eval_task.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const std::filesystem::path kSource(KVLAB_SOURCE_DIR);
const std::filesystem::path kSmolLm2 =
    kSource / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf";

class RetrievalLesson : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(kSmolLm2)) return;
    const std::vector<std::string> set = {"eval.lengths=[512]", "eval.depths=[0.25, 0.5]",
                                          "eval.samples=4"};
    const std::vector<ExperimentRun> runs =
        load_experiment(kSource / "experiments" / "kv_retrieval.toml", set);
    const test::TempDir dir;
    const std::vector<EvalPrompt> prompts =
        write_eval_prompts(runs.front().config, dir / "prompts.jsonl");
    const std::map<std::size_t, std::string> points = {
        {0, "full"}, {1, "window"}, {2, "streaming_llm"}, {4, "snapkv one shot"}};
    for (const auto& [index, name] : points) {
      const ExperimentConfig c = eval_serving_config(runs.at(index).config, dir / "prompts.jsonl");
      const RunOutput out = run_experiment(c, false, nullptr);
      std::int64_t right = 0;
      for (const EvalCell& cell : score_eval(c.eval, prompts, out.answer_texts))
        right += cell.correct;
      correct()[name] = right;
      std::cout << name << ": " << right << "/" << prompts.size() << " keys found\n";
    }
  }
  static std::map<std::string, std::int64_t>& correct() {
    static std::map<std::string, std::int64_t> c;
    return c;
  }
  void SetUp() override {
    if (!std::filesystem::exists(kSmolLm2))
      GTEST_SKIP() << kSmolLm2 << " is not here: scripts/get_model.sh smollm2 could not fetch it";
  }
};

// The task is within the model: with every position kept it finds at least 6 keys of 8.
TEST_F(RetrievalLesson, TheFullCacheFindsThePasskey) {
  EXPECT_GE(correct().at("full"), 6);
}

// A window of the newest 128 positions, and StreamingLLM's 4 sinks beside it, hold the question
// but not the key 256-384 tokens before it: at most one of 8 found (a lucky guess of 5 digits
// is not one), where the full cache finds 6 or more.
TEST_F(RetrievalLesson, RecentPositionsLoseTheKeyOutsideTheirWindow) {
  EXPECT_LE(correct().at("window"), 1);
  EXPECT_LE(correct().at("streaming_llm"), 1);
}

// SnapKV's one-shot compression of the prompt, its observation window the prompt's last 32
// tokens (the question), keeps the positions the question attends to: at least 4 keys of 8, 3
// more than StreamingLLM at the same budget.
TEST_F(RetrievalLesson, SnapKvWithTheQuestionInItsWindowKeepsTheKey) {
  EXPECT_GE(correct().at("snapkv one shot"), 4);
  EXPECT_GE(correct().at("snapkv one shot"), correct().at("streaming_llm") + 3);
}

}  // namespace
}  // namespace kvlab
