#pragma once
// The backend every run wraps its own in: times Backend::forward (to report how much of a run is
// spent outside it) and counts the forwards whose tokens the backend picked itself
// (ForwardResult::tokens), passing everything else (counters included) through unchanged.
#include <chrono>
#include <cstdint>
#include <span>

#include "kvlab/backend.hpp"

namespace kvlab {

class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : inner_(inner) {}
  ForwardResult forward(std::span<const BatchEntry> batch,
                        std::span<const TokenChoice> choices) override {
    const auto start = std::chrono::steady_clock::now();
    const ForwardResult result = inner_.forward(batch, choices);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++forwards_;
    if (!result.tokens.empty()) ++chose_tokens_;
    return result;
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  BackendCounters counters() const override { return inner_.counters(); }
  std::string description() const override { return inner_.description(); }
  double seconds() const { return seconds_; }
  std::int64_t forwards() const { return forwards_; }
  // Forwards after which the backend returned token ids instead of logits.
  std::int64_t forwards_with_chosen_tokens() const { return chose_tokens_; }

 private:
  Backend& inner_;
  double seconds_ = 0;
  std::int64_t forwards_ = 0, chose_tokens_ = 0;
};

}  // namespace kvlab
