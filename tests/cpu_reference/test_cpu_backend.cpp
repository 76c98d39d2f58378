// The CPU backend's side of BatchEntry::writes_kv: an entry that re-decodes a cached position
// without writing K/V leaves every layer's slot bit for bit as it was (a static batch's padding
// rows, whose recomputation may round differently, must never reach a cached block); the same
// entry that writes does change it, so the check can fail. And BatchEntry::logit_rows: a
// speculative verify's rows of logits, each the reference model's at its position.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "cache_walk.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"
#include "plugin_registry.hpp"
#include "test_models.hpp"

namespace kvlab::cpu {
namespace {

// Every layer's K and V bytes of one slot.
std::vector<std::byte> slot_bytes(const KvPool& pool, std::int64_t slot) {
  std::vector<std::byte> bytes;
  for (std::int64_t l = 0; l < pool.shape().layers; ++l)
    for (const bool value : {false, true}) {
      const std::byte* p = value ? pool.value_bytes(l, slot) : pool.key_bytes(l, slot);
      bytes.insert(bytes.end(), p, p + pool.shape().slot_row_bytes(value));
    }
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

// A key mask (BatchEntry::key_mask: a per-head KV policy's) hides keys per layer and K/V head.
// Hidden in every head, a key is as absent as from a view without it (the same logits within
// 1e-5: the same terms, summed around a hole). Hidden only in layer 0's K/V head 0, that head
// gives it weight 0 while its query heads' weights still sum to 1 a query (1e-5) and the other
// K/V head's weight on it is not 0; the logits then differ from both the unmasked and the
// everywhere-hidden runs. A mask of the wrong size is refused.
TEST(CpuBackend, AKeyMaskHidesKeysPerLayerAndKvHead) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 11);
  const ModelConfig& c = weights.config;  // 2 layers, 4 query heads, 2 K/V heads
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32});
  CpuBackend backend(weights, pool, std::nullopt);
  const std::vector<std::int32_t> prompt{1, 5, 9, 200, 3, 77, 12, 8, 40, 41, 42, 43, 44};
  const BatchEntry prefill{prompt, 0, KvView{{{0, 13}}, 0, {}}};
  (void)backend.run({&prefill, 1});
  const std::vector<std::int32_t> next{7};
  const std::int64_t keys = 14, hidden = 4, heads = c.num_hidden_layers * c.num_key_value_heads;
  auto decode = [&](std::vector<std::uint8_t> mask) {  // logits and key scores of position 13
    BatchEntry entry{next, 13, KvView{{{0, keys}}, 0, {}}};
    entry.scored_queries = 1;
    entry.key_mask = mask;
    const RowMatrix logits = backend.run({&entry, 1});
    const std::span<const float> scores = backend.key_scores();
    return std::make_pair(logits, std::vector<float>(scores.begin(), scores.end()));
  };
  std::vector<std::uint8_t> everywhere(static_cast<std::size_t>(heads * keys), 1);
  for (std::int64_t row = 0; row < heads; ++row)
    everywhere[static_cast<std::size_t>(row * keys + hidden)] = 0;
  const auto [masked_logits, masked_scores] = decode(everywhere);
  EXPECT_EQ(masked_scores.size(), static_cast<std::size_t>(heads * keys));
  std::vector<std::int64_t> without(static_cast<std::size_t>(keys));
  std::iota(without.begin(), without.end(), 0);
  without.erase(without.begin() + hidden);
  const BatchEntry holed{next, 13,
                         KvView{{{0, hidden}, {hidden + 1, keys - hidden - 1}}, 0, without}};
  const RowMatrix absent = backend.run({&holed, 1});
  EXPECT_LT((masked_logits - absent).cwiseAbs().maxCoeff(), 1e-5);

  std::vector<std::uint8_t> one_head(static_cast<std::size_t>(heads * keys), 1);
  one_head[static_cast<std::size_t>(hidden)] = 0;  // layer 0, K/V head 0
  const auto [one_logits, one_scores] = decode(one_head);
  EXPECT_EQ(one_scores[static_cast<std::size_t>(hidden)], 0.0f);
  EXPECT_GT(one_scores[static_cast<std::size_t>(keys + hidden)], 0.0f);  // K/V head 1 sees it
  for (std::int64_t row = 0; row < heads; ++row) {
    float sum = 0;
    for (std::int64_t j = 0; j < keys; ++j)
      sum += one_scores[static_cast<std::size_t>(row * keys + j)];
    EXPECT_NEAR(sum, static_cast<float>(c.group_size()), 1e-5) << row;
  }
  const auto [plain_logits, plain_scores] = decode({});
  EXPECT_GT((one_logits - plain_logits).cwiseAbs().maxCoeff(), 1e-4);
  EXPECT_GT((one_logits - masked_logits).cwiseAbs().maxCoeff(), 1e-4);
  one_head.pop_back();
  EXPECT_THROW((void)decode(one_head), Error);
}

