#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "kvlab/eigen_core.hpp"

#include "kvlab/error.hpp"
#include "kvlab/kv_pool.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/hardware_profile.hpp"
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
  q.seq_len = std::numeric_limits<std::int64_t>::max();  // used to print a negative size
  EXPECT_NE(test::error_of<Error>([&] {
              kv_memory(model_preset("llama-7b"), q);
            }).find("more bytes than 64 bits can count"),
            std::string::npos);
  q.seq_len = 4096;
  q.batch = std::int64_t{1} << 50;
  EXPECT_NE(test::error_of<Error>([&] {
              kv_memory(model_preset("llama-7b"), q);
            }).find("more bytes than 64 bits can count"),
            std::string::npos);
  q.batch = 1;
  q.seq_len = 10;
  q.kv_heads = 5;
  EXPECT_NE(
      test::error_of<Error>([&] { kv_memory(model_preset("llama-7b"), q); }).find("kv-heads 5"),
      std::string::npos);
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// The seed's sizing example: a 7B model in fp16 on a 40 GB card, the rest for KV.
HardwareProfile card_40gib() {
  HardwareProfile p;
  p.name = "40gib";
  p.peak_tflops = 1;
  p.memory_gb_per_s = 1;
  p.memory_gib = 40;
  p.memory_utilization = 1.0;
  p.activation_reserve_gib = 0;
  return p;
}

