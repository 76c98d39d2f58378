// The CPU backend over a 16-bit KV pool: the same model with K and V rounded to f16 or bf16 on
// write. Logits move by an amount the rounding explains, no more; prefill chunks and decode
// steps read the pool the same way.
#include <gtest/gtest.h>

#include <cmath>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"

namespace kvlab::cpu {
namespace {

// A prefill of `prompt` in two chunks, then 6 decode steps of fixed tokens; every step's
// last-token logits, concatenated.
std::vector<float> run_steps(const LlamaWeights& weights, DType dtype) {
  const ModelConfig& c = weights.config;
  const std::vector<std::int32_t> tokens{1, 5, 9, 200, 3, 77, 12, 8, 40, 41, 42, 43, 44, 45};
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, dtype});
  CpuBackend backend(weights, pool, std::nullopt);
  std::vector<float> logits;
  auto step = [&](std::int64_t begin, std::int64_t end) {
    const std::span<const std::int32_t> chunk(tokens.data() + begin,
                                              static_cast<std::size_t>(end - begin));
    const BatchEntry entry{chunk, begin, KvView{{{0, end}}, 0, {}}};
    const RowMatrix& out = backend.run({&entry, 1});
    logits.insert(logits.end(), out.data(), out.data() + out.size());
  };
  step(0, 5);
  step(5, 8);
  for (std::int64_t p = 8; p < static_cast<std::int64_t>(tokens.size()); ++p) step(p, p + 1);
  return logits;
}

// Stated tolerance: K and V carry a relative rounding error of 2^-11 (f16) or 2^-8 (bf16); the
// tiny model's logits (|logit| < 1) then move by a few such units, never by 0.05 of their range.
TEST(KvDtype, HalfPoolsMoveLogitsByTheirRoundingOnly) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 3);
  const std::vector<float> exact = run_steps(weights, DType::dtype_f32);
  float range = 0;
  for (float v : exact) range = std::max(range, std::abs(v));
  for (const auto& [dtype, unit] :
       {std::pair{DType::dtype_f16, 0x1p-11f}, std::pair{DType::dtype_bf16, 0x1p-8f}}) {
    const std::vector<float> rounded = run_steps(weights, dtype);
    ASSERT_EQ(rounded.size(), exact.size());
    float worst = 0;
    for (std::size_t i = 0; i < exact.size(); ++i)
      worst = std::max(worst, std::abs(rounded[i] - exact[i]));
    RecordProperty(std::string("max_abs_delta_") + std::string(dtype_short_name(dtype)),
                   std::to_string(worst));
    EXPECT_GT(worst, 0.0f) << "the pool did not round";
    EXPECT_LT(worst, 64 * unit * range) << dtype_short_name(dtype) << ": " << worst;
  }
}

}  // namespace
}  // namespace kvlab::cpu
