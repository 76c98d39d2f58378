#pragma once
// The OpenAI API's JSON, as kvlab serve reads and writes it: a completions or chat completions
// request parsed and checked field by field (an unknown field, a wrong type or a value out of
// range is an ApiError naming the field, as the API's own 400s do), the API's error shape, and
// stop strings found in the generated text as it streams.
//
// Fields taken: model, prompt (a string, token ids, or a list of either) or messages, max_tokens
// (chat: or max_completion_tokens), temperature, top_p, n, seed, stop, logprobs (chat: with
// top_logprobs), stream, stream_options.include_usage, user; zero penalties, best_of = n, an empty
// logit_bias, echo false. vLLM's extensions: priority (for the priority scheduler), top_k,
// ignore_eos, cache_salt.
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/model/chat_template.hpp"

namespace kvlab::serve {

// An answer in the API's error shape: {"error": {"message", "type", "param", "code"}}.
class ApiError : public std::exception {
 public:
  ApiError(int status, std::string message, std::string param = {},
           std::string type = "invalid_request_error", std::string code = {});
  const char* what() const noexcept override { return message.c_str(); }
  std::string body() const;

  int status;
  std::string message, param, type, code;
};

// The body of an error answer (ApiError::body's shape).
std::string error_body(std::string_view message, std::string_view type, std::string_view param,
                       std::string_view code);

struct CompletionRequest {
  bool chat = false;
  std::string model;
  // Completions: the prompts, as text or as token ids (one of the two); chat: the messages.
  std::vector<std::string> prompt_texts;
  std::vector<std::vector<std::int32_t>> prompt_ids;
  std::vector<ChatMessage> messages;
  std::optional<std::int64_t> max_tokens;  // none: as much as the context leaves (chat), 16
  double temperature = 1.0;
  double top_p = 1.0;
  std::int32_t top_k = 0;
  std::optional<std::uint64_t> seed;
  std::vector<std::string> stop;
  std::int64_t n = 1;
  std::int32_t logprobs = -1;  // -1: none; k >= 0: each token's and the k most likely
  bool stream = false, include_usage = false;
  std::int32_t priority = 0;
  bool ignore_eos = false;
  std::string user;  // the engine request's tenant (the vtc scheduler's fairness unit)
  // vLLM's cache_salt: prefix-cache blocks are shared only between requests with the same salt
  // (a tenant that keeps its salt secret keeps other tenants from probing its prompts).
  std::string cache_salt;
};

// Throws ApiError (400) naming the field for anything the API (or kvlab) does not take.
CompletionRequest parse_completion_request(std::string_view body, bool chat);

// Stop strings in text that arrives piece by piece: push() returns what may be shown now (text
// that cannot be the start of a stop string); once a stop string appears, the text before it
// is released and nothing after it.
class StopStrings {
 public:
  explicit StopStrings(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(std::string_view text);
  std::string flush();  // at the end: whatever was held back
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kvlab::serve
