#pragma once
// Prompt lookup decoding (Saxena 2023; transformers' prompt_lookup_num_tokens, vLLM's n-gram
// proposer, llama.cpp's lookup decoding): a speculative proposal without a second model. The
// sequence's last n tokens (n from max_ngram down to min_ngram) are looked for earlier in the
// sequence (the prompt and the output so far); the tokens that followed their most recent
// earlier occurrence are proposed. Input-grounded tasks (summarise, edit or quote a given text)
// repeat spans of their prompt, which is where this finds long matches.
//
//   tokens: ... a b c x y z ... a b c | proposal: x y z (up to max_tokens)
#include <cstdint>
#include <span>
#include <vector>

namespace kvlab {

struct PromptLookup {
  std::int64_t min_ngram = 1;  // the shortest suffix matched
  std::int64_t max_ngram = 3;  // the longest, tried first
};

// Up to `max_tokens` tokens that followed the longest matched suffix's most recent earlier
// occurrence (they may run into the suffix itself, never past the sequence's end); empty when
// no suffix of min_ngram..max_ngram tokens occurs earlier.
std::vector<std::int32_t> prompt_lookup(std::span<const std::int32_t> tokens,
                                        const PromptLookup& lookup, std::int64_t max_tokens);

}  // namespace kvlab
