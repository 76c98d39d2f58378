#include "kvlab/model/tokenizer.hpp"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"

namespace kvlab {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& file)
      : description_("SentencePiece (tokenizer.model)") {
    const auto status = processor_.Load(file.string());
    if (!status.ok())
      throw Error(fmt::format("cannot load SentencePiece tokenizer {}: {}", file.string(),
                              status.ToString()));
    // Llama-2's convention: every prompt starts with BOS.
    if (processor_.bos_id() >= 0) bos_ = processor_.bos_id();
    if (processor_.eos_id() >= 0) eos_ = processor_.eos_id();
    add_bos_ = true;
  }
  // A serialized ModelProto (a GGUF file's vocabulary, gguf_sentencepiece.cpp).
  SentencePieceTokenizer(std::string_view model_proto, std::string source, bool add_bos)
      : description_("SentencePiece BPE (" + source + ")") {
    const auto status = processor_.LoadFromSerializedProto(model_proto);
    if (!status.ok())
      throw Error(fmt::format("cannot load the SentencePiece tokenizer of {}: {}", source,
                              status.ToString()));
    if (processor_.bos_id() >= 0) bos_ = processor_.bos_id();
    if (processor_.eos_id() >= 0) eos_ = processor_.eos_id();
    add_bos_ = add_bos;
  }

  std::vector<std::int32_t> encode(std::string_view text) const override {
    if (const std::size_t valid = valid_utf8_prefix(text); valid != text.size())
      throw Error(fmt::format("text to encode is not valid UTF-8 at byte {}", valid));
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok())
      throw Error(fmt::format("tokenizer cannot encode text: {}", status.ToString()));
    return {ids.begin(), ids.end()};
  }

  std::string decode(std::span<const std::int32_t> ids) const override {
    const int pieces = processor_.GetPieceSize();
    std::string text;
    std::vector<int> run;
    auto flush = [&] {
      if (run.empty()) return;
      std::string decoded;
      const auto status = processor_.Decode(run, &decoded);
      if (!status.ok())
        throw Error(fmt::format("tokenizer cannot decode ids: {}", status.ToString()));
      text += decoded;
      run.clear();
    };
    for (std::int32_t id : ids) {
      if (id >= 0 && id < pieces) {
        run.push_back(id);
      } else {
        flush();
        text += fmt::format("<id:{}>", id);
      }
    }
    flush();
    return text;
  }

  std::int32_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::string description() const override { return description_; }
  std::optional<std::int32_t> token_id(std::string_view token_text) const override {
    const int id = processor_.PieceToId(token_text);
    if (id == processor_.unk_id() && processor_.IdToPiece(id) != token_text) return std::nullopt;
    return id;
  }

 private:
  sentencepiece::SentencePieceProcessor processor_;
  std::string description_;
};

}  // namespace

std::unique_ptr<Tokenizer> sentencepiece_tokenizer_from_proto(std::string_view model_proto,
                                                              std::string source, bool add_bos) {
  return std::make_unique<SentencePieceTokenizer>(model_proto, std::move(source), add_bos);
}

std::vector<std::int32_t> Tokenizer::encode_prompt(std::string_view text) const {
  std::vector<std::int32_t> ids;
  if (add_bos_ && bos_) ids.push_back(*bos_);
  const auto body = encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  if (add_eos_ && eos_) ids.push_back(*eos_);
  return ids;
}

std::unique_ptr<Tokenizer> open_sentencepiece_tokenizer(const std::filesystem::path& file) {
  return std::make_unique<SentencePieceTokenizer>(file);
}

namespace {

TokenizerLookup find_gguf_tokenizer(const std::filesystem::path& path) {
  const GgufFile file = GgufFile::open(path);
  TokenizerLookup lookup;
  if (const GgufValue* chat = file.find_metadata("tokenizer.chat_template");
      chat != nullptr && chat->as_string() != nullptr)
    lookup.chat_template = *chat->as_string();
  const GgufValue* model = file.find_metadata("tokenizer.ggml.model");
  if (model == nullptr || model->as_string() == nullptr)
    lookup.why_not = fmt::format("{} has no tokenizer (no tokenizer.ggml.model)", path.string());
  else if (*model->as_string() == "llama")
    lookup.tokenizer = gguf_sentencepiece_tokenizer(file);
  else if (*model->as_string() != "gpt2")
    lookup.why_not = fmt::format(
        "{}: kvlab reads GGUF tokenizers of model \"gpt2\" (byte-level BPE) and \"llama\" "
        "(SentencePiece), not \"{}\"",
        path.string(), *model->as_string());
  else
    lookup.tokenizer = gguf_tokenizer(file);
  return lookup;
}

// tokenizer_config.json's chat_template (a string, or a list of {name, template} of which
// "default" is taken), or chat_template.jinja beside it (newer transformers).
std::string folder_chat_template(const std::filesystem::path& folder) {
  if (std::ifstream jinja(folder / "chat_template.jinja"); jinja) {
    std::stringstream text;
    text << jinja.rdbuf();
    return text.str();
  }
  std::ifstream in(folder / "tokenizer_config.json");
  if (!in) return {};
  try {
    const auto config = nlohmann::json::parse(in);
    if (!config.is_object() || !config.contains("chat_template")) return {};
    const auto& chat = config["chat_template"];
    if (chat.is_string()) return chat.get<std::string>();
    if (chat.is_array())
      for (const auto& named : chat)
        if (named.value("name", "") == "default") return named.value("template", "");
    return {};
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON: {}", (folder / "tokenizer_config.json").string(),
                            e.what()));
  }
}

}  // namespace

