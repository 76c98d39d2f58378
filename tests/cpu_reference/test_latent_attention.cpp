// Latent attention (MLA, DeepSeek-V2/V3): the reference rebuilds every head's K and V from the
// latent (the plain form); the cpu backend reads the cached latent with W_uk and W_uv absorbed
// into the query and the output. The two must give the same logits through a scattered cache,
// in chunks and in decodes beside another sequence's prefill; the cache must hold the latent
// (normed) and the shared RoPE key, and nothing else.
#include <gtest/gtest.h>

#include "cache_walk.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "test_models.hpp"

namespace kvlab::cpu {
namespace {

TEST(LatentAttention, TheAbsorbedDecodeOfTheCacheEqualsThePlainReference) {
  const LlamaWeights weights = test::scaled_random_weights(model_preset("mla-tiny"), 7);
  const ModelConfig& c = weights.config;
  ASSERT_TRUE(c.is_mla());
  const test::CacheWalk walk{ReferenceModel(weights)};
  for (const DType dtype : {DType::dtype_f32, DType::dtype_bf16}) {
    KvPool pool({c.num_hidden_layers, c.cache_kv_heads(), c.cache_head_dim(), 256, dtype});
    CpuBackend backend(weights, pool, std::nullopt);
    const double worst = walk.worst_delta(backend);
    // fp32: the same sums in another order (2.2e-5 measured); bf16: the latent rounded to 8 bits
    // of mantissa (0.10 measured, on logits of O(10)).
    if (dtype == DType::dtype_f32)
      EXPECT_LT(worst, 1e-4) << "the absorbed form must equal the plain one";
    else
      EXPECT_LT(worst, 0.25) << "a bf16 latent rounds, but stays the same attention";
    EXPECT_GT((walk.expected.row(34) - walk.expected.row(33)).cwiseAbs().maxCoeff(), 0.5)
        << "positions must differ, or the comparison above says nothing";
  }
}

TEST(LatentAttention, TheCacheHoldsTheNormedLatentAndTheRotatedSharedKey) {
  const LlamaWeights weights = test::scaled_random_weights(model_preset("mla-tiny"), 3);
  const ModelConfig& c = weights.config;
  ASSERT_EQ(c.cache_kv_heads(), 1);
  ASSERT_EQ(c.cache_head_dim() * 2, c.kv_lora_rank + c.qk_rope_head_dim);
  KvPool pool({c.num_hidden_layers, c.cache_kv_heads(), c.cache_head_dim(), 8});
  EXPECT_EQ(pool.bytes_per_slot(), c.num_hidden_layers * c.latent_dim() * 4)
      << "a slot holds the latent and the RoPE key of every layer, in fp32";
  CpuBackend backend(weights, pool, std::nullopt);
  const std::vector<std::int32_t> tokens{17, 4};
  const BatchEntry entry{tokens, 0, KvView{{{5, 2}}, 0, {}}};
  (void)backend.run({&entry, 1});
  // Layer 0 of token 1 (position 1) by the definition: c = RMSNorm(W_kv_a x)[:rank] with
  // kv_a_norm, k_r = RoPE(W_kv_a x [rank:]) at position 1.
  const LayerWeights& layer = weights.layers[0];
  RowMatrix x = weights.embedding.row(tokens[1]), normed;
  rms_norm(x, layer.attention_norm, static_cast<float>(c.rms_norm_eps), normed);
  RowMatrix projected = normed * layer.w_kv_a().transpose();  // (1, latent_dim)
  RowMatrix latent = projected.leftCols(c.kv_lora_rank),
            key = projected.rightCols(c.qk_rope_head_dim);
  rms_norm(latent, layer.kv_a_norm, static_cast<float>(c.rms_norm_eps), latent);
  const std::vector<std::int32_t> position{1};
  RopeTable(c).apply(key, position, 1);
  std::vector<float> cached(static_cast<std::size_t>(c.latent_dim()));
  pool.read_row(0, 6, false, cached.data());
  pool.read_row(0, 6, true, cached.data() + c.cache_head_dim());
  for (std::int64_t i = 0; i < c.latent_dim(); ++i) {
    const float want = i < c.kv_lora_rank ? latent(0, i) : key(0, i - c.kv_lora_rank);
    EXPECT_NEAR(cached[static_cast<std::size_t>(i)], want, 1e-4f) << "value " << i;
  }
}

TEST(LatentAttention, APoolOfPerHeadKAndVIsRefused) {
  const LlamaWeights weights = random_llama_weights(model_preset("mla-tiny"), 1);
  const ModelConfig& c = weights.config;
  KvPool per_head({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 8});
  EXPECT_THROW(CpuBackend(weights, per_head, std::nullopt), Error);
  KvPool latent({c.num_hidden_layers, c.cache_kv_heads(), c.cache_head_dim(), 8});
  EXPECT_NO_THROW(CpuBackend(weights, latent, std::nullopt));
}

}  // namespace
}  // namespace kvlab::cpu
