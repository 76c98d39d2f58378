#include "kvlab/model/chat_template.hpp"

#include <fmt/format.h>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// Jinja's "\\n" escape, written out.
std::string unescape_newlines(std::string_view text) {
  std::string out;
  for (std::size_t at = 0; at < text.size(); ++at) {
    if (text[at] == '\\' && at + 1 < text.size() && text[at + 1] == 'n') {
      out += '\n';
      ++at;
    } else {
      out += text[at];
    }
  }
  return out;
}

std::string trimmed(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return std::string(text.substr(first, last - first + 1));
}

// A ChatML template's default system message: the literal text between "<|im_start|>system\n"
// and "<|im_end|>" where the template writes one (not an expression such as
// messages[0]['content']). Jinja string escapes \n are undone.
std::string chatml_default_system(std::string_view text) {
  constexpr std::string_view kOpen = "<|im_start|>system";
  for (std::size_t at = text.find(kOpen); at != std::string_view::npos;
       at = text.find(kOpen, at + 1)) {
    std::size_t start = at + kOpen.size();
    if (text.substr(start, 1) == "\n")
      start += 1;
    else if (text.substr(start, 2) == "\\n")
      start += 2;
    else
      continue;
    const std::size_t end = text.find("<|im_end|>", start);
    if (end == std::string_view::npos) continue;
    const std::string_view literal = text.substr(start, end - start);
    if (literal.empty() || literal.find_first_of("'\"{}+") != std::string_view::npos) continue;
    return unescape_newlines(literal);
  }
  return {};
}

std::int32_t special_token(const Tokenizer& tokenizer, std::string_view text) {
  const auto id = tokenizer.token_id(text);
  // The token must also be what encoding its text gives, or the rendered prompt would spell it
  // out in pieces.
  if (!id || tokenizer.encode(text) != std::vector<std::int32_t>{*id})
    throw Error(
        fmt::format("the chat template needs the special token {} but the tokenizer "
                    "({}) does not have it",
                    text, tokenizer.description()));
  return *id;
}

std::vector<ChatMessage> with_system(std::span<const ChatMessage> messages,
                                     const std::string& default_system) {
  std::vector<ChatMessage> out(messages.begin(), messages.end());
  const bool has_system = !out.empty() && out.front().role == "system";
  if (!has_system && !default_system.empty()) out.insert(out.begin(), {"system", default_system});
  return out;
}

}  // namespace

const char* chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::chatml:
      return "ChatML";
    case ChatFormat::llama3:
      return "Llama-3";
    case ChatFormat::llama2:
      return "Llama-2";
  }
  return "?";
}

namespace {

// What a template of `format` must contain to have the layout kvlab renders: each message
// closed as the standard template closes it, and the generation prompt it opens. "" when all is
// there. Jinja writes a newline as an escape ("\\n") or as itself: both count.
std::string missing_layout(ChatFormat format, std::string_view text) {
  auto has = [&](std::string_view part) { return text.find(part) != std::string_view::npos; };
  auto has_line = [&](std::string_view part) {
    return has(std::string(part) + "\n") || has(std::string(part) + "\\n");
  };
  switch (format) {
    case ChatFormat::chatml:
      if (!has("<|im_end|>")) return "\"<|im_end|>\" (the end of each message)";
      if (!has_line("<|im_start|>assistant"))
        return "\"<|im_start|>assistant\" and a newline (the generation prompt)";
      return "";
    case ChatFormat::llama3:
      if (!has("<|end_header_id|>")) return "\"<|end_header_id|>\" (the end of each header)";
      if (!has("<|eot_id|>")) return "\"<|eot_id|>\" (the end of each message)";
      return "";
    case ChatFormat::llama2:
      if (!has("[/INST]")) return "\"[/INST]\" (the end of each instruction)";
      return "";
  }
  return "a known layout";
}

}  // namespace

