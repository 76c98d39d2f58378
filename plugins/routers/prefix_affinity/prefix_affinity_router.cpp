// prefix_affinity: send a request where its prompt's prefix was sent before, so that the
// replica's prefix cache holds it (SGLang's cache-aware router, Preble). The router keeps its
// own index of prompt blocks — chained hashes of each `block_size` tokens, the way paged prefix
// caches name blocks — and which replica last received each; a request goes to the replica
// holding its longest run of leading blocks. Load still counts: when that replica's queued
// tokens exceed the least loaded one's by more than `max_imbalance_tokens`, or no block
// matches, the request goes to the least loaded replica instead.
#include <fmt/format.h>

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

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
    const std::vector<std::uint64_t> blocks = block_hashes(request.prompt);
    // Leading blocks one replica holds: only the first block's owner can hold any, so one pass.
    std::size_t best = 0, matched = 0;
    for (const std::uint64_t h : blocks) {
      const auto it = owner_.find(h);
      if (it == owner_.end() || (matched > 0 && it->second != best) ||
          it->second >= replicas.size())
        break;
      best = it->second;
      ++matched;
    }
    std::size_t least = 0;
    for (std::size_t r = 1; r < replicas.size(); ++r)
      if (replicas[r].queued_tokens < replicas[least].queued_tokens) least = r;
    kvlab::RouteDecision decision;
    if (matched == 0) {
      decision = {least, fmt::format("no cached prefix: least loaded ({} queued tokens)",
                                     replicas[least].queued_tokens)};
    } else if (replicas[best].queued_tokens - replicas[least].queued_tokens > max_imbalance_) {
      decision = {least,
                  fmt::format("prefix of {} blocks on replica {}, but it has {} more "
                              "queued tokens than replica {}: least loaded",
                              matched, best,
                              replicas[best].queued_tokens - replicas[least].queued_tokens, least)};
    } else {
      decision = {best, fmt::format("prefix affinity: {} of {} prompt blocks sent here before",
                                    matched, blocks.size())};
    }
    remember(blocks, decision.replica);
    return decision;
  }

 private:
  // Chained FNV-1a over each full block: block k's hash covers every token before its end.
  std::vector<std::uint64_t> block_hashes(std::span<const std::int32_t> prompt) const {
    std::vector<std::uint64_t> hashes;
    std::uint64_t h = 14695981039346656037ull;
    for (std::size_t end = block_size_; end <= prompt.size(); end += block_size_) {
      for (std::size_t i = end - block_size_; i < end; ++i) {
        h ^= static_cast<std::uint32_t>(prompt[i]);
        h *= 1099511628211ull;
      }
      hashes.push_back(h);
    }
    return hashes;
  }

  // Each block now belongs to `replica`; the oldest entries go past max_blocks.
  void remember(const std::vector<std::uint64_t>& blocks, std::size_t replica) {
    for (const std::uint64_t h : blocks) {
      if (owner_.insert_or_assign(h, replica).second) order_.push_back(h);
      while (order_.size() > max_blocks_) {
        owner_.erase(order_.front());
        order_.pop_front();
      }
    }
  }

  std::size_t block_size_;
  std::int64_t max_imbalance_;
  std::size_t max_blocks_;
  std::unordered_map<std::uint64_t, std::size_t> owner_;  // block hash -> replica
  std::deque<std::uint64_t> order_;                       // insertion order, for eviction
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
