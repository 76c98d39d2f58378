#pragma once
// What the workload sources share (internal): one 64-bit stream of draws with explicit
// transforms, random prompt tokens from it, and the memory budget of a workload's prompts.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"

namespace kvlab::detail {

// Draws from one 64-bit stream with explicit transforms (not <random>'s implementation-defined
// distributions), so a spec and seed give the same workload with any standard library.
class Draw {
 public:
  explicit Draw(std::uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double open_uniform() {
    return (static_cast<double>(engine_() >> 11) + 0.5) * 0x1.0p-53;
  }                  // (0, 1)
  double normal() {  // Box-Muller
    return std::sqrt(-2.0 * std::log(open_uniform())) *
           std::cos(2.0 * std::numbers::pi * uniform());
  }
  double exponential(double rate) { return -std::log(open_uniform()) / rate; }
  double gamma(double shape) {  // Marsaglia-Tsang, with the boost for shape < 1
    if (shape < 1.0) return gamma(shape + 1.0) * std::pow(open_uniform(), 1.0 / shape);
    const double d = shape - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
    while (true) {
      double x, v;
      do {
        x = normal();
        v = 1.0 + c * x;
      } while (v <= 0);
      v = v * v * v;
      const double u = open_uniform();
      if (std::log(u) < 0.5 * x * x + d - d * v + d * std::log(v)) return d * v;
    }
  }
  std::uint64_t bits() { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

// Every prompt token a workload holds, checked against the machine's memory as they accumulate
// (before each allocation), so 10^7 requests of 10^6 tokens fail with the fields, not bad_alloc.
class PromptBudget {
 public:
  void add(std::int64_t tokens, const char* what) {
    total_ += tokens;
    if (static_cast<std::uint64_t>(total_) * sizeof(std::int32_t) > limit_)
      throw Error(
          fmt::format("{} reach {} tokens, more than half of what this machine can hold "
                      "({:.1f} GiB)",
                      what, total_, static_cast<double>(2 * limit_) / (1 << 30)));
  }

 private:
  std::int64_t total_ = 0;
  std::uint64_t limit_ = allocatable_bytes() / 2;  // prompts are not all a run holds
};

inline std::vector<std::int32_t> random_tokens(std::int64_t count, std::int64_t vocab, Draw& draw) {
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(count));
  for (auto& t : tokens)
    t = static_cast<std::int32_t>(draw.bits() % static_cast<std::uint64_t>(vocab));
  return tokens;
}

}  // namespace kvlab::detail
