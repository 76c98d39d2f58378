// draft: a draft model proposes (Leviathan et al. 2023; vLLM's and llama.cpp's draft models), or
// the target's own first layers do (self-speculation, LayerSkip's idea): the host runs whichever
// [speculation] draft_model / draft_layers names as a backend of its own (PluginContext::draft),
// its K/V in a pool of its own (PluginContext::pool). Each step every decode's draft cache is
// brought to its verified tokens (what it holds past them, the last step's rejected proposals,
// dropped; the tokens it lacks, fed in one entry), then the draft picks greedily, one batched
// draft step per proposed position.
//
//   verified: a b c d e | cached before: a b c d X Y (X, Y rejected) -> keep a b c d, feed e,
//   then feed each pick: e -> p1 -> p2 -> ... (k steps; the last pick is never fed)
//
// The draft's KV goes through the core's paged code as the target's does: its blocks are a
// BlockPool's (kvlab::PagedBlocks, no prefix cache), each request's a BlockTable with its view,
// and when the pool is full the sequence to drop is chosen by the one eviction priority
// (kvlab/kv/eviction_order.hpp: the least recently asked first).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/kv/block_table.hpp"
#include "kvlab/kv/eviction_order.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

constexpr std::int64_t kBlock = 16;  // slots a block of the draft's pool

// One sequence in the draft's cache: the tokens whose K/V it holds (table.tokens), in blocks
// taken from the draft's pool, with room held for this call's picks.
struct DraftSequence {
  BlockTable table;
  std::uint64_t last_used = 0;  // the propose() call that last asked for it
};

// A decode being proposed for this call: what to feed next, and where the picks go.
struct Drafting {
  const ProposeAsk* ask;
  DraftSequence* sequence;
  std::vector<std::int32_t> feed;
};

KvPool& draft_pool_of(const PluginContext& context) {
  if (context.draft == nullptr || context.pool == nullptr)
    throw Error(
        "draft proposer: no draft model to run: give [speculation] draft_model (a model with the "
        "target's vocabulary) or draft_layers (the target's first layers)");
  return *context.pool;
}

class DraftProposer final : public Proposer {
 public:
  DraftProposer(const PluginParams&, const PluginContext& context)
      : blocks_(draft_pool_of(context), kBlock, false), draft_(*context.draft) {}

  void propose(std::span<const ProposeAsk> asks) override {
    ++calls_;
    std::vector<Drafting> drafting;
    for (const ProposeAsk& ask : asks)
      if (DraftSequence* sequence = catch_up(ask, asks))
        drafting.push_back({&ask, sequence, feed_of(*ask.request, sequence->table)});
    std::int64_t longest = 0;
    for (const Drafting& d : drafting) longest = std::max(longest, d.ask->max_tokens);
    for (std::int64_t j = 0; j < longest; ++j) draft_step(drafting, j);
  }

  void forget(RequestId id) override {
    if (const auto it = sequences_.find(id); it != sequences_.end()) {
      blocks_.release_all(it->second.table);
      sequences_.erase(it);
    }
  }

 private:
  // The request's draft sequence cut back to the tokens it shares with the verified ones (all
  // but the newest, which is fed so that its row gives the first pick), with room for what this
  // call feeds; null when the pool cannot hold them even after dropping the sequences no ask
  // of this call names (the request then gets no proposals this step).
  DraftSequence* catch_up(const ProposeAsk& ask, std::span<const ProposeAsk> asks) {
    const RequestState& r = *ask.request;
    DraftSequence& s = sequences_[r.id];
    s.last_used = calls_;
    const auto& held = s.table.tokens;
    const auto limit = static_cast<std::ptrdiff_t>(std::min(held.size(), r.tokens.size() - 1));
    const auto shared = std::mismatch(held.begin(), held.begin() + limit, r.tokens.begin());
    // The rest was rejected. A draft table holds no prefix cache, drops and shares nothing, so
    // a cut within its length always succeeds.
    blocks_.truncate(s.table, shared.first - held.begin());
    // fed: the verified tokens it lacks, then max_tokens - 1 picks
    const std::int64_t end = r.length() + ask.max_tokens - 1;
    const std::int64_t needed =
        blocks_.blocks_for(end) - static_cast<std::int64_t>(s.table.blocks.size());
    if (!make_room(needed, asks)) {
      forget(r.id);
      return nullptr;
    }
    blocks_.reserve(s.table, end);
    return &s;
  }

