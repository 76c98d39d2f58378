// Prompt lookup (kvlab/speculation/prompt_lookup.hpp): the longest suffix's most recent earlier
// occurrence gives the proposal; shorter suffixes are tried when longer ones do not occur.
#include <gtest/gtest.h>

#include "kvlab/speculation/prompt_lookup.hpp"

namespace kvlab {
namespace {

using Tokens = std::vector<std::int32_t>;

TEST(PromptLookup, ProposesWhatFollowedTheLongestSuffix) {
  // The 3-token suffix {9, 2, 3} never occurred; {2, 3} did, at 1: what followed it.
  const Tokens tokens{1, 2, 3, 4, 5, 6, 9, 2, 3};
  EXPECT_EQ(prompt_lookup(tokens, {1, 3}, 3), (Tokens{4, 5, 6}));
  EXPECT_EQ(prompt_lookup(tokens, {1, 3}, 100), (Tokens{4, 5, 6, 9, 2, 3}))
      << "up to the sequence's end";
  EXPECT_EQ(prompt_lookup(tokens, {3, 3}, 3), Tokens{}) << "only 3-grams: none occurred";
}

TEST(PromptLookup, TheLongerMatchWinsOverTheMoreRecentShorterOne) {
  // {7, 8} occurred at 0 (followed by 1) and {8} more recently at 5 (followed by 2).
  const Tokens tokens{7, 8, 1, 0, 0, 8, 2, 7, 8};
  EXPECT_EQ(prompt_lookup(tokens, {1, 2}, 1), (Tokens{1}));
  EXPECT_EQ(prompt_lookup(tokens, {1, 1}, 1), (Tokens{2})) << "1-grams only: the most recent";
}

TEST(PromptLookup, TheMostRecentOccurrenceIsTaken) {
  const Tokens tokens{5, 6, 1, 5, 6, 2, 5, 6};
  EXPECT_EQ(prompt_lookup(tokens, {2, 2}, 2), (Tokens{2, 5}));
}

TEST(PromptLookup, NothingToProposeGivesNothing) {
  EXPECT_EQ(prompt_lookup(Tokens{}, {1, 3}, 4), Tokens{});
  EXPECT_EQ(prompt_lookup(Tokens{4}, {1, 3}, 4), Tokens{});
  EXPECT_EQ(prompt_lookup(Tokens{1, 2, 3}, {1, 3}, 4), Tokens{}) << "no token repeats";
  EXPECT_EQ(prompt_lookup(Tokens{1, 1}, {1, 3}, 0), Tokens{}) << "nothing asked";
  EXPECT_EQ(prompt_lookup(Tokens{1, 1}, {1, 3}, 4), (Tokens{1})) << "a run: the last token";
}

}  // namespace
}  // namespace kvlab
