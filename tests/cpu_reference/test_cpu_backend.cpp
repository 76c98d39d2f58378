// The CPU backend's side of BatchEntry::writes_kv: an entry that re-decodes a cached position
// without writing K/V leaves every layer's slot bit for bit as it was (a static batch's padding
// rows, whose recomputation may round differently, must never reach a cached block); the same
// entry that writes does change it, so the check can fail. And BatchEntry::logit_rows: a
// speculative verify's rows of logits, each the reference model's at its position.
#include <gtest/gtest.h>

#include <cstring>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"

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

// A verify entry (4 new tokens after a 13-token cached prompt, logits at all 4) beside a plain
// prompt (its last token's logits): 5 rows, the verify's in position order, each equal to the
// reference model's logits at that position over the whole sequence (1e-4: fp32 Eigen against
// the reference's loops, logits O(1)). An entry asking for more rows than it has is refused, and
// so is a token outside the vocabulary.
TEST(CpuBackend, AnEntryGetsLogitsAtEachOfItsLastLogitRowsTokens) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 11);
  const ModelConfig& c = weights.config;
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64});
  CpuBackend backend(weights, pool, std::nullopt);
  const std::vector<std::int32_t> whole{1,  5,  9,  200, 3, 77, 12,  8, 40,
                                        41, 42, 43, 44,  7, 70, 300, 17};
  const std::span<const std::int32_t> prompt(whole.data(), 13), proposal(whole.data() + 13, 4);
  const BatchEntry prefill{prompt, 0, KvView{{{0, 13}}, 0, {}}};
  (void)backend.run({&prefill, 1});
  const std::vector<std::int32_t> other{2, 4, 6, 8, 10};
  BatchEntry verify{proposal, 13, KvView{{{0, 17}}, 0, {}}};
  verify.logit_rows = 4;
  const BatchEntry plain{other, 0, KvView{{{32, 5}}, 0, {}}};
  const std::vector<BatchEntry> batch{verify, plain};
  const RowMatrix& logits = backend.run(batch);
  ASSERT_EQ(logits.rows(), 5);
  const ReferenceModel reference(weights);
  const RowMatrix expected_verify = reference.forward(whole);  // (17, vocab)
  const RowMatrix expected_plain = reference.forward(other);
  for (int r = 0; r < 4; ++r)
    EXPECT_LT((logits.row(r) - expected_verify.row(13 + r)).cwiseAbs().maxCoeff(), 1e-4) << r;
  EXPECT_LT((logits.row(4) - expected_plain.row(4)).cwiseAbs().maxCoeff(), 1e-4);
  verify.logit_rows = 5;
  EXPECT_THROW((void)backend.run({&verify, 1}), Error);
  const std::vector<std::int32_t> outside{3, static_cast<std::int32_t>(c.vocab_size)};
  const BatchEntry bad{outside, 0, KvView{{{40, 2}}, 0, {}}};
  EXPECT_THROW((void)backend.run({&bad, 1}), Error);  // no embedding row to read
}

}  // namespace
}  // namespace kvlab::cpu
