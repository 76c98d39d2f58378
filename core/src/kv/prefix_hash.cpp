#include "kvlab/kv/prefix_hash.hpp"

namespace kvlab {
namespace {

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

}  // namespace

std::uint64_t chain_block_hash(std::uint64_t previous, std::span<const std::int32_t> block) {
  // Two tokens a mix: the chain of dependent multiplies is what a block's hash costs (a
  // whole-trace replay hashes every prompt token), and one 64-bit word holds two ids.
  std::uint64_t h = mix(previous + 0x9e3779b97f4a7c15ULL);
  std::size_t i = 0;
  for (; i + 1 < block.size(); i += 2)
    h = mix(h ^ (static_cast<std::uint32_t>(block[i]) |
                 static_cast<std::uint64_t>(static_cast<std::uint32_t>(block[i + 1])) << 32));
  if (i < block.size()) h = mix(h ^ static_cast<std::uint32_t>(block[i]) ^ 0xa5a5a5a500000000ULL);
  return h == 0 ? 1 : h;
}

std::uint64_t cache_salt_hash(std::string_view salt) {
  if (salt.empty()) return 0;
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a, then mixed
  for (const char c : salt) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  h = mix(h);
  return h == 0 ? 1 : h;
}

std::span<const std::uint64_t> prefix_block_hashes(std::span<const std::int32_t> tokens,
                                                   std::int64_t block_size, std::int64_t blocks,
                                                   PrefixHashCache* cache,
                                                   std::vector<std::uint64_t>& scratch) {
  std::vector<std::uint64_t>* hashes = &scratch;
  const std::uint64_t salt = cache != nullptr ? cache->salt : 0;
  if (cache != nullptr) {
    if (cache->block_size != block_size) *cache = {block_size, {}, salt};
    hashes = &cache->hashes;
  } else {
    scratch.clear();
  }
  const auto size = static_cast<std::size_t>(block_size);
  for (auto i = static_cast<std::int64_t>(hashes->size()); i < blocks; ++i)
    hashes->push_back(chain_block_hash(i == 0 ? salt : hashes->back(),
                                       tokens.subspan(static_cast<std::size_t>(i) * size, size)));
  return std::span<const std::uint64_t>(*hashes).first(static_cast<std::size_t>(blocks));
}

}  // namespace kvlab
