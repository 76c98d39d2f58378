#include "kvlab/serve/openai_api.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "kvlab/engine/sampling.hpp"
#include "kvlab/json_limits.hpp"

namespace kvlab::serve {
namespace {

using nlohmann::json;

constexpr std::int64_t kMaxChoices = 128;  // n x prompts, as the API's n
constexpr std::size_t kMaxStops = 16;
constexpr std::size_t kMaxPrompts = 256;
constexpr int kMaxJsonDepth = 32;           // a chat's content parts need 4
constexpr std::size_t kMaxNameBytes = 256;  // user, cache_salt

ApiError bad(const std::string& param, const std::string& message) {
  return ApiError(400, message, param);
}

// What a wrong value is, for the message: "an integer", "a string", "an object", ...
std::string type_name(const json& v) {
  if (v.is_number_integer()) return "an integer";
  const std::string name = v.type_name();
  return (name.front() == 'a' || name.front() == 'o' ? "an " : "a ") + name;
}

const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

bool get_bool(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean())
    throw bad(name, fmt::format("'{}' must be a boolean, got {}", name, type_name(*v)));
  return v->get<bool>();
}

double get_number(const json& body, const char* name, double fallback, double lo, double hi,
                  bool open_low = false) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number())
    throw bad(name, fmt::format("'{}' must be a number, got {}", name, type_name(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x > hi || (open_low ? x <= lo : x < lo))
    throw bad(name, fmt::format("'{}' must be in {}{}, {}], got {}", name, open_low ? "(" : "[", lo,
                                hi, v->dump()));
  return x;
}

std::optional<std::int64_t> get_int(const json& body, const char* name, std::int64_t lo,
                                    std::int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer())
    throw bad(name, fmt::format("'{}' must be an integer, got {}", name, type_name(*v)));
  if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
    throw bad(name, fmt::format("'{}' must be at most {}, got {}", name, hi, v->dump()));
  const auto x = v->get<std::int64_t>();
  if (x < lo || x > hi)
    throw bad(name, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, x));
  return x;
}

