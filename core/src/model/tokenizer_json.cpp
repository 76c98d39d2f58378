// A Hugging Face tokenizer.json of a byte-level BPE model: model.vocab / model.merges, the added
// tokens, the normalizer, the pre-tokenizer and the post-processor, each checked against what
// kvlab runs; anything else is an error naming the part, never a silent difference in ids.
#include <fmt/format.h>

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "byte_level_bpe.hpp"
#include "kvlab/error.hpp"

namespace kvlab {
namespace {

using nlohmann::json;

class TokenizerJsonReader {
 public:
  explicit TokenizerJsonReader(std::string origin) : origin_(std::move(origin)) {}
  ByteLevelBpeSpec read(const json& root);

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("{}: {}", origin_, what));
  }
  const json& field(const json& object, const char* key, const char* where) const;
  void read_model(const json& model, ByteLevelBpeSpec& spec) const;
  void check_model_options(const json& model) const;
  void read_vocab(const json& vocab, ByteLevelBpeSpec& spec) const;
  void read_merge(const json& merge, ByteLevelBpeSpec& spec) const;
  void read_added_tokens(const json& added, ByteLevelBpeSpec& spec) const;
  void read_normalizer(const json& normalizer, ByteLevelBpeSpec& spec) const;
  void read_pre_tokenizer(const json& pre, ByteLevelBpeSpec& spec, bool& byte_level) const;
  void read_post_processor(const json& post, ByteLevelBpeSpec& spec) const;
  std::int32_t token_id(const json& value, const char* where) const;

  std::string origin_;
};

const json& TokenizerJsonReader::field(const json& object, const char* key,
                                       const char* where) const {
  if (!object.is_object() || !object.contains(key))
    fail(fmt::format("{} has no \"{}\"", where, key));
  return object.at(key);
}

std::int32_t TokenizerJsonReader::token_id(const json& value, const char* where) const {
  if (!value.is_number_integer() || value.get<std::int64_t>() < 0 ||
      value.get<std::int64_t>() >= kMaxTokenizerVocab)
    fail(fmt::format("{} id {} is not a token id in [0, {})", where, value.dump(),
                     kMaxTokenizerVocab));
  return value.get<std::int32_t>();
}

// Options of a byte-level BPE model kvlab does not implement are refused, not ignored.
void TokenizerJsonReader::check_model_options(const json& model) const {
  const json& type = field(model, "type", "model");
  if (type != "BPE")
    fail(fmt::format("model.type {} is not supported (kvlab reads byte-level BPE)", type.dump()));
  if (model.value("byte_fallback", false))
    fail("model.byte_fallback = true: a SentencePiece-style BPE; use the folder's tokenizer.model");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && !model[key].is_null() && model[key] != "")
      fail(fmt::format("model.{} is not supported for byte-level BPE", key));
  if (model.contains("dropout") && model["dropout"].is_number() && model["dropout"] != 0)
    fail("model.dropout makes encoding random; kvlab encodes deterministically");
}

void TokenizerJsonReader::read_vocab(const json& vocab, ByteLevelBpeSpec& spec) const {
  if (!vocab.is_object()) fail("model.vocab is not an object");
  for (const auto& [token, id_value] : vocab.items()) {
    const std::int32_t id = token_id(id_value, "model.vocab");
    if (token.empty()) fail("model.vocab has an empty token");
    if (static_cast<std::size_t>(id) >= spec.tokens.size()) spec.tokens.resize(id + 1);
    if (!spec.tokens[id].empty())
      fail(fmt::format("model.vocab gives id {} to both \"{}\" and \"{}\"", id, spec.tokens[id],
                       token));
    spec.tokens[id] = token;
  }
}

// One merge: "left right", or ["left", "right"].
void TokenizerJsonReader::read_merge(const json& merge, ByteLevelBpeSpec& spec) const {
  if (merge.is_string()) {
    const std::string text = merge.get<std::string>();
    const std::size_t space = text.find(' ', 1);
    if (space == std::string::npos || space + 1 >= text.size())
      fail(fmt::format("merge {} is not \"left right\"", merge.dump()));
    spec.merges.emplace_back(text.substr(0, space), text.substr(space + 1));
  } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
             merge[1].is_string()) {
    spec.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
  } else {
    fail(fmt::format("merge {} is neither \"left right\" nor [left, right]",
                     merge.dump().substr(0, 80)));
  }
}

void TokenizerJsonReader::read_model(const json& model, ByteLevelBpeSpec& spec) const {
  check_model_options(model);
  const json& vocab = field(model, "vocab", "model");
  read_vocab(vocab, spec);
  for (const json& merge : field(model, "merges", "model")) read_merge(merge, spec);
  spec.ignore_merges = model.value("ignore_merges", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    const std::string unk = model["unk_token"].get<std::string>();
    if (!vocab.contains(unk))
      fail(fmt::format("model.unk_token \"{}\" is not in the vocabulary", unk));
    spec.unk = vocab[unk].get<std::int32_t>();
  }
}

void TokenizerJsonReader::read_added_tokens(const json& added, ByteLevelBpeSpec& spec) const {
  if (added.is_null()) return;
  if (!added.is_array()) fail("added_tokens is not an array");
  for (const json& token : added) {
    const json& content = field(token, "content", "an added token");
    if (!content.is_string() || content.get<std::string>().empty())
      fail(fmt::format("added token {} has no text", token.dump().substr(0, 80)));
    if (token.value("single_word", false))
      fail(fmt::format("added token {} is single_word, which kvlab does not implement",
                       content.dump()));
    spec.added.push_back({content.get<std::string>(),
                          token_id(field(token, "id", "an added token"), "added token"),
                          token.value("lstrip", false), token.value("rstrip", false)});
  }
}