  static std::vector<std::int32_t> feed_of(const RequestState& r, const BlockTable& t) {
    return {r.tokens.begin() + static_cast<std::ptrdiff_t>(t.length), r.tokens.end()};
  }

  // Drops whole sequences until `needed` blocks are free, in eviction order (the least
  // recently asked first, the smaller id among equals), never one an ask of this call names.
  bool make_room(std::int64_t needed, std::span<const ProposeAsk> asks) {
    while (blocks_.pool().free_blocks() < needed) {
      auto victim = sequences_.end();
      EvictionPriority first;
      for (auto it = sequences_.begin(); it != sequences_.end(); ++it) {
        const bool asked = std::any_of(asks.begin(), asks.end(), [&](const ProposeAsk& a) {
          return a.request->id == it->first;
        });
        const EvictionPriority p = eviction_priority(EvictionOrder::lru, {it->second.last_used, 1});
        if (!asked && !it->second.table.blocks.empty() &&
            (victim == sequences_.end() || p < first)) {
          victim = it;
          first = p;
        }
      }
      if (victim == sequences_.end()) return false;
      blocks_.truncate(victim->second.table, 0);
    }
    return true;
  }

  // The j-th draft step: each sequence still proposing feeds its tokens and picks one.
  void draft_step(std::vector<Drafting>& drafting, std::int64_t j) {
    std::vector<BatchEntry> batch;
    std::vector<Drafting*> in_batch;
    for (Drafting& d : drafting) {
      if (d.ask->max_tokens <= j || static_cast<std::int64_t>(d.ask->proposed->size()) < j)
        continue;  // done, or stopped at a row without a pick
      BatchEntry entry;
      entry.start_position = d.sequence->table.length;
      blocks_.append(d.sequence->table, d.feed);  // into the room catch_up held
      entry.tokens = d.feed;
      entry.view = d.sequence->table.view;
      batch.push_back(std::move(entry));
      in_batch.push_back(&d);
    }
    if (batch.empty()) return;
    const std::vector<TokenChoice> greedy(batch.size());  // temperature 0: the argmax
    const ForwardResult result = draft_.forward(batch, greedy);
    for (std::size_t e = 0; e < in_batch.size(); ++e) {
      Drafting& d = *in_batch[e];
      const std::int32_t pick = pick_of(result, e);
      if (pick < 0) continue;  // a non-finite row: no more proposals for it
      d.ask->proposed->push_back(pick);
      d.feed.assign(1, pick);
    }
  }

  // The draft's greedy token for row e: its own choice, or the argmax of the logits it returned.
  std::int32_t pick_of(const ForwardResult& result, std::size_t e) const {
    if (!result.tokens.empty()) return result.tokens[e];
    const auto vocab = static_cast<std::size_t>(draft_.vocab_size());
    const auto row = result.logits.subspan(e * vocab, vocab);
    const auto best = std::max_element(row.begin(), row.end());
    return std::isfinite(*best) ? static_cast<std::int32_t>(best - row.begin()) : -1;
  }

  PagedBlocks blocks_;  // the draft's pool, as blocks
  Backend& draft_;
  std::map<RequestId, DraftSequence> sequences_;
  std::uint64_t calls_ = 0;
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::proposer, DraftProposer, "draft",
             "a draft model proposes greedily, its K/V in a pool of its own: a second model "
             "([speculation] draft_model) or the target's first layers (draft_layers)",
             kvlab::kNoParams)