// A short printable string (user, cache_salt): it is written into the run's CSV and JSON, and a
// served run records each distinct user. Control characters, a string past kMaxNameBytes, and
// (`non_empty`) "" are 400s naming the field.
std::string get_name(const json& body, const char* name, bool non_empty) {
  const json* v = field(body, name);
  if (!v) return {};
  if (!v->is_string())
    throw bad(name, fmt::format("'{}' must be a string, got {}", name, type_name(*v)));
  std::string text = v->get<std::string>();
  if (text.size() > kMaxNameBytes)
    throw bad(name, fmt::format("'{}' must be at most {} bytes, got {}", name, kMaxNameBytes,
                                text.size()));
  if (non_empty && text.empty()) throw bad(name, fmt::format("'{}' must not be empty", name));
  if (std::any_of(text.begin(), text.end(),
                  [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
    throw bad(name, fmt::format("'{}' must not hold control characters", name));
  return text;
}

// Fields kvlab takes only at the value that changes nothing.
void check_neutral(const json& body) {
  for (const char* name : {"presence_penalty", "frequency_penalty"})
    if (get_number(body, name, 0, -2, 2) != 0)
      throw bad(name, fmt::format("'{}' is not supported by kvlab serve: only 0", name));
  if (const json* v = field(body, "logit_bias"); v && !(v->is_object() && v->empty()))
    throw bad("logit_bias", "'logit_bias' is not supported by kvlab serve: only {}");
  if (get_bool(body, "echo", false))
    throw bad("echo", "'echo' is not supported by kvlab serve: only false");
  if (field(body, "suffix")) throw bad("suffix", "'suffix' is not supported by kvlab serve");
  for (const char* name : {"tools", "functions", "tool_choice", "function_call"})
    if (field(body, name))
      throw bad(name, fmt::format("'{}' is not supported by kvlab serve", name));
  if (const json* v = field(body, "response_format");
      v && !(v->is_object() && v->value("type", "") == "text"))
    throw bad("response_format", "'response_format' must be {\"type\": \"text\"} in kvlab serve");
}

void check_known_fields(const json& body, bool chat) {
  static const std::set<std::string, std::less<>> common = {"model",
                                                            "max_tokens",
                                                            "temperature",
                                                            "top_p",
                                                            "n",
                                                            "seed",
                                                            "stop",
                                                            "logprobs",
                                                            "stream",
                                                            "stream_options",
                                                            "user",
                                                            "presence_penalty",
                                                            "frequency_penalty",
                                                            "logit_bias",
                                                            "priority",
                                                            "top_k",
                                                            "ignore_eos",
                                                            "cache_salt"};
  static const std::set<std::string, std::less<>> completions = {"prompt", "echo", "suffix",
                                                                 "best_of"};
  static const std::set<std::string, std::less<>> chats = {
      "messages",  "max_completion_tokens", "top_logprobs",        "tools",          "tool_choice",
      "functions", "function_call",         "parallel_tool_calls", "response_format"};
  for (const auto& [key, value] : body.items())
    if (!common.contains(key) && !(chat ? chats : completions).contains(key))
      throw bad(key, fmt::format("Unrecognized request argument supplied: {}", key));
}

std::vector<std::int32_t> token_ids(const json& list, const std::string& where) {
  std::vector<std::int32_t> ids;
  for (const json& t : list) {
    if (!t.is_number_integer() || t.get<std::int64_t>() < 0 ||
        t.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max())
      throw bad("prompt",
                fmt::format("{} must hold token ids (integers >= 0), got {}", where, t.dump()));
    ids.push_back(t.get<std::int32_t>());
  }
  if (ids.empty()) throw bad("prompt", fmt::format("{} is empty", where));
  return ids;
}

// prompt: "text" | [ids] | ["text", ...] | [[ids], ...].
void parse_prompt(const json& body, CompletionRequest& r) {
  const json* p = field(body, "prompt");
  if (!p) throw bad("prompt", "'prompt' is required");
  if (p->is_string()) return r.prompt_texts.push_back(p->get<std::string>());
  if (!p->is_array() || p->empty())
    throw bad("prompt", "'prompt' must be a string, token ids, or a non-empty list of either");
  if (p->front().is_number()) return r.prompt_ids.push_back(token_ids(*p, "'prompt'"));
  if (p->size() > kMaxPrompts)
    throw bad("prompt", fmt::format("at most {} prompts in one request", kMaxPrompts));
  for (std::size_t i = 0; i < p->size(); ++i) {
    const json& item = (*p)[i];
    if (item.is_string() && r.prompt_ids.empty())
      r.prompt_texts.push_back(item.get<std::string>());
    else if (item.is_array() && r.prompt_texts.empty())
      r.prompt_ids.push_back(token_ids(item, fmt::format("'prompt[{}]'", i)));
    else
      throw bad("prompt", "'prompt' must be all strings or all token-id lists");
  }
}

std::string message_text(const json& content, std::size_t i) {
  if (content.is_string()) return content.get<std::string>();
  std::string text;  // [{"type": "text", "text": ...}, ...]
  if (content.is_array())
    for (const json& part : content) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string())
        throw bad("messages", fmt::format("messages[{}].content: only text parts are taken", i));
      text += part["text"].get<std::string>();
    }
  else
    throw bad("messages", fmt::format("messages[{}].content must be a string or text parts", i));
  return text;
}

void parse_messages(const json& body, CompletionRequest& r) {
  const json* m = field(body, "messages");
  if (!m || !m->is_array() || m->empty())
    throw bad("messages", "'messages' must be a non-empty list of {role, content}");
  for (std::size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string())
      throw bad("messages", fmt::format("messages[{}] needs a string 'role'", i));
    for (const auto& [key, value] : msg.items())  // tool_calls, name, ...: refused, not dropped
      if (key != "role" && key != "content")
        throw bad("messages", fmt::format("messages[{}].{} is not supported by kvlab serve (a "
                                          "message takes role and content)",
                                          i, key));
    std::string role = msg["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant")
      throw bad("messages", fmt::format("messages[{}].role '{}' is not system, developer, user or "
                                        "assistant",
                                        i, role));
    const json* content = msg.contains("content") ? &msg["content"] : nullptr;
    if (!content || content->is_null())
      throw bad("messages", fmt::format("messages[{}] needs 'content'", i));
    r.messages.push_back({role, message_text(*content, i)});
  }
}

std::vector<std::string> parse_stop(const json& body) {
  const json* s = field(body, "stop");
  if (!s) return {};
  std::vector<std::string> stops;
  if (s->is_string()) {
    stops.push_back(s->get<std::string>());
  } else if (s->is_array() && s->size() <= kMaxStops) {
    for (const json& item : *s) {
      if (!item.is_string()) throw bad("stop", "'stop' must be a string or a list of strings");
      stops.push_back(item.get<std::string>());
    }
  } else {
    throw bad("stop", fmt::format("'stop' must be a string or a list of at most {}", kMaxStops));
  }
  std::erase(stops, std::string{});
  return stops;
}

