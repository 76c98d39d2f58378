#include <gtest/gtest.h>

#include "kvlab/error.hpp"
#include "kvlab/kv_memory.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

constexpr std::int64_t GiB = 1LL << 30;

KvMemoryReport seed_row(const char* preset, std::optional<std::int64_t> kv_heads = std::nullopt) {
  KvMemoryQuery q;
  q.seq_len = 2048;
  q.batch = 1;
  q.kv_dtype = DType::dtype_f16;
  q.kv_heads = kv_heads;
  return kv_memory(model_preset(preset), q);
}

// The seed note's table, with the arithmetic done right.
TEST(KvMemory, SeedTableLlama7bIsOneGiB) {
  const auto r = seed_row("llama-7b");
  EXPECT_EQ(r.bytes_per_token, 2 * 32 * 32 * 128 * 2);  // 512 KiB
  EXPECT_EQ(r.bytes_per_request, GiB);                  // not "~512 MB"
  EXPECT_EQ(r.bytes_total, GiB);
}

TEST(KvMemory, SeedTableLlama13bAndLlama65b) {
  EXPECT_EQ(seed_row("llama-13b").bytes_per_request, 2LL * 40 * 40 * 2048 * 128 * 2);  // 1.5625 GiB
  EXPECT_DOUBLE_EQ(static_cast<double>(seed_row("llama-13b").bytes_per_request) / GiB, 1.5625);
  // LLaMA-65B has 64 heads (the seed says 80): 5 GiB.
  EXPECT_EQ(seed_row("llama-65b").bytes_per_request, 5 * GiB);
}

TEST(KvMemory, GqaAndMqaRatios) {
  const auto mha = seed_row("llama-7b");
  EXPECT_EQ(seed_row("llama-7b", 8).bytes_per_request * 4, mha.bytes_per_request);   // 0.25x
  EXPECT_EQ(seed_row("llama-7b", 1).bytes_per_request * 32, mha.bytes_per_request);  // 1/32x
  // Llama 2 70B ships with 8 of 64 KV heads: 80 layers x 8 x 128 x 2 x 2 B = 320 KiB per token.
  EXPECT_EQ(seed_row("llama2-70b").bytes_per_token, 327680);
}

TEST(KvMemory, BatchScalesLinearly) {
  KvMemoryQuery q;
  q.seq_len = 1000;
  q.batch = 7;
  q.kv_dtype = DType::dtype_f32;
  const auto r = kv_memory(model_preset("stories15m"), q);
  EXPECT_EQ(r.bytes_per_token, 2 * 6 * 6 * 48 * 4);
  EXPECT_EQ(r.bytes_total, r.bytes_per_token * 1000 * 7);
}

TEST(KvMemory, MaxBatchNextToTheWeights) {
  KvMemoryQuery q;
  q.seq_len = 2048;
  q.gpu_memory_gib = 80;
  const auto r = kv_memory(model_preset("llama-7b"), q);
  EXPECT_EQ(r.weight_bytes, 6'738'415'616LL * 2);
  // floor((80 GiB - 12.55 GiB) / 1 GiB) = 67
  EXPECT_EQ(r.max_batch, (80 * GiB - r.weight_bytes) / GiB);
  EXPECT_EQ(r.max_batch, 67);
  q.gpu_memory_gib = 12;  // weights alone do not fit
  EXPECT_EQ(kv_memory(model_preset("llama-7b"), q).max_batch, 0);
  q.gpu_memory_gib.reset();
  EXPECT_FALSE(kv_memory(model_preset("llama-7b"), q).max_batch.has_value());
}

TEST(KvMemory, BadQueries) {
  KvMemoryQuery q;
  q.seq_len = 0;
  EXPECT_NE(test::error_of<Error>([&] { kv_memory(model_preset("llama-7b"), q); }).find("seq-len"),
            std::string::npos);
  q.seq_len = 10;
  q.kv_heads = 5;
  EXPECT_NE(
      test::error_of<Error>([&] { kv_memory(model_preset("llama-7b"), q); }).find("kv-heads 5"),
      std::string::npos);
}

}  // namespace
}  // namespace kvlab
