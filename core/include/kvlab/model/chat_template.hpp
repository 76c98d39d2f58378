#pragma once
// Chat templates: a conversation rendered the way a model was fine-tuned to read it. kvlab does
// not run Jinja; it recognises the three formats nearly every chat model uses from the template
// text the model ships (GGUF tokenizer.chat_template, or tokenizer_config.json's chat_template)
// and renders them itself:
//   ChatML   (SmolLM2, Qwen2, ...): <|im_start|>role\ncontent<|im_end|>\n ...
//   <|im_start|>assistant\n Llama-3
//   <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ... Llama-2
//   <s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST]
// Any other template is a kvlab::Error pointing to --prompt (raw text).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/model/tokenizer.hpp"

namespace kvlab {

enum class ChatFormat { chatml, llama3, llama2 };
const char* chat_format_name(ChatFormat format);

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  // Recognises the format from the template text; `source` names where it came from, for the
  // error. The default system message is the one the template writes when the conversation
  // has none (SmolLM2's "You are a helpful AI assistant named SmolLM, ...").
  static ChatTemplate detect(std::string_view template_text, std::string_view source);

  ChatFormat format() const { return format_; }
  const std::string& default_system() const { return default_system_; }

  // The prompt ids of `messages` with the assistant's turn opened. A conversation without a
  // system message gets the default one, when the template has one. The special tokens are
  // the tokenizer's own (an error when it lacks one); no BOS is added beyond the template's.
  std::vector<std::int32_t> render(std::span<const ChatMessage> messages,
                                   const Tokenizer& tokenizer) const;
  // The token that ends the assistant's turn (<|im_end|>, <|eot_id|>; Llama-2: EOS), which
  // generation must stop at, as well as the model's EOS.
  std::int32_t end_of_turn(const Tokenizer& tokenizer) const;

 private:
  ChatFormat format_ = ChatFormat::chatml;
  std::string default_system_;
};

}  // namespace kvlab