void parse_logprobs(const json& body, CompletionRequest& r) {
  if (!r.chat) {
    if (auto k = get_int(body, "logprobs", 0, kMaxLogprobs)) r.logprobs = static_cast<int>(*k);
    return;
  }
  const bool wanted = get_bool(body, "logprobs", false);
  const auto top = get_int(body, "top_logprobs", 0, kMaxLogprobs);
  if (top && !wanted) throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  if (wanted) r.logprobs = static_cast<int>(top.value_or(0));
}

void parse_sampling(const json& body, CompletionRequest& r) {
  r.temperature = get_number(body, "temperature", 1.0, 0, 2);
  r.top_p = get_number(body, "top_p", 1.0, 0, 1, true);
  r.top_k = static_cast<std::int32_t>(get_int(body, "top_k", -1, 1 << 20).value_or(0));
  if (r.top_k < 0) r.top_k = 0;  // vLLM's -1: off
  if (const json* v = field(body, "seed")) {
    if (!v->is_number_integer()) throw bad("seed", "'seed' must be an integer");
    r.seed = v->is_number_unsigned() ? v->get<std::uint64_t>()
                                     : static_cast<std::uint64_t>(v->get<std::int64_t>());
  }
  r.max_tokens = get_int(
      body, r.chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
      1, std::int64_t{1} << 24);
  r.n = get_int(body, "n", 1, kMaxChoices).value_or(1);
  if (auto best_of = get_int(body, "best_of", 1, kMaxChoices); best_of && *best_of != r.n)
    throw bad("best_of", "'best_of' other than n is not supported by kvlab serve");
  r.priority = static_cast<std::int32_t>(get_int(body, "priority", -1000000, 1000000).value_or(0));
  r.ignore_eos = get_bool(body, "ignore_eos", false);
}

}  // namespace

ApiError::ApiError(int status_code, std::string message_text, std::string param_name,
                   std::string error_type, std::string error_code)
    : status(status_code),
      message(std::move(message_text)),
      param(std::move(param_name)),
      type(std::move(error_type)),
      code(std::move(error_code)) {}

std::string ApiError::body() const {
  return error_body(message, type, param, code);
}

std::string error_body(std::string_view message, std::string_view type, std::string_view param,
                       std::string_view code) {
  json error = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) error["param"] = param;
  if (!code.empty()) error["code"] = code;
  return json{{"error", error}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

CompletionRequest parse_completion_request(std::string_view text, bool chat) {
  // Before parsing: a body nested 100,000 deep parses, then overflows the stack when a message
  // dumps part of it (the body's size is the HTTP layer's limit).
  if (const std::string problem = json_limit_problem(text, {text.size(), kMaxJsonDepth});
      !problem.empty())
    throw ApiError(400, fmt::format("The JSON body of your request is {}", problem));
  const json body = json::parse(text, nullptr, false);
  if (body.is_discarded())
    throw ApiError(400, "We could not parse the JSON body of your request: it is not valid JSON");
  if (!body.is_object()) throw ApiError(400, "The request body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  check_known_fields(body, chat);
  check_neutral(body);
  const json* model = field(body, "model");
  if (!model || !model->is_string()) throw bad("model", "'model' is required (a string)");
  r.model = model->get<std::string>();
  if (chat)
    parse_messages(body, r);
  else
    parse_prompt(body, r);
  parse_sampling(body, r);
  parse_logprobs(body, r);
  r.stop = parse_stop(body);
  r.stream = get_bool(body, "stream", false);
  if (const json* o = field(body, "stream_options")) {
    if (!o->is_object()) throw bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad("stream_options", "'stream_options' needs 'stream': true");
    r.include_usage = get_bool(*o, "include_usage", false);
  }
  r.user = get_name(body, "user", false);
  r.cache_salt = get_name(body, "cache_salt", true);
  const auto prompts =
      static_cast<std::int64_t>(chat ? 1 : std::max(r.prompt_texts.size(), r.prompt_ids.size()));
  if (prompts * r.n > kMaxChoices)
    throw bad("n",
              fmt::format("n x prompts must be at most {}, got {}", kMaxChoices, prompts * r.n));
  return r;
}

std::string StopStrings::push(std::string_view text) {
  if (stopped_) return {};
  held_ += text;
  std::size_t first = std::string::npos;
  for (const std::string& stop : stops_) first = std::min(first, held_.find(stop));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string released = held_.substr(0, first);
    held_.clear();
    return released;
  }
  std::size_t keep = 0;  // the longest end of held_ that a stop string starts with
  for (const std::string& stop : stops_)
    for (std::size_t k = std::min(stop.size() - 1, held_.size()); k > keep; --k)
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(stop).substr(0, k)) {
        keep = k;
        break;
      }
  std::string released = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return released;
}

std::string StopStrings::flush() {
  return stopped_ ? std::string{} : std::exchange(held_, {});
}

}  // namespace kvlab::serve