// A per-head KV policy over KV groups (gemma3-tiny's six groups of one layer: five local with an
// 8-token window, the global last): the key mask and the key scores are numbered by the entry's
// view (group 0's), and a local group's view holds only some of its positions. A decode whose
// group 0 dropped position 7 and whose local groups hold positions 12-20 gives the logits and
// key scores of the one-table pool with the same positions (1e-6: the same sums), a key hidden
// in one local and one global layer included; a local layer gives 0 to every key its window has
// passed. Masking another key than the one-table run does changes the logits: the check can fail.
TEST(CpuBackend, KvGroupsReadKeyMasksAndGiveKeyScoresInTheEntrysViewsNumbering) {
  const LlamaWeights weights = test::scaled_random_weights(model_preset("gemma3-tiny"), 5);
  const ModelConfig& c = weights.config;  // 6 layers, 1 K/V head, layer 5 global
  constexpr std::int64_t kRoom = 64, kPrompt = 20, kDropped = 7, kLocalFrom = 12;
  KvPool uniform_pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kRoom});
  KvPool grouped_pool({1, c.num_key_value_heads, c.head_dim, c.num_hidden_layers * kRoom});
  CpuBackend uniform(weights, uniform_pool, std::nullopt),
      grouped(weights, grouped_pool, std::nullopt);
  std::vector<std::int32_t> prompt(kPrompt);
  for (std::int64_t i = 0; i < kPrompt; ++i) prompt[static_cast<std::size_t>(i)] = 3 + 7 * i % 500;
  BatchEntry prefill{prompt, 0, KvView{{{0, kPrompt}}, 0, {}}};
  (void)uniform.run({&prefill, 1});
  for (std::int64_t g = 0; g < c.num_hidden_layers; ++g)
    prefill.group_views.push_back(KvView{{{g * kRoom, kPrompt}}, 0, {}});
  (void)grouped.run({&prefill, 1});

  std::vector<std::int64_t> held(kPrompt + 1);  // positions 0-20 but the dropped one
  std::iota(held.begin(), held.end(), 0);
  held.erase(held.begin() + kDropped);
  const auto keys = static_cast<std::int64_t>(held.size());
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(c.num_hidden_layers * keys), 1);
  const std::int64_t local_hidden = 15 - 1, global_hidden = 3;  // view indices (7 dropped)
  mask[static_cast<std::size_t>(2 * keys + local_hidden)] = 0;
  mask[static_cast<std::size_t>(5 * keys + global_hidden)] = 0;
  const std::vector<std::int32_t> next{9};
  const auto decode = [&](CpuBackend& backend, std::int64_t base, bool groups,
                          std::span<const std::uint8_t> key_mask) {
    BatchEntry entry{
        next, kPrompt,
        KvView{{{base, kDropped}, {base + kDropped + 1, kPrompt - kDropped}}, 0, held}};
    entry.scored_queries = 1;
    entry.key_mask = key_mask;
    for (std::int64_t g = 0; groups && g < c.num_hidden_layers; ++g)
      entry.group_views.push_back(
          g == 0 ? entry.view
                 : KvView{{{g * kRoom + kLocalFrom, kPrompt + 1 - kLocalFrom}}, kLocalFrom, {}});
    const RowMatrix logits = backend.run({&entry, 1});
    const std::span<const float> scores = backend.key_scores();
    return std::make_pair(logits, std::vector<float>(scores.begin(), scores.end()));
  };
  const auto [one_table_logits, one_table_scores] = decode(uniform, 0, false, mask);
  const auto [grouped_logits, grouped_scores] = decode(grouped, 0, true, mask);
  EXPECT_LT((grouped_logits - one_table_logits).cwiseAbs().maxCoeff(), 1e-6);
  ASSERT_EQ(grouped_scores.size(), one_table_scores.size());
  for (std::size_t i = 0; i < grouped_scores.size(); ++i)
    EXPECT_NEAR(grouped_scores[i], one_table_scores[i], 1e-6) << i;
  EXPECT_EQ(grouped_scores[static_cast<std::size_t>(2 * keys + local_hidden)], 0.0f);
  EXPECT_GT(grouped_scores[static_cast<std::size_t>(3 * keys + local_hidden)], 0.0f);
  for (std::int64_t j = 0; j < 13 - 1; ++j)  // positions 0-12 (7 dropped): outside the window
    EXPECT_EQ(grouped_scores[static_cast<std::size_t>(j)], 0.0f) << j;
  std::vector<std::uint8_t> other = mask;
  other[static_cast<std::size_t>(2 * keys + local_hidden)] = 1;
  other[static_cast<std::size_t>(2 * keys + local_hidden + 1)] = 0;
  EXPECT_GT((decode(grouped, 0, true, other).first - one_table_logits).cwiseAbs().maxCoeff(), 1e-5);
}