TEST(MemoryPlanner, SeedSevenBillionOnFortyGiBByHand) {
  MemoryPlanQuery q;
  q.prompt_tokens = 512;
  q.output_tokens = 256;
  q.weight_dtype = DType::dtype_f16;
  q.kv_dtype = DType::dtype_f16;
  const MemoryPlan p = plan_memory(model_preset("llama-7b"), card_40gib(), q);
  const double gib = 1024.0 * 1024 * 1024;
  // Weights: 6,738,415,616 x 2 B = 12.55 GiB (the seed's "about 20 GB" overstates it).
  EXPECT_DOUBLE_EQ(p.weight_bytes, 6'738'415'616.0 * 2);
  EXPECT_DOUBLE_EQ(p.kv_budget_bytes, 40 * gib - 6'738'415'616.0 * 2);
  EXPECT_EQ(p.kv_bytes_per_token, 524'288);  // 2 x 32 x 32 x 128 x 2 B
  const auto tokens = static_cast<std::int64_t>((40 * gib - 6'738'415'616.0 * 2) / 524'288);
  EXPECT_EQ(p.kv_capacity_tokens, tokens);  // 56,220 tokens
  // Static reserves the 2048-token context (1 GiB each): 27 requests; paged holds 768 tokens.
  EXPECT_EQ(p.static_tokens_per_request, 2048);
  EXPECT_EQ(p.max_static_requests, tokens / 2048);
  EXPECT_EQ(p.max_static_requests, 27);
  EXPECT_EQ(p.paged_tokens_per_request, 768);
  EXPECT_EQ(p.max_paged_requests, tokens / 16 * 16 / 768);
  EXPECT_EQ(p.max_paged_requests, 73);
}

TEST(MemoryPlanner, GqaAndMqaMultiplyTheCapacityAndBlocksRoundUp) {
  MemoryPlanQuery q;
  q.prompt_tokens = 100;
  q.output_tokens = 1;  // 101 tokens -> 7 blocks of 16 = 112
  const ModelConfig llama70 = model_preset("llama2-70b");
  const HardwareProfile h200 = load_hardware_profile("h200");
  const MemoryPlan gqa = plan_memory(llama70, h200, q);
  EXPECT_EQ(gqa.kv_heads, 8);
  EXPECT_EQ(gqa.paged_tokens_per_request, 112);
  q.kv_heads = 1;
  const MemoryPlan mqa = plan_memory(llama70, h200, q);
  EXPECT_EQ(mqa.kv_bytes_per_token * 8, gqa.kv_bytes_per_token);
  EXPECT_NEAR(static_cast<double>(mqa.kv_capacity_tokens),
              8.0 * static_cast<double>(gqa.kv_capacity_tokens), 8.0);
  // bf16 Llama-2-70B (138 GB) exceeds one H200's usable 126 GiB: nothing fits.
  EXPECT_EQ(gqa.kv_capacity_tokens, 0);
  EXPECT_EQ(gqa.max_static_requests, 0);
}

TEST(MemoryPlanner, TensorParallelShardsWeightsAndKvHeadsPerGpu) {
  MemoryPlanQuery q;
  q.prompt_tokens = 512;
  q.output_tokens = 256;
  q.tensor_parallel = 8;
  const ModelConfig llama70 = model_preset("llama2-70b");  // 64 query heads, 8 K/V heads
  const MemoryPlan p = plan_memory(llama70, load_hardware_profile("h200"), q);
  EXPECT_EQ(p.tensor_parallel, 8);
  EXPECT_EQ(p.kv_heads_per_gpu, 1);
  EXPECT_EQ(p.kv_bytes_per_token, 2 * 80 * 1 * 128 * 2);  // 40 KiB: one K/V head per GPU
  // Weights: everything split 8 ways but the norms (2 x 80 + 1 vectors of 8192), whole on each.
  const double norms = (2 * 80 + 1) * 8192.0;
  const double split = static_cast<double>(llama70.parameter_count()) - norms;
  EXPECT_NEAR(p.weight_bytes, (split / 8 + norms) * 2, 1.0);
  const double gib = 1024.0 * 1024 * 1024;
  EXPECT_NEAR(p.kv_budget_bytes, 140 * 0.9 * gib - p.weight_bytes - 2 * gib, 1.0);
  EXPECT_EQ(p.kv_capacity_tokens, static_cast<std::int64_t>(p.kv_budget_bytes / (40 * 1024)));
  // Replicated K/V heads: MQA on 8 GPUs keeps its one head on every GPU, no less.
  q.kv_heads = 1;
  EXPECT_EQ(plan_memory(llama70, load_hardware_profile("h200"), q).kv_bytes_per_token,
            p.kv_bytes_per_token);
  q.kv_heads = std::nullopt;
  q.tensor_parallel = 3;
  test::expect_error_containing([&] { plan_memory(llama70, load_hardware_profile("h200"), q); },
                                {"tensor parallelism 3 does not divide the 64 query heads"});
  q.tensor_parallel = 0;
  test::expect_error_containing([&] { plan_memory(llama70, load_hardware_profile("h200"), q); },
                                {"tensor parallelism must be >= 1 GPU, got 0"});
}

// Latent attention caches (kv_lora_rank + qk_rope_head_dim) values a token a layer: DeepSeek-V3's
// 70,272 B in bf16 (61 x 576 x 2), against 4 MB for its 128 heads as plain K/V of 128 values
// (the DeepSeek-V2 paper's comparison). Under tensor parallelism every GPU keeps the whole latent:
// GQA-8 on 8 GPUs holds less a GPU than MLA (why SGLang runs DeepSeek with data-parallel
// attention).
TEST(KvMemory, LatentAttentionCachesTheLatentAndTheRopeKeyOnly) {
  const ModelConfig v3 = model_preset("deepseek-v3");
  KvMemoryQuery q;
  q.seq_len = 32768;
  q.kv_dtype = DType::dtype_bf16;
  const KvMemoryReport latent = kv_memory(v3, q);
  EXPECT_EQ(latent.bytes_per_token, 61 * 576 * 2);
  EXPECT_EQ(latent.bytes_per_request, 61LL * 576 * 2 * 32768);
  q.kv_heads = 128;
  EXPECT_EQ(kv_memory(v3, q).bytes_per_token, 2LL * 61 * 128 * 128 * 2);
  MemoryPlanQuery plan;
  plan.prompt_tokens = 3000;
  plan.output_tokens = 1000;
  plan.tensor_parallel = 8;
  plan.weight_dtype = plan.kv_dtype = DType::dtype_f8_e4m3;
  const MemoryPlan p = plan_memory(v3, load_hardware_profile("h200"), plan);
  EXPECT_EQ(p.kv_heads_per_gpu, 1);
  EXPECT_EQ(p.kv_bytes_per_token, 61 * 576);
  plan.kv_heads = 8;
  EXPECT_EQ(plan_memory(v3, load_hardware_profile("h200"), plan).kv_bytes_per_token,
            2 * 61 * 1 * 128);
}

TEST(MemoryPlanner, BadQueriesAreErrors) {
  MemoryPlanQuery q;
  q.prompt_tokens = 4000;
  q.output_tokens = 200;
  test::expect_error_containing([&] { plan_memory(model_preset("llama-7b"), card_40gib(), q); },
                                {"prompt 4000 + output 200 exceed the 2048-token context"});
  q.prompt_tokens = 0;
  test::expect_error_containing([&] { plan_memory(model_preset("llama-7b"), card_40gib(), q); },
                                {"must be positive"});
  q.prompt_tokens = 10;
  q.block_size = 0;
  test::expect_error_containing([&] { plan_memory(model_preset("llama-7b"), card_40gib(), q); },
                                {"block size"});
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// convert_from_f32 / convert_to_f32 convert eight values at a time where the CPU allows (F16C,
// AVX2) and the rest one by one: every value, at every position of a run, must come out bit for
// bit as Eigen's scalar conversion gives it (round to nearest even, ties, overflow to infinity,
// subnormals, signed zeros, NaNs of both signs). Widening: every 16-bit pattern as Eigen widens
// it, except that a NaN only keeps its sign (F16C quiets signalling NaNs).
TEST(KvPoolDtype, RunConversionsEqualEigensScalarConversionsBitForBit) {
  std::vector<float> values{0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            0.1f,
                            65504.0f,
                            65520.0f,
                            -65520.0f,
                            1e-8f,
                            6e-8f,
                            -3e-5f,
                            1e-40f,
                            3.4e38f,
                            -3.4e38f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::signaling_NaN()};
  for (std::uint32_t bits : {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7f8000u,
                             0x00008000u, 0x7f800001u, 0xffc00001u})
    values.push_back(Eigen::numext::bit_cast<float>(bits));  // bf16 ties and edges, NaN payloads
  std::uint32_t state = 12345;                               // and values of every exponent
  for (int i = 0; i < 2000; ++i) {
    state = state * 1664525u + 1013904223u;
    values.push_back(Eigen::numext::bit_cast<float>(state));
  }
  for (DType dtype : {DType::dtype_f16, DType::dtype_bf16})
    for (std::size_t offset : {0, 1, 5}) {  // the 8-wide runs start at every alignment
      const std::span<const float> run = std::span<const float>(values).subspan(offset);
      std::vector<std::byte> bytes(run.size() * 2);
      convert_from_f32(dtype, run, bytes);
      std::vector<float> back(run.size());
      convert_to_f32(dtype, bytes, back);
      for (std::size_t i = 0; i < run.size(); ++i) {
        std::uint16_t stored;
        std::memcpy(&stored, bytes.data() + 2 * i, 2);
        const std::uint16_t expected =
            dtype == DType::dtype_f16
                ? Eigen::numext::bit_cast<std::uint16_t>(Eigen::half(run[i]))
                : Eigen::numext::bit_cast<std::uint16_t>(Eigen::bfloat16(run[i]));
        ASSERT_EQ(stored, expected)
            << dtype_short_name(dtype) << " value " << run[i] << " at " << i << " (bits "
            << std::hex << Eigen::numext::bit_cast<std::uint32_t>(run[i]) << ")";
        const float widened =
            dtype == DType::dtype_f16
                ? static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(stored))
                : static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(stored));
        ASSERT_EQ(Eigen::numext::bit_cast<std::uint32_t>(back[i]),
                  Eigen::numext::bit_cast<std::uint32_t>(widened))
            << dtype_short_name(dtype) << " at " << i;
      }
    }
  std::vector<std::byte> every_pattern(2 * 65536);  // widening: all 16-bit values, NaNs included
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    std::memcpy(every_pattern.data() + 2 * b, &bits, 2);
  }
  for (DType dtype : {DType::dtype_f16, DType::dtype_bf16}) {
    std::vector<float> widened(65536);
    convert_to_f32(dtype, every_pattern, widened);
    for (std::uint32_t b = 0; b < 65536; ++b) {
      const auto bits = static_cast<std::uint16_t>(b);
      const float expected =
          dtype == DType::dtype_f16
              ? static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits))
              : static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
      if (std::isnan(expected)) {  // F16C sets a signalling NaN's quiet bit; Eigen keeps it
        ASSERT_TRUE(std::isnan(widened[b])) << std::hex << b;
        ASSERT_EQ(std::signbit(widened[b]), std::signbit(expected)) << std::hex << b;
        continue;
      }
      ASSERT_EQ(Eigen::numext::bit_cast<std::uint32_t>(widened[b]),
                Eigen::numext::bit_cast<std::uint32_t>(expected))
          << dtype_short_name(dtype) << " bits " << std::hex << b;
    }
  }
}

