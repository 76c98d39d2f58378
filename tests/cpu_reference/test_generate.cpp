#include <gtest/gtest.h>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

class Generate : public ::testing::Test {
 protected:
  Generate() : model_(random_llama_weights(model_preset("tiny"), 21)) {}
  std::vector<std::int32_t> tokens(const GenerationResult& r) {
    std::vector<std::int32_t> out;
    for (const auto& t : r.tokens) out.push_back(t.token);
    return out;
  }
  ReferenceModel model_;
  std::vector<std::int32_t> prompt_{1, 30, 31, 32};
};

TEST_F(Generate, GreedyIsArgmaxOfTheFullRecompute) {
  SamplingParams p;
  p.max_tokens = 8;
  p.ignore_eos = true;
  const auto result = generate(model_, prompt_, p, 3);
  ASSERT_EQ(result.tokens.size(), 8u);
  EXPECT_EQ(result.finish_reason, FinishReason::max_tokens);
  std::vector<std::int32_t> sequence = prompt_;
  for (const auto& generated : result.tokens) {
    const RowMatrix logits = model_.forward(sequence);
    Eigen::Index argmax = 0;
    logits.row(logits.rows() - 1).maxCoeff(&argmax);
    EXPECT_EQ(generated.token, argmax);
    ASSERT_EQ(generated.top.size(), 3u);
    EXPECT_EQ(generated.top[0].token, generated.token);
    EXPECT_FLOAT_EQ(generated.top[0].logprob, generated.logprob);
    EXPECT_LE(generated.logprob, 0.0f);
    sequence.push_back(generated.token);
  }
}

TEST_F(Generate, StopsAtEos) {
  SamplingParams p;
  p.max_tokens = 6;
  p.ignore_eos = true;
  const auto free_run = tokens(generate(model_, prompt_, p));
  // Declare the third greedy token to be EOS: generation must stop right after emitting it.
  LlamaWeights w = random_llama_weights(model_preset("tiny"), 21);
  w.config.eos_token_ids = {free_run[2]};
  const ReferenceModel with_eos(std::move(w));
  p.ignore_eos = false;
  const auto result = generate(with_eos, prompt_, p);
  EXPECT_EQ(result.finish_reason, FinishReason::eos);
  const auto stopped = tokens(result);
  const auto first_eos =
      std::find(free_run.begin(), free_run.end(), free_run[2]) - free_run.begin();
  EXPECT_EQ(stopped, std::vector<std::int32_t>(free_run.begin(), free_run.begin() + first_eos + 1));
}

TEST_F(Generate, StopsWhenTheContextIsFull) {
  SamplingParams p;
  p.max_tokens = 100;
  p.ignore_eos = true;
  std::vector<std::int32_t> long_prompt(510, 7);
  const auto result = generate(model_, long_prompt, p);
  EXPECT_EQ(result.finish_reason, FinishReason::context_full);
  EXPECT_EQ(result.tokens.size(), 2u);  // 510 + 2 = 512 positions
}

TEST_F(Generate, SeededSamplingIsReproducible) {
  SamplingParams p;
  p.temperature = 1.2;
  p.top_p = 0.95;
  p.max_tokens = 12;
  p.ignore_eos = true;
  p.seed = 5;
  const auto a = tokens(generate(model_, prompt_, p));
  const auto b = tokens(generate(model_, prompt_, p));
  EXPECT_EQ(a, b);
  p.seed = 6;
  EXPECT_NE(a, tokens(generate(model_, prompt_, p)));
}

}  // namespace
}  // namespace kvlab::cpu
