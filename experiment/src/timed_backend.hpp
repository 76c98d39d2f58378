#pragma once
// The backend every run wraps its own in: times Backend::forward (to report how much of a run is
// spent outside it) and counts the forwards whose tokens the backend picked itself
// (Backend::choose_tokens), passing everything else (counters included) through unchanged.
#include <chrono>
#include <cstdint>
#include <span>

#include "kvlab/backend.hpp"

namespace kvlab {

class TimedBackend final : public Backend {
 public:
  explicit TimedBackend(Backend& inner) : inner_(inner) {}
  std::span<const float> forward(std::span<const BatchEntry> batch) override {
    const auto start = std::chrono::steady_clock::now();
    const auto logits = inner_.forward(batch);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++forwards_;
    if (!inner_.chosen_tokens().empty()) ++chose_tokens_;
    return logits;
  }
  std::int64_t vocab_size() const override { return inner_.vocab_size(); }
  std::span<const std::int32_t> chosen_tokens() const override { return inner_.chosen_tokens(); }
  std::span<const TokenLogprob> chosen_logprobs() const override {
    return inner_.chosen_logprobs();
  }
  bool choose_tokens(std::span<const TokenChoice> choices) override {
    return inner_.choose_tokens(choices);
  }
  BackendCounters counters() const override { return inner_.counters(); }
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