void TokenizerJsonReader::read_normalizer(const json& normalizer, ByteLevelBpeSpec& spec) const {
  if (normalizer.is_null()) return;
  const json& type = field(normalizer, "type", "normalizer");
  if (type == "NFC") {
    spec.nfc = true;
  } else if (type == "Sequence") {
    for (const json& inner : field(normalizer, "normalizers", "normalizer"))
      read_normalizer(inner, spec);
  } else {
    fail(fmt::format("normalizer {} is not supported (kvlab applies NFC or none)", type.dump()));
  }
}

void TokenizerJsonReader::read_pre_tokenizer(const json& pre, ByteLevelBpeSpec& spec,
                                             bool& byte_level) const {
  const json& type = field(pre, "type", "pre_tokenizer");
  if (byte_level) fail("pre_tokenizer: ByteLevel must come last");
  if (type == "Sequence") {
    for (const json& inner : field(pre, "pretokenizers", "pre_tokenizer"))
      read_pre_tokenizer(inner, spec, byte_level);
  } else if (type == "ByteLevel") {
    if (pre.value("add_prefix_space", false))
      fail("pre_tokenizer ByteLevel.add_prefix_space = true is not supported");
    if (pre.value("use_regex", true)) spec.split_regexes.emplace_back(kGpt2SplitRegex);
    byte_level = true;
  } else if (type == "Digits") {
    spec.split_regexes.emplace_back(pre.value("individual_digits", false) ? R"(\p{N})"
                                                                          : R"(\p{N}+)");
  } else if (type == "Split") {
    if (pre.value("invert", false)) fail("pre_tokenizer Split.invert = true is not supported");
    if (pre.value("behavior", std::string()) != "Isolated")
      fail(fmt::format("pre_tokenizer Split behavior {} is not supported (only Isolated)",
                       pre.value("behavior", json()).dump()));
    const json& pattern = field(pre, "pattern", "Split");
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      spec.split_regexes.push_back(pattern["Regex"].get<std::string>());
    } else if (pattern.contains("String") && pattern["String"].is_string()) {
      std::string quoted;  // the literal, every character escaped for PCRE2
      for (char c : pattern["String"].get<std::string>()) {
        if (std::isalnum(static_cast<unsigned char>(c)) == 0 &&
            static_cast<unsigned char>(c) < 0x80)
          quoted += '\\';
        quoted += c;
      }
      spec.split_regexes.push_back(quoted);
    } else {
      fail("pre_tokenizer Split.pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
    }
  } else {
    fail(
        fmt::format("pre_tokenizer {} is not supported (kvlab runs Sequence, ByteLevel, Split, "
                    "Digits)",
                    type.dump()));
  }
}

void TokenizerJsonReader::read_post_processor(const json& post, ByteLevelBpeSpec& spec) const {
  if (post.is_null()) return;
  const json& type = field(post, "type", "post_processor");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const json& inner : field(post, "processors", "post_processor"))
      read_post_processor(inner, spec);
    return;
  }
  if (type != "TemplateProcessing")
    fail(fmt::format("post_processor {} is not supported", type.dump()));
  // single: [SpecialToken]* {Sequence A} [SpecialToken]*: at most one before and one after.
  bool seen_sequence = false;
  for (const json& piece : field(post, "single", "TemplateProcessing")) {
    if (piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
    const json& ids = field(field(post, "special_tokens", "TemplateProcessing"), name.c_str(),
                            "TemplateProcessing.special_tokens")
                          .at("ids");
    if (ids.size() != 1) fail(fmt::format("TemplateProcessing token {} is not one id", name));
    const std::int32_t id = token_id(ids[0], "TemplateProcessing");
    if (!seen_sequence && !spec.add_bos) {
      spec.bos = id, spec.add_bos = true;
    } else if (seen_sequence && !spec.add_eos) {
      spec.eos = id, spec.add_eos = true;
    } else {
      fail("TemplateProcessing adds more than one token before or after the text");
    }
  }
}

ByteLevelBpeSpec TokenizerJsonReader::read(const json& root) {
  ByteLevelBpeSpec spec;
  spec.origin = origin_;
  if (!root.is_object()) fail("not a JSON object");
  read_model(field(root, "model", "tokenizer.json"), spec);
  if (root.contains("added_tokens")) read_added_tokens(root["added_tokens"], spec);
  if (root.contains("normalizer")) read_normalizer(root["normalizer"], spec);
  bool byte_level = false;
  if (root.contains("pre_tokenizer") && !root["pre_tokenizer"].is_null())
    read_pre_tokenizer(root["pre_tokenizer"], spec, byte_level);
  if (!byte_level)
    fail(
        "pre_tokenizer has no ByteLevel step: not a byte-level BPE (for a SentencePiece model "
        "use its tokenizer.model)");
  if (root.contains("post_processor")) read_post_processor(root["post_processor"], spec);
  spec.description = fmt::format("byte-level BPE from tokenizer.json ({} tokens, {} merges{})",
                                 spec.tokens.size(), spec.merges.size(), spec.nfc ? ", NFC" : "");
  return spec;
}

}  // namespace

std::unique_ptr<Tokenizer> open_tokenizer_json(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot open {}", file.string()));
  std::stringstream text;
  text << in.rdbuf();
  json root;
  try {
    root = json::parse(text.str());
    return make_byte_level_bpe(TokenizerJsonReader(file.string()).read(root));
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: not a valid tokenizer.json: {}", file.string(), e.what()));
  }
}

}  // namespace kvlab
