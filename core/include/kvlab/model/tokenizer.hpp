#pragma once
// Tokenizers: text <-> token ids for a model. Three sources, each with a real library behind it:
//   - SentencePiece `tokenizer.model` (Llama-2 style folders), via Debian's libsentencepiece;
//   - byte-level BPE (GPT-2, Llama-3, Qwen2, SmolLM, ...) from a Hugging Face `tokenizer.json`
//     or from a GGUF file's tokenizer.ggml.* metadata; pre-tokenization runs the model's own
//     regular expressions on PCRE2 (Unicode properties), NFC normalization on utf8proc.
// encode() never adds BOS/EOS: encode_prompt() adds what the tokenizer declares (a
// TemplateProcessing post-processor, tokenizer.ggml.add_bos_token, SentencePiece's BOS).
// Added tokens (<|im_start|>, ...) written in the text are matched as themselves, as Hugging
// Face `tokenizers` does by default.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

class GgufFile;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Text (UTF-8; invalid UTF-8 is a kvlab::Error naming the byte) -> ids, no BOS/EOS added.
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // Ids -> text. Ids outside the vocabulary (a model's padded embedding rows) are shown as
  // <id:N>, never an error. Byte-level pieces that end inside a UTF-8 character give raw bytes.
  virtual std::string decode(std::span<const std::int32_t> ids) const = 0;
  virtual std::int32_t vocab_size() const = 0;
  // "sentencepiece", "byte-level BPE (smollm pre-tokenizer)", ... for `kvlab model info`.
  virtual std::string description() const = 0;
  // The id of a token's exact text (an added token such as "<|im_end|>" included).
  virtual std::optional<std::int32_t> token_id(std::string_view token_text) const = 0;

  // encode() with the BOS/EOS the tokenizer declares it adds.
  std::vector<std::int32_t> encode_prompt(std::string_view text) const;
  std::optional<std::int32_t> bos_id() const { return bos_; }
  std::optional<std::int32_t> eos_id() const { return eos_; }
  bool adds_bos() const { return add_bos_ && bos_.has_value(); }

 protected:
  std::optional<std::int32_t> bos_;
  std::optional<std::int32_t> eos_;
  bool add_bos_ = false;
  bool add_eos_ = false;
};

// The tokenizer of a model: a .gguf file (tokenizer.ggml.*), or a folder's tokenizer.model
// (preferred: Llama-2 folders carry a SentencePiece-style tokenizer.json beside it) or
// tokenizer.json. `tokenizer` is null when there is none or kvlab cannot run the one there;
// `why_not` then says which and what to do. A file that is present and malformed throws
// kvlab::Error naming it.
struct TokenizerLookup {
  std::unique_ptr<Tokenizer> tokenizer;
  std::string why_not;
  // The model's chat template (GGUF tokenizer.chat_template, tokenizer_config.json's
  // chat_template), empty when it has none; see chat_template.hpp.
  std::string chat_template;
};
// With `embedding_rows` > 0 (the model's vocab_size), a tokenizer that can produce an id the
// embedding has no row for (its vocabulary, an added token, BOS or EOS) is a kvlab::Error
// naming both numbers: the forward would read past the embedding.
TokenizerLookup find_tokenizer(const std::filesystem::path& model_path,
                               std::int64_t embedding_rows = 0);

std::unique_ptr<Tokenizer> open_sentencepiece_tokenizer(const std::filesystem::path& file);
// A Hugging Face tokenizer.json whose model is byte-level BPE. Throws kvlab::Error naming the
// file and the unsupported part (a SentencePiece-style BPE, a WordPiece model, a Split
// behaviour other than Isolated, ...).
std::unique_ptr<Tokenizer> open_tokenizer_json(const std::filesystem::path& file);
// tokenizer.ggml.model "gpt2" with a tokenizer.ggml.pre llama.cpp names (gpt2, llama-bpe,
// qwen2, smollm, starcoder, ...). Throws kvlab::Error for another model or pre-tokenizer.
std::unique_ptr<Tokenizer> gguf_tokenizer(const GgufFile& file);
// tokenizer.ggml.model "llama": the pieces, scores and types of tokenizer.ggml.* as a
// SentencePiece BPE model (byte fallback, spaces as U+2581, a space prefix only when
// tokenizer.ggml.add_space_prefix says so), run by libsentencepiece. Throws kvlab::Error for
// missing or mismatched arrays.
std::unique_ptr<Tokenizer> gguf_sentencepiece_tokenizer(const GgufFile& file);
// A SentencePiece model from its serialized ModelProto; `source` names it in messages.
std::unique_ptr<Tokenizer> sentencepiece_tokenizer_from_proto(std::string_view model_proto,
                                                              std::string source, bool add_bos);

// Turns generated ids into text as they come: push() returns the text that is complete so far
// and was not returned before. A UTF-8 character split over two tokens waits for its rest.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string push(std::int32_t id);
  std::string finish();  // whatever is left, incomplete bytes included

 private:
  const Tokenizer& tokenizer_;
  std::vector<std::int32_t> ids_;
  std::size_t emitted_ = 0;  // bytes of decode(ids_) already returned
};

// Length of the valid UTF-8 prefix of `text` (== size when all of it is valid).
std::size_t valid_utf8_prefix(std::string_view text);

}  // namespace kvlab