// Gemma 3's architecture (gemma3-tiny: 6 layers, the last global, the others an 8-token window
// with their own RoPE base; per-head Q/K norms, post norms, GeGLU, scaled embedding) through
// the backend: a 29-token prompt in chunks of 5 with its slots scattered over three extents,
// then 6 decode steps beside another prompt's prefill. Every logit row equals the reference's
// over the whole sequence within 1e-4 (fp32 both; logits O(1)), so every layer read exactly the
// keys of its own window, rotated by its own table. Without the window (every layer global) the
// backend's last rows differ from the reference's by far more: the check can fail.
TEST(CpuBackend, Gemma3LocalAndGlobalLayersEqualTheReferenceAcrossChunksAndDecodes) {
  LlamaWeights weights = test::scaled_random_weights(model_preset("gemma3-tiny"), 5);
  for (LayerWeights& layer : weights.layers) {  // norms that differ, so their order shows
    layer.q_norm.setLinSpaced(0.6f, 1.4f);
    layer.k_norm.setLinSpaced(1.3f, 0.7f);
    layer.attention_post_norm.setLinSpaced(0.9f, 1.1f);
    layer.mlp_post_norm.setLinSpaced(1.1f, 0.7f);
  }
  const ModelConfig& c = weights.config;
  ASSERT_EQ(c.layer_window(0), 8);
  ASSERT_EQ(c.layer_window(5), std::nullopt);
  const test::CacheWalk walk{ReferenceModel(weights)};
  for (const bool windowed : {true, false}) {
    KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256});
    CpuBackend backend(weights, pool, windowed ? std::nullopt : std::optional<std::int64_t>(4096));
    const double worst = walk.worst_delta(backend);
    if (windowed)
      EXPECT_LT(worst, 1e-4);
    else
      EXPECT_GT(worst, 0.05) << "every layer global must differ from the local:global model";
  }
}

