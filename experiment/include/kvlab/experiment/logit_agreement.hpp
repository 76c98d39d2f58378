#pragma once
// How close an engine's logits are to the reference's, for kvlab check --tolerance: the largest
// |engine - reference| over whole rows of the vocabulary, and how many of the reference's five
// most likely tokens are among the engine's five. If every logit is within delta of the
// reference's, the engine's argmax is within 2 x delta of the reference's best: that is the
// tolerance a rounded setting needs.
#include <array>
#include <cstdint>
#include <span>

namespace kvlab {

inline constexpr std::size_t kTopTokens = 5;
using TopTokens = std::array<std::int32_t, kTopTokens>;

// The ids of the kTopTokens largest values of `row` (at least that long), largest first, the
// lower id first among equal values. One pass.
TopTokens top_tokens(std::span<const float> row);

struct LogitAgreement {
  std::int64_t rows = 0;           // positions compared over the whole vocabulary
  double max_abs_delta = 0;        // over those rows and every token: max |engine - reference|
  double sum_row_max_delta = 0;    // over those rows, each row's max |engine - reference|
  std::int64_t top_positions = 0;  // positions whose top-5 sets were compared: every token
  std::int64_t top_shared = 0;     // over them, |engine top 5 and reference top 5 in common|

  double mean_row_max_delta() const;  // 0 when no row was compared
  double top_overlap() const;         // top_shared / (5 x top_positions); 1 when none
  // Adds one position: `engine` and `reference` are its (vocab) rows.
  void add_row(std::span<const float> engine, std::span<const float> reference);
  void add_top(const TopTokens& engine, const TopTokens& reference);
};

}  // namespace kvlab
