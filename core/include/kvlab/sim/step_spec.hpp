#pragma once
// A step's shape as text (kvlab cost --step): comma-separated parts, each
//   prefill=[Kx]N[@C]   K sequences (default 1) of N new tokens after C cached ones (default 0)
//   decode=BxL          B sequences of one new token after L cached ones
// e.g. "prefill=2048", "prefill=4x512@1024", "decode=32x1024", "prefill=512,decode=16x2048".
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

// At most this many sequences in one step, and this many tokens (new or cached) in one.
inline constexpr std::int64_t kMaxStepSequences = 1 << 16;
inline constexpr std::int64_t kMaxStepSequenceTokens = std::int64_t{1} << 30;

// The step's entries; kvlab::Error naming the part and what is wrong with it.
std::vector<EntryShape> parse_step_spec(std::string_view text);

}  // namespace kvlab