// A prompt chunk of 128 tokens or more is attended in blocks of 64-127 queries, each over the
// keys its own queries can see (the causal end, Gemma 3's windows). gemma3-tiny (8-token windows
// and a global layer): a 300-token chunk (4 blocks) over two extents of slots, then a 150-token
// chunk (2 blocks) after it; every logit row equals the reference's over the whole sequence
// within 1e-4 (fp32 both; logits O(1)).
TEST(CpuBackend, APromptInQueryBlocksEqualsTheReference) {
  const LlamaWeights weights = test::scaled_random_weights(model_preset("gemma3-tiny"), 7);
  const ModelConfig& c = weights.config;
  constexpr std::int64_t kFirst = 300, kSecond = 150, kSplit = 100;  // slots: 2 extents
  std::vector<std::int32_t> tokens(kFirst + kSecond);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::int32_t>(3 + 37 * i % 500);
  const RowMatrix expected = ReferenceModel(weights).forward(tokens);
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1024});
  CpuBackend backend(weights, pool, std::nullopt);
  const auto chunk = [&](std::int64_t start, std::int64_t count) {
    const std::int64_t end = start + count;
    const BatchEntry entry{std::span<const std::int32_t>(tokens).subspan(
                               static_cast<std::size_t>(start), static_cast<std::size_t>(count)),
                           start, KvView{{{600, kSplit}, {0, end - kSplit}}, 0, {}}};
    return RowMatrix(backend.run({&entry, 1}, count));
  };
  const RowMatrix first = chunk(0, kFirst), second = chunk(kFirst, kSecond);
  EXPECT_LT((first - expected.topRows(kFirst)).cwiseAbs().maxCoeff(), 1e-4);
  EXPECT_LT((second - expected.bottomRows(kSecond)).cwiseAbs().maxCoeff(), 1e-4);
}

// The attention a chunk's scored queries give each key (BatchEntry::scored_queries) when they
// span query blocks: the last 100 of a 300-token chunk (blocks of 75) give the key scores of
// the same 100 queries run as a chunk of their own (one block) after the first 200 (1e-5: the
// same weights summed in another order), and each (layer, K/V head) row sums to 100 queries x 2
// query heads.
TEST(CpuBackend, KeyScoresOfQueriesAcrossBlocksAreThoseOfOneBlock) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 13);
  const ModelConfig& c = weights.config;  // 2 layers, 4 query heads, 2 K/V heads
  constexpr std::int64_t kPrompt = 300, kScored = 100;
  std::vector<std::int32_t> tokens(kPrompt);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::int32_t>(1 + 53 * i % 500);
  const auto scores = [&](std::int64_t split) {
    KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kPrompt});
    CpuBackend backend(weights, pool, std::nullopt);
    const std::span<const std::int32_t> all(tokens);
    const BatchEntry head{all.first(static_cast<std::size_t>(split)), 0,
                          KvView{{{0, split}}, 0, {}}};
    if (split > 0) (void)backend.run({&head, 1});
    BatchEntry tail{all.subspan(static_cast<std::size_t>(split)), split,
                    KvView{{{0, kPrompt}}, 0, {}}};
    tail.scored_queries = kScored;
    (void)backend.run({&tail, 1});
    return std::vector<float>(backend.key_scores().begin(), backend.key_scores().end());
  };
  const std::vector<float> blocks = scores(0), alone = scores(kPrompt - kScored);
  ASSERT_EQ(blocks.size(), static_cast<std::size_t>(c.num_hidden_layers * 2 * kPrompt));
  ASSERT_EQ(alone.size(), blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) EXPECT_NEAR(blocks[i], alone[i], 1e-5) << i;
  for (std::size_t row = 0; row < blocks.size() / kPrompt; ++row) {
    float sum = 0;
    for (std::int64_t j = 0; j < kPrompt; ++j) sum += blocks[row * kPrompt + j];
    EXPECT_NEAR(sum, static_cast<float>(kScored * c.group_size()), 1e-3) << row;
  }
}

// The reference's greedy continuation of `tokens`, `count` tokens long.
std::vector<std::int32_t> greedy_continuation(const ReferenceModel& reference,
                                              std::vector<std::int32_t> tokens, int count) {
  std::vector<std::int32_t> continuation;
  for (int i = 0; i < count; ++i) {
    const RowMatrix logits = reference.forward(tokens);
    Eigen::Index best = 0;
    logits.row(logits.rows() - 1).maxCoeff(&best);
    continuation.push_back(static_cast<std::int32_t>(best));
    tokens.push_back(continuation.back());
  }
  return continuation;
}

