// Correctness on a real trained model: SmolLM2-135M-Instruct (Q4_1 GGUF, scripts/get_model.sh
// smollm2). kvlab's forward over 320 positions of real chat text agrees with transformers
// reading the same file (tests/fixtures/real/make_smollm2_fixture.py). Skips with the reason
// when the model could not be fetched (the ctest setup models.get_smollm2 runs the script).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

const std::filesystem::path kModel = std::filesystem::path(KVLAB_SOURCE_DIR) / "models" /
                                     "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf";

// Tolerances: |delta logprob| <= 1e-3 at every position for transformers' argmax token and for
// the next prompt token (fp32 both sides; what is left is summation order over 30 layers), and
// the same argmax wherever transformers' top token leads by more than 1e-3.
TEST(RealModel, SmolLm2LogitsAgreeWithTransformersOverTheSameFile) {
  if (!std::filesystem::exists(kModel))
    GTEST_SKIP() << kModel << " is not here: scripts/get_model.sh smollm2 could not fetch it "
                 << "(its output is in the models.get_smollm2 test)";
  const auto fixture = nlohmann::json::parse(
      test::read_file(std::filesystem::path(KVLAB_FIXTURES_DIR) / "real" / "smollm2_logits.json"));
  const auto prompt = fixture["prompt"].get<std::vector<std::int32_t>>();
  const auto argmax = fixture["argmax"].get<std::vector<std::int32_t>>();
  const auto argmax_logprob = fixture["argmax_logprob"].get<std::vector<double>>();
  const auto next_logprob = fixture["next_logprob"].get<std::vector<double>>();
  const ReferenceModel model(load_llama_weights(kModel));
  EXPECT_EQ(model.config().num_hidden_layers, 30);
  EXPECT_TRUE(model.config().tie_word_embeddings);
  const RowMatrix logits = model.forward(prompt);  // (positions, vocab)
  double worst = 0;
  int same_argmax = 0, decided = 0;
  for (std::size_t t = 0; t < prompt.size(); ++t) {
    const auto row = logits.row(static_cast<Eigen::Index>(t));
    ASSERT_TRUE(row.allFinite()) << t;
    const double max = row.maxCoeff();
    const double log_sum = max + std::log((row.array() - static_cast<float>(max)).exp().sum());
    auto logprob = [&](std::int32_t token) { return static_cast<double>(row(token)) - log_sum; };
    worst = std::max(worst, std::abs(logprob(argmax[t]) - argmax_logprob[t]));
    if (t + 1 < prompt.size())
      worst = std::max(worst, std::abs(logprob(prompt[t + 1]) - next_logprob[t]));
    Eigen::Index kvlab_argmax = 0;
    row.maxCoeff(&kvlab_argmax);
    if (max - row(argmax[t]) < 1e-3 && kvlab_argmax != argmax[t]) continue;  // a near-tie
    ++decided;
    same_argmax += kvlab_argmax == argmax[t];
  }
  RecordProperty("max_abs_delta_logprob", std::to_string(worst));
  RecordProperty("argmax_agreement", fmt::format("{}/{}", same_argmax, prompt.size()));
  EXPECT_EQ(prompt.size(), 320u);
  EXPECT_LT(worst, 1e-3);
  EXPECT_EQ(same_argmax, decided);
  EXPECT_GE(decided, 300);
}

}  // namespace
}  // namespace kvlab::cpu
