// Rung 4 of the correctness ladder: checkpoints saved by Hugging Face transformers load, and
// the reference reproduces transformers' own logits (tests/fixtures/hf/make_fixture.py).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "test_util.hpp"

namespace kvlab::cpu {
namespace {

class HfInterop : public ::testing::TestWithParam<const char*> {};

TEST_P(HfInterop, LogitsMatchTransformers) {
  const std::filesystem::path folder =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / "hf" / GetParam();
  const auto fixture = nlohmann::json::parse(test::read_file(folder / "logits.json"));
  const auto prompt = fixture["prompt"].get<std::vector<std::int32_t>>();
  const auto expected = fixture["logits"].get<std::vector<std::vector<float>>>();

  const ReferenceModel model(load_llama_weights(folder));
  const RowMatrix logits = model.forward(prompt);
  ASSERT_EQ(logits.rows(), static_cast<Eigen::Index>(expected.size()));
  ASSERT_EQ(logits.cols(), static_cast<Eigen::Index>(expected[0].size()));
  test::Closeness worst;
  for (std::size_t t = 0; t < expected.size(); ++t) {
    const auto c =
        test::compare(std::span<const float>(logits.row(static_cast<Eigen::Index>(t)).data(),
                                             static_cast<std::size_t>(logits.cols())),
                      expected[t]);
    worst.max_abs = std::max(worst.max_abs, c.max_abs);
    worst.max_rel = std::max(worst.max_rel, c.max_rel);
    worst.has_nan |= c.has_nan;
  }
  RecordProperty("max_abs_error", std::to_string(worst.max_abs));
  EXPECT_FALSE(worst.has_nan);
  EXPECT_LT(worst.max_abs, 1e-4) << "max rel " << worst.max_rel << " (transformers "
                                 << fixture["made_by"]["transformers"] << ")";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfInterop,
                         ::testing::Values("tiny_llama_gqa", "tiny_llama_sharded"));

}  // namespace
}  // namespace kvlab::cpu