// A pool sized from input is checked before it is allocated: overflow and "more than this
// machine holds" are errors naming the pool's shape, not std::bad_alloc.
// An f16/bf16 pool stores half the bytes, rounds each value to nearest even on write (what
// convert_from_f32 does), moves slots as bytes, and refuses float access.
TEST(KvPoolDtype, HalfPoolsRoundOnWriteAndHoldHalfTheBytes) {
  const KvPoolShape f32_shape{2, 2, 4, 8};
  for (DType dtype : {DType::dtype_f16, DType::dtype_bf16}) {
    KvPoolShape shape = f32_shape;
    shape.dtype = dtype;
    KvPool pool(shape);
    EXPECT_EQ(pool.bytes_per_slot() * 2, KvPool(f32_shape).bytes_per_slot());
    const std::vector<float> row{0.1f, -1.0f / 3, 65504.0f, 1e-8f, 3.0f, -0.0f, 7.5f, 1234.567f};
    pool.write_row(1, 5, true, row.data());
    std::vector<std::byte> expected_bytes(row.size() * 2);
    convert_from_f32(dtype, row, expected_bytes);
    std::vector<float> expected(row.size()), back(row.size());
    convert_to_f32(dtype, expected_bytes, expected);
    pool.read_row(1, 5, true, back.data());
    EXPECT_EQ(back, expected) << dtype_short_name(dtype);
    EXPECT_NE(back, row);  // 0.1 and 1/3 are not exact in 16 bits
    pool.copy_slots(5, 2, 1);
    pool.read_row(1, 2, true, back.data());
    EXPECT_EQ(back, expected);
    pool.read_row(1, 2, false, back.data());  // K untouched
    EXPECT_EQ(back, std::vector<float>(row.size(), 0.0f));
    test::expect_error_containing([&] { (void)pool.key(0, 0); }, {"float access", "KV pool"});
  }
  test::expect_error_containing(
      [] {
        KvPool pool({1, 1, 8, 4, DType::dtype_i8});
      },
      {"f32, f16, bf16, fp8, int8, q8_0, q4_0, q4_1, int2", "i8"});
}

