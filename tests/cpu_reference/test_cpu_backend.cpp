// The CPU backend's side of BatchEntry::writes_kv: an entry that re-decodes a cached position
// without writing K/V leaves every layer's slot bit for bit as it was (a static batch's padding
// rows, whose recomputation may round differently, must never reach a cached block); the same
// entry that writes does change it, so the check can fail.
#include <gtest/gtest.h>

#include <cstring>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"

namespace kvlab::cpu {
namespace {

// Every layer's K and V bytes of one slot.
std::vector<std::byte> slot_bytes(const KvPool& pool, std::int64_t slot) {
  const auto row = static_cast<std::size_t>(pool.shape().slot_row_bytes());
  std::vector<std::byte> bytes;
  for (std::int64_t l = 0; l < pool.shape().layers; ++l)
    for (const std::byte* p : {pool.key_bytes(l, slot), pool.value_bytes(l, slot)})
      bytes.insert(bytes.end(), p, p + row);
  return bytes;
}

TEST(CpuBackend, EntriesThatDoNotWriteKvLeaveTheirSlots) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 11);
  const ModelConfig& c = weights.config;
  for (const DType dtype : {DType::dtype_f32, DType::dtype_bf16}) {
    KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32, dtype});
    CpuBackend backend(weights, pool, std::nullopt);
    const std::vector<std::int32_t> prompt{1, 5, 9, 200, 3, 77, 12, 8, 40, 41, 42, 43, 44};
    const BatchEntry prefill{prompt, 0, KvView{{{0, 13}}, 0, {}}};
    (void)backend.run({&prefill, 1});
    const std::vector<std::byte> cached = slot_bytes(pool, 12);

    // Position 12 again, with another token than the one cached there.
    const std::vector<std::int32_t> other{100};
    BatchEntry padding{other, 12, KvView{{{0, 13}}, 0, {}}};
    padding.writes_kv = false;
    const RowMatrix& logits = backend.run({&padding, 1});
    EXPECT_TRUE(logits.allFinite());
    EXPECT_EQ(slot_bytes(pool, 12), cached) << "dtype " << static_cast<int>(dtype);

    padding.writes_kv = true;
    (void)backend.run({&padding, 1});
    EXPECT_NE(slot_bytes(pool, 12), cached) << "a writing entry stores its token's K/V";
  }
}

}  // namespace
}  // namespace kvlab::cpu
