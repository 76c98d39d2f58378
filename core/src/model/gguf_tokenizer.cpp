// A GGUF file's byte-level BPE tokenizer (tokenizer.ggml.model "gpt2"): vocabulary, merges and
// token types from the metadata, the pre-tokenizer from tokenizer.ggml.pre by the names
// llama.cpp's convert_hf_to_gguf.py writes.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cmath>
#include <cstring>
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

bool flag_of(const GgufFile& file, std::string_view key) {
  const GgufValue* value = file.find_metadata(key);
  return value != nullptr && std::get_if<bool>(&value->value) && std::get<bool>(value->value);
}

// The few protobuf wire-format fields of sentencepiece_model.proto's ModelProto that a GGUF
// vocabulary fills (field numbers from that file). libsentencepiece reads the bytes; kvlab only
// writes them: no protobuf library or .proto copy for three messages.
class ProtoWriter {
 public:
  ProtoWriter& varint_field(int field, std::uint64_t value) {
    varint(static_cast<std::uint64_t>(field) << 3);
    return varint(value);
  }
  ProtoWriter& float_field(int field, float value) {
    varint((static_cast<std::uint64_t>(field) << 3) | 5);
    char bytes[4];
    std::memcpy(bytes, &value, 4);  // little-endian, as the wire format (x86-64)
    bytes_.append(bytes, 4);
    return *this;
  }
  ProtoWriter& bytes_field(int field, std::string_view bytes) {
    varint((static_cast<std::uint64_t>(field) << 3) | 2);
    varint(bytes.size());
    bytes_.append(bytes);
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  ProtoWriter& varint(std::uint64_t value) {
    for (; value >= 0x80; value >>= 7) bytes_.push_back(static_cast<char>((value & 0x7f) | 0x80));
    bytes_.push_back(static_cast<char>(value));
    return *this;
  }
  std::string bytes_;
};

}  // namespace

std::unique_ptr<Tokenizer> gguf_sentencepiece_tokenizer(const GgufFile& file) {
  const std::string origin = file.path().string();
  const std::vector<std::string> tokens = strings_of(file, "tokenizer.ggml.tokens");
  if (tokens.empty() || static_cast<std::int64_t>(tokens.size()) > kMaxTokenizerVocab)
    throw Error(fmt::format("{}: tokenizer.ggml.tokens has {} tokens", origin, tokens.size()));
  const GgufArray& scores = array_of(file, "tokenizer.ggml.scores");
  const GgufArray& types = array_of(file, "tokenizer.ggml.token_type");
  if (scores.size() != tokens.size() || types.size() != tokens.size())
    throw Error(fmt::format("{}: {} tokens but {} scores and {} token types", origin, tokens.size(),
                            scores.size(), types.size()));
  // SentencePiece needs its unk id's piece typed UNKNOWN; Gemma 3's GGUF types <unk> CONTROL.
  const auto unk = token_id_of(file, "tokenizer.ggml.unknown_token_id", tokens.size());
  if (!unk)
    throw Error(fmt::format("{}: a SentencePiece vocabulary needs tokenizer.ggml.unknown_token_id",
                            origin));
  ProtoWriter model;
  for (std::size_t id = 0; id < tokens.size(); ++id) {
    const auto score = scores[id].as_double();
    const auto type = types[id].as_int();
    if (!score || !std::isfinite(*score) || !type || *type < 1 || *type > 6)
      throw Error(fmt::format("{}: token {} has score {} and type {} (a finite number, 1-6)",
                              origin, id, scores[id].to_string(), types[id].to_string()));
    ProtoWriter piece;  // SentencePiece: piece = 1, score = 2, type = 3 (llama.cpp's 1-6 too)
    piece.bytes_field(1, tokens[id])
        .float_field(2, static_cast<float>(*score))
        .varint_field(3,
                      id == static_cast<std::size_t>(*unk) ? 2 : static_cast<std::uint64_t>(*type));
    model.bytes_field(1, piece.bytes());  // ModelProto.pieces = 1
  }
  // TrainerSpec (ModelProto field 2): model_type = 3 (BPE: 2), byte_fallback = 35, and the
  // special tokens by id (unk 40, bos 41, eos 42, pad 43; -1: none) and by piece (45-48:
  // SentencePiece finds them by their text, "<s>" unless told).
  const auto bos = token_id_of(file, "tokenizer.ggml.bos_token_id", tokens.size());
  const auto eos = token_id_of(file, "tokenizer.ggml.eos_token_id", tokens.size());
  const auto pad = token_id_of(file, "tokenizer.ggml.padding_token_id", tokens.size());
  ProtoWriter trainer;
  trainer.varint_field(3, 2).varint_field(35, 1);
  const std::pair<std::optional<std::int32_t>, int> specials[] = {
      {unk, 40}, {bos, 41}, {eos, 42}, {pad, 43}};
  for (const auto& [id, field] : specials) {
    trainer.varint_field(field, id ? static_cast<std::uint64_t>(*id) : ~std::uint64_t{0});
    if (id) trainer.bytes_field(field + 5, tokens[static_cast<std::size_t>(*id)]);
  }
  model.bytes_field(2, trainer.bytes());
  // NormalizerSpec (field 3): name = 1 "identity" (no character map), add_dummy_prefix = 3 as
  // llama.cpp's add_space_prefix (true when absent, SentencePiece's and llama.cpp's default),
  // remove_extra_whitespaces = 4 false, escape_whitespaces = 5 true (spaces as U+2581).
  const bool space_prefix = file.find_metadata("tokenizer.ggml.add_space_prefix") == nullptr ||
                            flag_of(file, "tokenizer.ggml.add_space_prefix");
  ProtoWriter normalizer;
  normalizer.bytes_field(1, "identity")
      .varint_field(3, space_prefix ? 1 : 0)
      .varint_field(4, 0)
      .varint_field(5, 1);
  model.bytes_field(3, normalizer.bytes());
  return sentencepiece_tokenizer_from_proto(model.bytes(), origin + " tokenizer.ggml.*",
                                            flag_of(file, "tokenizer.ggml.add_bos_token"));
}

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
