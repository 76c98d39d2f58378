#pragma once
// Arithmetic on sizes that come from input (config files, checkpoints, CLI, traces): every
// product or sum that could overflow is computed here and fails as std::nullopt instead of
// wrapping, so the caller can name the field that made it too large.
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

namespace kvlab {

// `value` converted to T when it fits exactly; std::nullopt otherwise (2^32 + 1 is no int32).
template <std::integral T, std::integral V>
constexpr std::optional<T> narrow_integer(V value) {
  if (!std::in_range<T>(value)) return std::nullopt;
  return static_cast<T>(value);
}

// a * b, or std::nullopt when it overflows T.
template <std::integral T>
constexpr std::optional<T> checked_mul(T a, T b) {
  T out{};
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// a + b, or std::nullopt when it overflows T.
template <std::integral T>
constexpr std::optional<T> checked_add(T a, T b) {
  T out{};
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of all `factors`, or std::nullopt when any step overflows T.
template <std::integral T>
constexpr std::optional<T> checked_product(std::initializer_list<T> factors) {
  T out = 1;
  for (T f : factors)
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  return out;
}

}  // namespace kvlab
