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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"

namespace {

using namespace kvlab;

constexpr std::int64_t kBlock = 16;  // slots a block of the draft's pool

// One sequence in the draft's cache: the tokens whose K/V it holds, in the blocks it owns.
struct DraftSequence {
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> blocks;  // block b holds slots [b * kBlock, (b + 1) * kBlock)
  std::int64_t last_used = 0;        // the propose() call that last asked for it
};

// A decode being proposed for this call: what to feed next, and where the picks go.
struct Drafting {
  const ProposeAsk* ask;
  DraftSequence* sequence;
  std::vector<std::int32_t> feed;
};

Backend& draft_of(const PluginContext& context) {
  if (context.draft == nullptr || context.pool == nullptr)
    throw Error(
        "draft proposer: no draft model to run: give [speculation] draft_model (a model with the "
        "target's vocabulary) or draft_layers (the target's first layers)");
  return *context.draft;
}

class DraftProposer final : public Proposer {
 public:
  DraftProposer(const PluginParams&, const PluginContext& context)
      : draft_(draft_of(context)), blocks_(context.pool->shape().slots / kBlock) {
    for (std::int64_t b = blocks_ - 1; b >= 0; --b) free_.push_back(b);
  }

  void propose(std::span<const ProposeAsk> asks) override {
    ++calls_;
    std::vector<Drafting> drafting;
    for (const ProposeAsk& ask : asks)
      if (DraftSequence* sequence = catch_up(ask, asks))
        drafting.push_back({&ask, sequence, feed_of(*ask.request, *sequence)});
    std::int64_t longest = 0;
    for (const Drafting& d : drafting) longest = std::max(longest, d.ask->max_tokens);
    for (std::int64_t j = 0; j < longest; ++j) draft_step(drafting, j);
  }

  void forget(RequestId id) override {
    if (const auto it = sequences_.find(id); it != sequences_.end()) {
      release(it->second, 0);
      sequences_.erase(it);
    }
  }

 private:
  // The request's draft sequence cut back to the tokens it shares with the verified ones (all
  // but the newest, which is fed so that its row gives the first pick), with blocks for what
  // this call feeds; null when the pool cannot hold them even after evicting the sequences no
  // ask of this call names (the request then gets no proposals this step).
  DraftSequence* catch_up(const ProposeAsk& ask, std::span<const ProposeAsk> asks) {
    const RequestState& r = *ask.request;
    DraftSequence& s = sequences_[r.id];
    s.last_used = calls_;
    const auto limit = static_cast<std::ptrdiff_t>(std::min(s.tokens.size(), r.tokens.size() - 1));
    const auto shared = std::mismatch(s.tokens.begin(), s.tokens.begin() + limit, r.tokens.begin());
    s.tokens.erase(shared.first, s.tokens.end());
    release(s, static_cast<std::int64_t>(s.tokens.size()));
    // fed: the verified tokens it lacks, then max_tokens - 1 picks
    const std::int64_t end = r.length() + ask.max_tokens - 1;
    const std::int64_t needed =
        (end + kBlock - 1) / kBlock - static_cast<std::int64_t>(s.blocks.size());
    if (!make_room(needed, asks)) {
      forget(r.id);
      return nullptr;
    }
    for (std::int64_t b = 0; b < needed; ++b) {
      s.blocks.push_back(free_.back());
      free_.pop_back();
    }
    return &s;
  }

  static std::vector<std::int32_t> feed_of(const RequestState& r, const DraftSequence& s) {
    return {r.tokens.begin() + static_cast<std::ptrdiff_t>(s.tokens.size()), r.tokens.end()};
  }

  // Frees blocks until `needed` are free, least recently asked sequences first, never one
  // that an ask of this call names.
  bool make_room(std::int64_t needed, std::span<const ProposeAsk> asks) {
    while (static_cast<std::int64_t>(free_.size()) < needed) {
      auto victim = sequences_.end();
      for (auto it = sequences_.begin(); it != sequences_.end(); ++it) {
        const bool asked = std::any_of(asks.begin(), asks.end(), [&](const ProposeAsk& a) {
          return a.request->id == it->first;
        });
        if (!asked && !it->second.blocks.empty() &&
            (victim == sequences_.end() || it->second.last_used < victim->second.last_used))
          victim = it;
      }
      if (victim == sequences_.end()) return false;
      release(victim->second, 0);
      victim->second.tokens.clear();
    }
    return true;
  }

  // Returns the blocks past the first `tokens` tokens' to the free list.
  void release(DraftSequence& s, std::int64_t tokens) {
    const auto keep = static_cast<std::size_t>((tokens + kBlock - 1) / kBlock);
    while (s.blocks.size() > keep) {
      free_.push_back(s.blocks.back());
      s.blocks.pop_back();
    }
  }

  // The slots of the sequence's first `length` positions.
  static KvView view_of(const DraftSequence& s, std::int64_t length) {
    KvView view;
    for (std::int64_t b = 0; b * kBlock < length; ++b) {
      const std::int64_t start = s.blocks[static_cast<std::size_t>(b)] * kBlock;
      const std::int64_t count = std::min(kBlock, length - b * kBlock);
      if (!view.extents.empty() &&
          view.extents.back().start_slot + view.extents.back().length == start)
        view.extents.back().length += count;
      else
        view.extents.push_back({start, count});
    }
    return view;
  }

  // The j-th draft step: each sequence still proposing feeds its tokens and picks one.
  void draft_step(std::vector<Drafting>& drafting, std::int64_t j) {
    std::vector<BatchEntry> batch;
    std::vector<Drafting*> in_batch;
    for (Drafting& d : drafting) {
      if (d.ask->max_tokens <= j || static_cast<std::int64_t>(d.ask->proposed->size()) < j)
        continue;  // done, or stopped at a row without a pick
      BatchEntry entry;
      entry.tokens = d.feed;
      entry.start_position = static_cast<std::int64_t>(d.sequence->tokens.size());
      entry.view =
          view_of(*d.sequence, entry.start_position + static_cast<std::int64_t>(d.feed.size()));
      batch.push_back(std::move(entry));
      in_batch.push_back(&d);
    }
    if (batch.empty()) return;
    const std::vector<TokenChoice> greedy(batch.size());  // temperature 0: the argmax
    const ForwardResult result = draft_.forward(batch, greedy);
    for (std::size_t e = 0; e < in_batch.size(); ++e) {
      Drafting& d = *in_batch[e];
      d.sequence->tokens.insert(d.sequence->tokens.end(), d.feed.begin(), d.feed.end());
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

  Backend& draft_;
  std::int64_t blocks_;
  std::vector<std::int64_t> free_;
  std::map<RequestId, DraftSequence> sequences_;
  std::int64_t calls_ = 0;
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::proposer, DraftProposer, "draft",
             "a draft model proposes greedily, its K/V in a pool of its own: a second model "
             "([speculation] draft_model) or the target's first layers (draft_layers)",
             kvlab::kNoParams)