ChatTemplate ChatTemplate::detect(std::string_view text, std::string_view source) {
  ChatTemplate t;
  if (text.find("<|im_start|>") != std::string_view::npos) {
    t.format_ = ChatFormat::chatml;
    t.default_system_ = chatml_default_system(text);
  } else if (text.find("<|start_header_id|>") != std::string_view::npos) {
    t.format_ = ChatFormat::llama3;
  } else if (text.find("[INST]") != std::string_view::npos) {
    t.format_ = ChatFormat::llama2;
  } else if (text.empty()) {
    throw Error(fmt::format("{} has no chat template; use --prompt with the raw text", source));
  } else {
    throw Error(fmt::format(
        "{}: the chat template is not ChatML, Llama-3 or Llama-2, the formats kvlab renders "
        "(it begins \"{}\"); use --prompt with the text the model expects",
        source, text.substr(0, 60)));
  }
  if (const std::string missing = missing_layout(t.format_, text); !missing.empty())
    throw Error(fmt::format(
        "{}: the chat template looks like {} but lacks {}, so its layout is not the one kvlab "
        "renders (kvlab renders the standard layouts, not arbitrary Jinja); use --prompt with "
        "the text the model expects",
        source, chat_format_name(t.format_), missing));
  return t;
}

std::vector<std::int32_t> ChatTemplate::render(std::span<const ChatMessage> messages,
                                               const Tokenizer& tokenizer) const {
  for (std::size_t i = 0; i < messages.size(); ++i)  // named here, not by a rendered offset
    for (const std::string* text : {&messages[i].role, &messages[i].content})
      if (const std::size_t valid = valid_utf8_prefix(*text); valid != text->size())
        throw Error(fmt::format("chat message {} ({}): its {} is not valid UTF-8 at byte {}", i + 1,
                                messages[i].role, text == &messages[i].role ? "role" : "text",
                                valid));
  const std::vector<ChatMessage> conversation = with_system(messages, default_system_);
  if (format_ == ChatFormat::chatml) {
    special_token(tokenizer, "<|im_start|>");
    special_token(tokenizer, "<|im_end|>");
    std::string text;
    for (const auto& m : conversation)
      text += fmt::format("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
    return tokenizer.encode(text + "<|im_start|>assistant\n");
  }
  if (format_ == ChatFormat::llama3) {
    std::vector<std::int32_t> ids{special_token(tokenizer, "<|begin_of_text|>")};
    special_token(tokenizer, "<|start_header_id|>");
    special_token(tokenizer, "<|eot_id|>");
    std::string text;
    for (const auto& m : conversation)
      text += fmt::format("<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>", m.role,
                          trimmed(m.content));
    const auto body = tokenizer.encode(text + "<|start_header_id|>assistant<|end_header_id|>\n\n");
    ids.insert(ids.end(), body.begin(), body.end());
    return ids;
  }
  // Llama-2: every user turn is [BOS] "[INST] ... [/INST]", the first one holding the system
  // message; every assistant turn is " answer " [EOS].
  if (!tokenizer.bos_id() || !tokenizer.eos_id())
    throw Error("the Llama-2 chat template needs the tokenizer's BOS and EOS ids");
  std::vector<std::int32_t> ids;
  std::string system;
  for (const auto& m : conversation) {
    std::vector<std::int32_t> part;
    if (m.role == "system") {
      system = fmt::format("<<SYS>>\n{}\n<</SYS>>\n\n", trimmed(m.content));
      continue;
    }
    if (m.role == "assistant") {
      part = tokenizer.encode(fmt::format(" {} ", trimmed(m.content)));
      part.push_back(*tokenizer.eos_id());
    } else {
      part.push_back(*tokenizer.bos_id());
      const auto body =
          tokenizer.encode(fmt::format("[INST] {}{} [/INST]", system, trimmed(m.content)));
      part.insert(part.end(), body.begin(), body.end());
      system.clear();
    }
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

std::int32_t ChatTemplate::end_of_turn(const Tokenizer& tokenizer) const {
  switch (format_) {
    case ChatFormat::chatml:
      return special_token(tokenizer, "<|im_end|>");
    case ChatFormat::llama3:
      return special_token(tokenizer, "<|eot_id|>");
    case ChatFormat::llama2:
      break;
  }
  if (!tokenizer.eos_id()) throw Error("the Llama-2 chat template needs the tokenizer's EOS id");
  return *tokenizer.eos_id();
}

}  // namespace kvlab
