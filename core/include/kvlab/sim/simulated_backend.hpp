#pragma once
// The simulated backend: no math. Each step's latency comes from the CostModel (the engine's
// clock asks it); tokens are deterministic synthetic ids, never an EOS id, so every request
// runs to its workload output length. With a KvPool of KvStorage::none, the allocators and
// schedulers run unchanged on a LLaMA-70B-sized pool that is never allocated.
#include <cstdint>
#include <vector>

#include "kvlab/backend.hpp"

namespace kvlab {

class SimulatedBackend : public Backend {
 public:
  SimulatedBackend(std::int64_t vocab_size, std::vector<std::int32_t> eos_token_ids);
  // Tokens always (it has no logits): token_after each entry's last token.
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override;
  std::int64_t vocab_size() const override { return vocab_size_; }

  // The synthetic token after `last_token` at `position`: a hash, skipping EOS ids.
  std::int32_t token_after(std::int32_t last_token, std::int64_t position) const;

 private:
  std::int64_t vocab_size_;
  std::vector<std::int32_t> eos_;
  std::vector<std::int32_t> tokens_;
};

}  // namespace kvlab
