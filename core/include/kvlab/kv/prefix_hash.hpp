#pragma once
// Prefix-cache block hashes: a full block of `block_size` tokens is named by a chained hash of
// its tokens and of every token before it (h_i = H(h_{i-1}, tokens of block i)), so equal hashes
// mean equal prefixes (up to collisions, which a cache checks against the block's tokens).
// A request keeps its prompt's hashes (PrefixHashCache, in RequestState): they are computed once,
// when an allocator first looks the request up, not on every lookup (vLLM's Request.block_hashes).
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace kvlab {

// Never 0 (0 means "no hash").
std::uint64_t chain_block_hash(std::uint64_t previous, std::span<const std::int32_t> block);

struct PrefixHashCache {
  std::int64_t block_size = 0;        // of the hashes below; another block size starts over
  std::vector<std::uint64_t> hashes;  // chain hashes of the first hashes.size() full blocks
  // Where the chain starts: 0, or the request's cache salt (cache_salt_hash): requests with
  // different salts never share a block, whatever their tokens (vLLM's cache_salt).
  std::uint64_t salt = 0;
};

// A cache salt's chain start: 0 for "" (no salt), else a 64-bit hash of its bytes (never 0).
std::uint64_t cache_salt_hash(std::string_view salt);

// The chain hashes of the first `blocks` full blocks of `tokens`, extending `cache` (whose
// hashes must be of a prefix of these tokens: a request's tokens only grow at the end) when
// given, else computed into `scratch`. The span is into the cache (or scratch): valid until
// either changes.
std::span<const std::uint64_t> prefix_block_hashes(std::span<const std::int32_t> tokens,
                                                   std::int64_t block_size, std::int64_t blocks,
                                                   PrefixHashCache* cache,
                                                   std::vector<std::uint64_t>& scratch);

}  // namespace kvlab