// How a host backend (the cpu plugin) brings K/V to the pool the serving stack made for
// bookkeeping: zeroed storage once, kept on a second call; the dtypes a host pool holds only.
TEST(KvPoolStorage, HostStorageIsProvidedOnDemand) {
  KvPool pool({2, 1, 8, 4, DType::dtype_bf16}, KvStorage::none);
  EXPECT_FALSE(pool.has_storage());
  pool.provide_host_storage();
  ASSERT_TRUE(pool.has_storage());
  std::vector<float> row(8, 1.0f);
  pool.read_row(1, 3, true, row.data());
  EXPECT_EQ(row, std::vector<float>(8, 0.0f));  // zeroed
  const std::vector<float> written{1, 2, 3, 4, 5, 6, 7, 8};
  pool.write_row(1, 3, true, written.data());
  pool.provide_host_storage();  // already there: kept, not reallocated
  pool.read_row(1, 3, true, row.data());
  EXPECT_EQ(row, written);                                    // small integers: exact in bf16
  KvPool i8({1, 1, 8, 4, DType::dtype_i8}, KvStorage::none);  // no KV pool dtype
  test::expect_error_containing([&] { i8.provide_host_storage(); },
                                {"f32, f16, bf16, fp8, int8, q8_0, q4_0, q4_1, int2", "i8"});
  EXPECT_FALSE(i8.has_storage());
}

TEST(KvPoolSize, OverflowAndMachineLimitAreErrors) {
  const std::string overflow = test::error_of<Error>([] {
    KvPool pool({32, 32, 128, std::int64_t{1} << 50});
  });
  EXPECT_NE(overflow.find("overflows 64 bits"), std::string::npos) << overflow;
  const std::uint64_t machine = allocatable_bytes();
  const auto slots = static_cast<std::int64_t>(machine / (2 * 4 * 64) + 1);  // 1 layer, 64 floats
  const std::string too_big = test::error_of<Error>([&] { KvPool pool({1, 1, 64, slots}); });
  EXPECT_NE(too_big.find("more than this machine can hold"), std::string::npos) << too_big;
  EXPECT_NE(too_big.find("kv_cache.slots"), std::string::npos) << too_big;
  KvPool bookkeeping({1, 1, 64, slots}, KvStorage::none);  // no storage: nothing to hold
  EXPECT_FALSE(bookkeeping.has_storage());
  // A backend that asks the bookkeeping pool for host storage gets the same error.
  const std::string provided = test::error_of<Error>([&] { bookkeeping.provide_host_storage(); });
  EXPECT_NE(provided.find("more than this machine can hold"), std::string::npos) << provided;
  EXPECT_FALSE(bookkeeping.has_storage());
  const std::string negative = test::error_of<Error>([] { KvPool pool({1, 1, 64, -5}); });
  EXPECT_NE(negative.find("non-negative"), std::string::npos) << negative;
}

TEST(ModelConfigLimits, DimsAndParameterCountAreBounded) {
  ModelConfig c = model_preset("tiny");
  c.hidden_size = std::int64_t{1} << 40;
  const std::string message = test::error_of<Error>([&] { validate_model_config(c, "big"); });
  EXPECT_NE(message.find("\"hidden_size\" = 1099511627776 is larger than kvlab's limit"),
            std::string::npos)
      << message;
  c = model_preset("tiny");
  c.vocab_size = std::int64_t{1} << 30;
  c.hidden_size = std::int64_t{1} << 30;  // 2^61 parameters in the embedding alone
  EXPECT_NE(test::error_of<Error>([&] {
              validate_model_config(c, "big");
            }).find("more than kvlab's limit"),
            std::string::npos);
  EXPECT_NO_THROW(validate_model_config(model_preset("llama2-70b"), "llama2-70b"));
}

}  // namespace
}  // namespace kvlab
