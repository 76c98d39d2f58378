// A GGUF file's byte-level BPE tokenizer (tokenizer.ggml.model "gpt2"): vocabulary, merges and
// token types from the metadata, the pre-tokenizer from tokenizer.ggml.pre by the names
// llama.cpp's convert_hf_to_gguf.py writes.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <string_view>

#include "byte_level_bpe.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"

namespace kvlab {
namespace {

// llama_token_type (llama.cpp): what a token type means for encoding.
constexpr std::int64_t kTokenControl = 3;
constexpr std::int64_t kTokenUserDefined = 4;

struct PreTokenizer {
  std::string_view name;
  std::vector<std::string> regexes;
  bool nfc = false;
  bool ignore_merges = false;
};

// The pre-tokenizers of the model families kvlab tokenizes, as Hugging Face's tokenizer.json of
// each declares them (Qwen2's NFC normalizer included, which llama.cpp leaves out).
std::optional<PreTokenizer> pre_tokenizer(std::string_view name) {
  static constexpr std::array gpt2_names = {"default", "gpt2", "gpt-2"};
  static constexpr std::array digit_names = {"smollm",    "starcoder", "refact", "command-r",
                                             "codeshell", "exaone",    "minerva"};
  for (std::string_view n : gpt2_names)
    if (n == name) return PreTokenizer{name, {kGpt2SplitRegex}};
  for (std::string_view n : digit_names)  // every digit on its own, then GPT-2's split
    if (n == name) return PreTokenizer{name, {R"(\p{N})", kGpt2SplitRegex}};
  if (name == "llama3" || name == "llama-bpe" || name == "llama-v3")
    return PreTokenizer{name, {kLlama3SplitRegex}, false, true};
  if (name == "qwen2" || name == "deepseek-r1-qwen")
    return PreTokenizer{name, {kQwen2SplitRegex}, true, false};
  return std::nullopt;
}

const GgufArray& array_of(const GgufFile& file, std::string_view key) {
  const GgufValue* value = file.find_metadata(key);
  if (value == nullptr || value->as_array() == nullptr)
    throw Error(fmt::format("{}: tokenizer needs the array {}", file.path().string(), key));
  return *value->as_array();
}

std::vector<std::string> strings_of(const GgufFile& file, std::string_view key) {
  std::vector<std::string> out;
  const GgufArray& array = array_of(file, key);
  if (static_cast<std::int64_t>(array.size()) >= kMaxTokenizerVocab * 4)
    throw Error(fmt::format("{}: {} has {} entries", file.path().string(), key, array.size()));
  out.reserve(array.size());
  for (std::size_t i = 0; i < array.size(); ++i) {
    const std::string* text = array[i].as_string();
    if (text == nullptr)
      throw Error(fmt::format("{}: {}[{}] is not a string", file.path().string(), key, i));
    out.push_back(*text);
  }
  return out;
}

std::optional<std::int32_t> token_id_of(const GgufFile& file, std::string_view key,
                                        std::size_t vocab) {
  const GgufValue* value = file.find_metadata(key);
  if (value == nullptr) return std::nullopt;
  const auto id = value->as_int();
  if (!id || *id < 0 || static_cast<std::size_t>(*id) >= vocab)
    throw Error(fmt::format("{}: {} = {} is not a token id of the {}-token vocabulary",
                            file.path().string(), key, value->to_string(), vocab));
  return static_cast<std::int32_t>(*id);
}

// tokenizer.ggml.pre, "default" when absent; another type than a string is refused, not read as
// absent (GPT-2 splitting would tokenize the model's text differently without a word).
std::string pre_tokenizer_name(const GgufFile& file, const std::string& origin) {
  const GgufValue* value = file.find_metadata("tokenizer.ggml.pre");
  if (value == nullptr) return "default";
  if (value->as_string() == nullptr)
    throw Error(
        fmt::format("{}: tokenizer.ggml.pre must be a string naming the pre-tokenizer, "
                    "got {}",
                    origin, value->to_string()));
  return *value->as_string();
}

}  // namespace

std::unique_ptr<Tokenizer> gguf_tokenizer(const GgufFile& file) {
  const std::string origin = file.path().string();
  ByteLevelBpeSpec spec;
  spec.origin = origin;
  spec.tokens = strings_of(file, "tokenizer.ggml.tokens");
  if (spec.tokens.empty() || static_cast<std::int64_t>(spec.tokens.size()) > kMaxTokenizerVocab)
    throw Error(fmt::format("{}: tokenizer.ggml.tokens has {} tokens", origin, spec.tokens.size()));
  for (std::string& merge : strings_of(file, "tokenizer.ggml.merges")) {
    const std::size_t space = merge.find(' ', 1);
    if (space == std::string::npos || space + 1 >= merge.size())
      throw Error(fmt::format("{}: merge \"{}\" is not \"left right\"", origin, merge));
    spec.merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
  }
  if (file.find_metadata("tokenizer.ggml.token_type") != nullptr) {
    const GgufArray& types = array_of(file, "tokenizer.ggml.token_type");
    if (types.size() != spec.tokens.size())
      throw Error(fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", origin,
                              types.size(), spec.tokens.size()));
    for (std::size_t id = 0; id < types.size(); ++id) {
      const auto type = types[id].as_int();
      if (type == kTokenControl || type == kTokenUserDefined)
        spec.added.push_back({spec.tokens[id], static_cast<std::int32_t>(id)});
    }
  }
  const std::string pre_name = pre_tokenizer_name(file, origin);
  const auto pre = pre_tokenizer(pre_name);
  if (!pre)
    throw Error(fmt::format(
        "{}: tokenizer.ggml.pre \"{}\" is not a pre-tokenizer kvlab knows (default, gpt2, "
        "llama-bpe, qwen2, smollm, starcoder, refact, command-r, codeshell, exaone, minerva)",
        origin, pre_name));
  spec.split_regexes = pre->regexes;
  spec.nfc = pre->nfc;
  spec.ignore_merges = pre->ignore_merges;
  spec.description =
      fmt::format("byte-level BPE from GGUF ({} pre-tokenizer, {} tokens, {} merges)", pre_name,
                  spec.tokens.size(), spec.merges.size());
  spec.unk = token_id_of(file, "tokenizer.ggml.unknown_token_id", spec.tokens.size());
  spec.bos = token_id_of(file, "tokenizer.ggml.bos_token_id", spec.tokens.size());
  spec.eos = token_id_of(file, "tokenizer.ggml.eos_token_id", spec.tokens.size());
  if (const GgufValue* add_bos = file.find_metadata("tokenizer.ggml.add_bos_token"))
    spec.add_bos = std::get_if<bool>(&add_bos->value) != nullptr && std::get<bool>(add_bos->value);
  if (const GgufValue* add_eos = file.find_metadata("tokenizer.ggml.add_eos_token"))
    spec.add_eos = std::get_if<bool>(&add_eos->value) != nullptr && std::get<bool>(add_eos->value);
  if (const GgufValue* prefix = file.find_metadata("tokenizer.ggml.add_space_prefix");
      prefix != nullptr && std::get_if<bool>(&prefix->value) && std::get<bool>(prefix->value))
    throw Error(
        fmt::format("{}: tokenizer.ggml.add_space_prefix = true is not supported for "
                    "byte-level BPE",
                    origin));
  return make_byte_level_bpe(std::move(spec));
}

}  // namespace kvlab