namespace {

void check_fits_embedding(const Tokenizer& tokenizer, std::int64_t rows,
                          const std::filesystem::path& model_path) {
  std::string what;
  std::int64_t id = -1;
  if (tokenizer.vocab_size() > rows)
    what = "its vocabulary", id = tokenizer.vocab_size() - 1;
  else if (tokenizer.bos_id() && *tokenizer.bos_id() >= rows)
    what = "its BOS token", id = *tokenizer.bos_id();
  else if (tokenizer.eos_id() && *tokenizer.eos_id() >= rows)
    what = "its EOS token", id = *tokenizer.eos_id();
  if (!what.empty())
    throw Error(fmt::format(
        "{}: the tokenizer's ids go up to {} ({}), but the model's embedding has {} rows "
        "(vocab_size): a tokenizer for another model?",
        model_path.string(), id, what, rows));
}

TokenizerLookup find_any_tokenizer(const std::filesystem::path& model_path) {
  namespace fs = std::filesystem;
  if (model_path.extension() == ".gguf") return find_gguf_tokenizer(model_path);
  TokenizerLookup lookup;
  lookup.chat_template = folder_chat_template(model_path);
  if (fs::exists(model_path / "tokenizer.model"))
    lookup.tokenizer = open_sentencepiece_tokenizer(model_path / "tokenizer.model");
  else if (fs::exists(model_path / "tokenizer.json"))
    lookup.tokenizer = open_tokenizer_json(model_path / "tokenizer.json");
  else
    lookup.why_not =
        fmt::format("{} has no tokenizer.model or tokenizer.json", model_path.string());
  return lookup;
}

}  // namespace

TokenizerLookup find_tokenizer(const std::filesystem::path& model_path,
                               std::int64_t embedding_rows) {
  TokenizerLookup lookup = find_any_tokenizer(model_path);
  if (lookup.tokenizer && embedding_rows > 0)
    check_fits_embedding(*lookup.tokenizer, embedding_rows, model_path);
  return lookup;
}

std::size_t valid_utf8_prefix(std::string_view text) {
  std::size_t at = 0;
  while (at < text.size()) {
    const auto lead = static_cast<unsigned char>(text[at]);
    std::size_t length = 0;
    char32_t min = 0;
    if (lead < 0x80) {
      ++at;
      continue;
    } else if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2, min = 0x80;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3, min = 0x800;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4, min = 0x10000;
    } else {
      return at;
    }
    if (at + length > text.size()) return at;
    char32_t c = lead & (0xFF >> (length + 1));
    for (std::size_t i = 1; i < length; ++i) {
      const auto next = static_cast<unsigned char>(text[at + i]);
      if ((next & 0xC0) != 0x80) return at;
      c = (c << 6) | (next & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return at;
    at += length;
  }
  return at;
}

namespace {
// Bytes at the end of `text` that begin a UTF-8 character not finished yet (0 to 3).
std::size_t incomplete_utf8_tail(std::string_view text) {
  for (std::size_t back = 1; back <= std::min<std::size_t>(3, text.size()); ++back) {
    const auto byte = static_cast<unsigned char>(text[text.size() - back]);
    if ((byte & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const std::size_t needed = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC0 ? 2 : 1;
    return needed > back ? back : 0;
  }
  return 0;
}
}  // namespace

std::string StreamingDecoder::push(std::int32_t id) {
  ids_.push_back(id);
  const std::string text = tokenizer_.decode(ids_);
  const std::size_t complete = text.size() - incomplete_utf8_tail(text);
  if (complete <= emitted_) return {};
  std::string out = text.substr(emitted_, complete - emitted_);
  emitted_ = complete;
  return out;
}

std::string StreamingDecoder::finish() {
  const std::string text = tokenizer_.decode(ids_);
  std::string out = text.size() > emitted_ ? text.substr(emitted_) : std::string();
  emitted_ = text.size();
  return out;
}

}  // namespace kvlab
