#include "kvlab/speculation/prompt_lookup.hpp"

#include <algorithm>

namespace kvlab {
namespace {

// The most recent start i < end - n of the n-token suffix of `tokens` (an occurrence that is not
// the suffix itself), or -1.
std::int64_t last_earlier_occurrence(std::span<const std::int32_t> tokens, std::int64_t n) {
  const auto end = static_cast<std::int64_t>(tokens.size());
  const auto suffix = tokens.subspan(static_cast<std::size_t>(end - n));
  for (std::int64_t i = end - n - 1; i >= 0; --i)
    if (std::equal(suffix.begin(), suffix.end(), tokens.begin() + i)) return i;
  return -1;
}

}  // namespace

std::vector<std::int32_t> prompt_lookup(std::span<const std::int32_t> tokens,
                                        const PromptLookup& lookup, std::int64_t max_tokens) {
  const auto length = static_cast<std::int64_t>(tokens.size());
  if (max_tokens <= 0 || lookup.min_ngram <= 0) return {};
  for (std::int64_t n = std::min(lookup.max_ngram, length - 1); n >= lookup.min_ngram; --n) {
    const std::int64_t at = last_earlier_occurrence(tokens, n);
    if (at < 0) continue;
    const std::int64_t from = at + n, to = std::min(length, from + max_tokens);
    return {tokens.begin() + from, tokens.begin() + to};
  }
  return {};
}

}  // namespace kvlab
