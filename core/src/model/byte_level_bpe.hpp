#pragma once
// Byte-level BPE (GPT-2's scheme, used by Llama-3, Qwen2, SmolLM, ...): what a tokenizer.json
// or a GGUF file declares, in one shape, and the tokenizer made from it. Private to kvlab_core.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvlab/model/tokenizer.hpp"

namespace kvlab {

// A token matched in the text as itself before pre-tokenization (<|im_start|>, <tool_call>).
struct AddedTokenSpec {
  std::string content;
  std::int32_t id = 0;
  bool lstrip = false;  // swallows the whitespace before it
  bool rstrip = false;  // ... and after it
};

// Regular expressions in the syntax Hugging Face `tokenizers` and llama.cpp write them
// (PCRE-compatible, \p{L} etc.).
inline constexpr const char* kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr const char* kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen2SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Token ids at or above this are refused as malformed input (real vocabularies: < 2^18).
inline constexpr std::int64_t kMaxTokenizerVocab = std::int64_t{1} << 24;

struct ByteLevelBpeSpec {
  std::string origin;  // the file, for error messages
  std::string description;
  // id -> the token's text in the byte-level alphabet ("Ġthe"); empty for an id with no token.
  std::vector<std::string> tokens;
  std::vector<std::pair<std::string, std::string>> merges;  // by rank, highest priority first
  std::vector<AddedTokenSpec> added;
  // Pre-tokenization: each regex splits every piece in turn; matches and the text between
  // them become pieces (Hugging Face's "Isolated" behaviour).
  std::vector<std::string> split_regexes;
  bool nfc = false;            // Unicode NFC before pre-tokenization (Qwen2)
  bool ignore_merges = false;  // a piece that is a whole token is that token (Llama-3)
  std::optional<std::int32_t> unk;
  std::optional<std::int32_t> bos;
  std::optional<std::int32_t> eos;
  bool add_bos = false;
  bool add_eos = false;
};

// Throws kvlab::Error naming spec.origin: a merge of pieces not in the vocabulary, a regex
// PCRE2 rejects, an added token id out of range.
std::unique_ptr<Tokenizer> make_byte_level_bpe(ByteLevelBpeSpec spec);

}  // namespace kvlab
