#include "kvlab/sim/simulated_backend.hpp"

#include <algorithm>

#include "kvlab/error.hpp"
#include "kvlab/splitmix64.hpp"

namespace kvlab {

SimulatedBackend::SimulatedBackend(std::int64_t vocab_size, std::vector<std::int32_t> eos_token_ids)
    : vocab_size_(vocab_size), eos_(std::move(eos_token_ids)) {
  if (vocab_size_ < 2 || static_cast<std::int64_t>(eos_.size()) >= vocab_size_)
    throw Error("simulated backend: the vocabulary needs a token that is not EOS");
}

std::int32_t SimulatedBackend::token_after(std::int32_t last_token, std::int64_t position) const {
  // splitmix64 of (token, position): deterministic, independent of batch composition.
  const std::uint64_t z =
      splitmix64_mix((static_cast<std::uint64_t>(static_cast<std::uint32_t>(last_token)) << 32) ^
                     static_cast<std::uint64_t>(position) ^ 0x9e3779b97f4a7c15ULL);
  auto token = static_cast<std::int32_t>(z % static_cast<std::uint64_t>(vocab_size_));
  while (std::find(eos_.begin(), eos_.end(), token) != eos_.end())
    token = static_cast<std::int32_t>((token + 1) % vocab_size_);
  return token;
}

ForwardResult SimulatedBackend::forward(std::span<const BatchEntry> batch,
                                        std::span<const TokenChoice> /*choices*/) {
  tokens_.clear();
  for (const BatchEntry& entry : batch) {
    const auto n = static_cast<std::int64_t>(entry.tokens.size());
    if (n == 0) {
      tokens_.push_back(token_after(0, entry.start_position - 1));
      continue;
    }
    // One token after each of the entry's last logit_rows positions.
    for (std::int64_t i = std::max<std::int64_t>(0, n - entry.logit_rows); i < n; ++i)
      tokens_.push_back(
          token_after(entry.tokens[static_cast<std::size_t>(i)], entry.start_position + i));
  }
  return ForwardResult::of_tokens(tokens_);
}

}  // namespace kvlab
