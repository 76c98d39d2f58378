#pragma once
// SplitMix64's finaliser (Steele, Lea, Flood 2014; Vigna's splitmix64.c): a bijective 64-bit
// mix. kvlab's counter-based draws hash their inputs (a seed, ids, positions) into one word and
// mix it with this: random weights, Mooncake block tokens, the simulated backend's tokens and its
// drafter's draws are each a pure function of their inputs, the same in any order and batch.
#include <cstdint>

namespace kvlab {

constexpr std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace kvlab
