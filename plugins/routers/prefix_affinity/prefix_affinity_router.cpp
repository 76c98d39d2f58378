// prefix_affinity: send a request where its prompt's prefix was sent before, so that the
// replica's prefix cache holds it (SGLang's cache-aware router, Preble). The router keeps its
// own index of prompt blocks — named by the chain hash the paged prefix cache names them by
// (kvlab/kv/prefix_hash.hpp) — and every replica each was sent to (SGLang's radix tree keeps a
// tenant set per node likewise); a request goes to the replica holding its longest run of leading
// blocks. Load still counts: when that replica's queued
// tokens exceed the least loaded one's by more than `max_imbalance_tokens`, or no block
// matches, the request goes to the least loaded replica instead.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <deque>
#include <vector>

#include "kvlab/kv/block_pool.hpp"
#include "kvlab/kv/prefix_hash.hpp"
#include "kvlab/plugin.hpp"

namespace {

class PrefixAffinityRouter final : public kvlab::Router {
 public:
  PrefixAffinityRouter(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : block_size_(static_cast<std::size_t>(params.integer("block_size"))),
        max_imbalance_(params.integer("max_imbalance_tokens")),
        max_blocks_(static_cast<std::size_t>(params.integer("max_blocks"))) {}

  kvlab::RouteDecision route(const kvlab::RouteRequest& request,
                             std::span<const kvlab::ReplicaLoad> replicas) override {
    if (words_ == 0) words_ = (replicas.size() + 63) / 64;  // the cluster's size is fixed
    const std::vector<std::uint64_t> blocks = block_hashes(request.prompt);
    const std::vector<std::size_t> matched = leading_blocks(blocks, replicas.size());
    std::size_t least = 0, best = 0;
    for (std::size_t r = 1; r < replicas.size(); ++r) {
      if (replicas[r].queued_tokens < replicas[least].queued_tokens) least = r;
      // The longest run; among equal runs the least loaded (a prefix sent to several).
      if (matched[r] > matched[best] ||
          (matched[r] == matched[best] && replicas[r].queued_tokens < replicas[best].queued_tokens))
        best = r;
    }
    kvlab::RouteDecision decision;
    if (matched[best] == 0) {
      decision = {least, fmt::format("no cached prefix: least loaded ({} queued tokens)",
                                     replicas[least].queued_tokens)};
    } else if (replicas[best].queued_tokens - replicas[least].queued_tokens > max_imbalance_) {
      decision = {least,
                  fmt::format("prefix of {} blocks on replica {}, but it has {} more "
                              "queued tokens than replica {}: least loaded",
                              matched[best], best,
                              replicas[best].queued_tokens - replicas[least].queued_tokens, least)};
    } else {
      decision = {best, fmt::format("prefix affinity: {} of {} prompt blocks sent here before",
                                    matched[best], blocks.size())};
    }
    remember(blocks, decision.replica);
    return decision;
  }

 private:
  // The prompt's full blocks named as the replicas' paged prefix caches name them
  // (chain_block_hash: block k's hash covers every token before its end; never 0, the index's
  // empty key).
  std::vector<std::uint64_t> block_hashes(std::span<const std::int32_t> prompt) const {
    std::vector<std::uint64_t> hashes;  // (prefix_block_hashes' scratch: exactly the blocks')
    (void)kvlab::prefix_block_hashes(prompt, static_cast<std::int64_t>(block_size_),
                                     static_cast<std::int64_t>(prompt.size() / block_size_),
                                     nullptr, hashes);
    return hashes;
  }

  // Each replica's run of leading blocks it was sent: one pass, the replicas still running as a
  // bit set (a prefix every replica shares, a system prompt, does not end anyone's run).
  std::vector<std::size_t> leading_blocks(const std::vector<std::uint64_t>& blocks,
                                          std::size_t replicas) const {
    std::vector<std::size_t> matched(replicas, 0);
    std::vector<std::uint64_t> running(words_, ~std::uint64_t{0});
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (i + kPrefetchAhead < blocks.size()) slot_.prefetch(blocks[i + kPrefetchAhead]);
      const std::optional<kvlab::BlockId> slot = slot_.find(blocks[i]);
      if (!slot) break;
      bool any = false;
      for (std::size_t w = 0; w < words_; ++w) {
        running[w] &= sent_[static_cast<std::size_t>(*slot) * words_ + w];
        for (std::uint64_t bits = running[w]; bits != 0; bits &= bits - 1)
          ++matched[w * 64 + static_cast<std::size_t>(std::countr_zero(bits))];
        any = any || running[w] != 0;
      }
      if (!any) break;
    }
    return matched;
  }

  // Each block was now sent to `replica` too; the oldest blocks go past max_blocks.
  void remember(const std::vector<std::uint64_t>& blocks, std::size_t replica) {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (i + kPrefetchAhead < blocks.size()) slot_.prefetch(blocks[i + kPrefetchAhead]);
      const std::uint64_t h = blocks[i];
      const kvlab::BlockId slot = slot_.find_or_insert_growing(h, [&] {
        order_.push_back(h);
        return static_cast<kvlab::BlockId>(take_slot());
      });
      sent_[static_cast<std::size_t>(slot) * words_ + replica / 64] |= std::uint64_t{1}
                                                                       << (replica % 64);
      while (order_.size() > max_blocks_) {
        free_slots_.push_back(static_cast<std::size_t>(*slot_.find(order_.front())));
        slot_.erase(order_.front());
        order_.pop_front();
      }
    }
  }

  std::size_t take_slot() {
    if (!free_slots_.empty()) {
      const std::size_t s = free_slots_.back();
      free_slots_.pop_back();
      std::fill_n(sent_.begin() + static_cast<std::ptrdiff_t>(s * words_), words_, 0);
      return s;
    }
    sent_.resize(sent_.size() + words_, 0);
    return sent_.size() / words_ - 1;
  }

  // Index probes issued this many blocks ahead: a long prompt's blocks miss the cache each.
  static constexpr std::size_t kPrefetchAhead = 8;
  std::size_t block_size_;
  std::int64_t max_imbalance_;
  std::size_t max_blocks_;
  std::size_t words_ = 0;            // 64 replicas a word
  kvlab::BlockHashIndex slot_;       // block hash -> its row of sent_ (open addressing, grows)
  std::vector<std::uint64_t> sent_;  // (slots, words_): the replicas each block was sent to
  std::vector<std::size_t> free_slots_;
  std::deque<std::uint64_t> order_;  // insertion order, for forgetting the oldest
};

const kvlab::ParamSpec kParams[] = {
    {"block_size", kvlab::ParamType::param_integer,
     "tokens per hashed prompt block (as the replicas' paged prefix cache)", "16", 1, 4096},
    {"max_imbalance_tokens", kvlab::ParamType::param_integer,
     "queued tokens the prefix's replica may have above the least loaded one before the "
     "request goes to the least loaded instead",
     "8192", 0, 1e12},
    {"max_blocks", kvlab::ParamType::param_integer,
     "prompt blocks the router remembers (oldest forgotten first)", "1000000", 1, 1e9}};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::router, PrefixAffinityRouter, "prefix_affinity",
             "the replica that received the prompt's longest prefix, unless it is overloaded",
             kParams)