// The draft proposer plugin over a CpuBackend (the tiny preset as the draft). Its proposals are
// the draft's greedy continuation of each sequence, asked one at a time or three in one batch;
// after a step whose proposals the target rejected (one accepted, then another token verified)
// and a plain decode step, they are again the continuation of the verified tokens: the rejected
// positions' KV was cut back and the missing ones fed, nothing stale reused. A pool too small for
// an ask proposes nothing; a full one drops the least recently asked sequences' draft KV.
TEST(DraftProposer, ProposesTheDraftsGreedyContinuationAfterEveryRollback) {
  const LlamaWeights weights = random_llama_weights(model_preset("tiny"), 11);
  const ModelConfig& c = weights.config;
  const ReferenceModel reference(weights);
  KvPool pool({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 256});
  CpuBackend backend(weights, pool, std::nullopt);
  PluginContext context;
  context.model = &c;
  context.pool = &pool;
  context.draft = &backend;
  auto proposer = test::plugin_registry().create<PluginKind::proposer>("draft", {}, context);
  std::vector<RequestState> requests(3);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = static_cast<RequestId>(i);
    requests[i].tokens = {1, 5, 9, 200, 3, static_cast<std::int32_t>(77 + i), 12, 8};
  }
  const std::vector<std::int32_t> first = proposer->propose_one(requests[0], 4);
  EXPECT_EQ(first, greedy_continuation(reference, requests[0].tokens, 4));
  for (int round = 0; round < 3; ++round) {
    // Request 0's verify: its first proposal accepted, the target's own token after it; then a
    // step that asked for no proposals (a plain decode).
    RequestState& r = requests[0];
    const std::vector<std::int32_t> held = greedy_continuation(reference, r.tokens, 2);
    r.tokens.push_back(held[0]);
    r.tokens.push_back((held[1] + 1 + round) % static_cast<std::int32_t>(c.vocab_size));
    r.tokens.push_back(static_cast<std::int32_t>(40 + round));
    std::vector<std::vector<std::int32_t>> proposed(requests.size());
    std::vector<ProposeAsk> asks;
    for (std::size_t i = 0; i < requests.size(); ++i)
      asks.push_back({&requests[i], 3, &proposed[i]});
    proposer->propose(asks);
    for (std::size_t i = 0; i < requests.size(); ++i)
      EXPECT_EQ(proposed[i], greedy_continuation(reference, requests[i].tokens, 3))
          << "round " << round << ", request " << i;
  }
  proposer->forget(0);
  EXPECT_EQ(proposer->propose_one(requests[0], 2),
            greedy_continuation(reference, requests[0].tokens, 2));

  KvPool small({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 16});
  CpuBackend small_backend(weights, small, std::nullopt);
  context.pool = &small;
  context.draft = &small_backend;
  auto cramped = test::plugin_registry().create<PluginKind::proposer>("draft", {}, context);
  RequestState longer = requests[1];
  longer.tokens.resize(20, 4);
  EXPECT_TRUE(cramped->propose_one(longer, 3).empty()) << "20 tokens do not fit 16 slots";
  EXPECT_EQ(cramped->propose_one(requests[2], 3).size(), 3u) << "and the pool is whole again";

  // Two blocks, three requests asked in turn: each ask drops the draft KV of the least recently
  // asked ones until its own fits (request 0's 17 tokens take both blocks), and every proposal
  // is still the draft's continuation, the dropped ones fed again from their first token.
  KvPool two_blocks({c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 32});
  CpuBackend two_block_backend(weights, two_blocks, std::nullopt);
  context.pool = &two_blocks;
  context.draft = &two_block_backend;
  auto turns = test::plugin_registry().create<PluginKind::proposer>("draft", {}, context);
  for (int round = 0; round < 2; ++round)
    for (std::size_t i = 0; i < requests.size(); ++i)
      EXPECT_EQ(turns->propose_one(requests[i], 3),
                greedy_continuation(reference, requests[i].tokens, 3))
          << "round " << round << ", request " << i;
}

}  // namespace
}  // namespace kvlab::cpu
