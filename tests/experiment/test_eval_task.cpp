// kvlab eval's retrieval task (kvlab/experiment/eval_task.hpp): each prompt is the task's
// header, filler cut at the depth, the key's sentence, the rest of the filler and the question,
// as long in tokens as the grid says; answers are right when they contain the key; cells count
// per (length, depth); [eval] in an experiment file is read and checked. A tokenizer of one token
// per byte makes the lengths and depths exact to check.
#include <gtest/gtest.h>

#include <string>

#include "kvlab/error.hpp"
#include "kvlab/experiment/eval_task.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<std::int32_t> encode(std::string_view text) const override {
    return {text.begin(), text.end()};
  }
  std::string decode(std::span<const std::int32_t> ids) const override {
    return {ids.begin(), ids.end()};
  }
  std::int32_t vocab_size() const override { return 256; }
  std::string description() const override { return "bytes"; }
  std::optional<std::int32_t> token_id(std::string_view) const override { return std::nullopt; }
};

std::string filler_text() {  // lines of filler, no digits (a key is the only number)
  std::string text;
  for (int i = 0; i < 400; ++i) text += "The quick brown fox jumps over the lazy dog again.\n";
  return text;
}

TEST(EvalTask, PromptsHaveTheirLengthAndTheKeyAtTheirDepth) {
  EvalSpec spec;
  spec.task = "passkey";
  spec.lengths = {400, 800};
  spec.depths = {0.0, 0.5, 1.0};
  spec.samples = 2;
  const ByteTokenizer tokenizer;
  const std::string filler = filler_text();
  const std::vector<EvalPrompt> prompts = make_eval_prompts(spec, filler, tokenizer, 3);
  ASSERT_EQ(prompts.size(), 12u);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const EvalPrompt& p = prompts[i];
    SCOPED_TRACE(i);
    EXPECT_EQ(p.length, spec.lengths[i / 6]);
    EXPECT_EQ(p.depth, spec.depths[i / 2 % 3]);
    EXPECT_EQ(p.tokens, p.length);  // one token a byte: exact
    ASSERT_EQ(p.key.size(), 5u);
    const std::size_t needle = p.text.find(" The pass key is " + p.key);
    const std::size_t body = p.text.find("\n\n") + 2, question = p.text.rfind("\n\nWhat is");
    ASSERT_NE(needle, std::string::npos);
    ASSERT_NE(question, std::string::npos);
    const std::size_t sentence = p.text.find(p.key + " is the pass key. ") + p.key.size() + 18;
    const double before = static_cast<double>(needle - body);
    const double filler_chars = before + static_cast<double>(question - sentence);
    EXPECT_NEAR(before / filler_chars, p.depth, 1.0 / filler_chars);
  }
  EXPECT_NE(prompts[0].key, prompts[1].key);  // samples differ
  spec.task = "needle";
  const std::vector<EvalPrompt> needles = make_eval_prompts(spec, filler, tokenizer, 3);
  EXPECT_NE(needles[0].text.find("special magic number"), std::string::npos);
  EXPECT_EQ(needles[0].key.size(), 7u);
  spec.lengths = {120};  // the task's own text is longer
  test::expect_error_containing([&] { (void)make_eval_prompts(spec, filler, tokenizer, 3); },
                                {"eval length 120 leaves no room"});
  spec.lengths = {100000};
  test::expect_error_containing([&] { (void)make_eval_prompts(spec, filler, tokenizer, 3); },
                                {"filler has", "characters"});
}

TEST(EvalTask, AnswersAreRightWhenTheyHoldTheKeyAndCellsCountThem) {
  EXPECT_TRUE(eval_answer_correct(" 77894. Remember", "77894"));
  EXPECT_FALSE(eval_answer_correct(" 7789", "77894"));
  EXPECT_FALSE(eval_answer_correct(" a key that is used", "77894"));
  EXPECT_FALSE(eval_answer_correct("anything", ""));
  EvalSpec spec;
  spec.lengths = {256, 512};
  spec.depths = {0.0, 1.0};
  spec.samples = 2;
  std::vector<EvalPrompt> prompts(8);
  for (std::size_t i = 0; i < prompts.size(); ++i) prompts[i].key = std::to_string(10000 + i);
  std::vector<std::string> answers(8, "no");
  answers[0] = "10000";
  answers[1] = "10001.";
  answers[7] = " 10007";
  const std::vector<EvalCell> cells = score_eval(spec, prompts, answers);
  ASSERT_EQ(cells.size(), 4u);
  EXPECT_EQ(cells[0].correct, 2);
  EXPECT_EQ(cells[1].correct, 0);
  EXPECT_EQ(cells[3].length, 512);
  EXPECT_EQ(cells[3].depth, 1.0);
  EXPECT_DOUBLE_EQ(cells[3].accuracy(), 0.5);
  answers.pop_back();
  EXPECT_THROW((void)score_eval(spec, prompts, answers), Error);
}

TEST(EvalTask, TheEvalTableIsReadAndCheckedFromTheExperimentFile) {
  const test::TempDir dir;
  const std::string base = "[model]\nname = \"tiny\"\n[eval]\nfiller = \"wiki.txt\"\n";
  test::write_file(dir / "e.toml",
                   base + "lengths = [256, 512]\ndepths = [0.0, 0.5]\nsamples = 3\n");
  const ExperimentConfig c = load_experiment(dir / "e.toml", {}).front().config;
  EXPECT_EQ(c.eval.task, "passkey");
  EXPECT_EQ(c.eval.filler, (dir / "wiki.txt").string());  // next to the file
  EXPECT_EQ(c.eval.lengths, (std::vector<std::int64_t>{256, 512}));
  EXPECT_EQ(c.eval.depths, (std::vector<double>{0.0, 0.5}));
  EXPECT_EQ(c.eval.samples, 3);
  const std::pair<std::string, std::string> bad[] = {
      {"lengths = [256]\ndepths = [1.5]\n", "eval.depths: each must be a number in [0, 1]"},
      {"lengths = [25.5]\ndepths = [0.5]\n", "eval.lengths: each must be an integer"},
      {"depths = [0.5]\n", "needs lengths"},
      {"lengths = [256]\ndepths = [0.5]\ntask = \"quiz\"\n", "not passkey or needle"},
      {"lengths = [256]\ndepths = [0.5]\nneedle = 1\n", "unknown key \"needle\" in [eval]"},
  };
  for (const auto& [text, message] : bad) {
    test::write_file(dir / "bad.toml", base + text);
    test::expect_error_containing([&] { (void)load_experiment(dir / "bad.toml", {}); }, {message});
  }
}

}  // namespace
}  // namespace kvlab
