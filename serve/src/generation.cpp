#include "generation.hpp"
#include "kvlab/workload/workload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/beast/http/field.hpp>

namespace kvlab::serve {
namespace http = boost::beast::http;
using nlohmann::json;

namespace {

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

double seconds_between(std::chrono::steady_clock::time_point a,
                       std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The API's finish_reason for the engine's: "stop" (EOS, a stop string) or "length".
const char* api_finish_reason(const std::string& engine_reason) {
  return engine_reason == "eos" ? "stop" : "length";
}

const char* submit_status_name(SubmitStatus status) {
  switch (status) {
    case SubmitStatus::queue_full:
      return "queue_full";
    case SubmitStatus::failed:
      return "routing_failed";
    default:
      return "shutting_down";
  }
}

json byte_values(const std::string& text) {
  json bytes = json::array();
  for (const char c : text) bytes.push_back(static_cast<unsigned char>(c));
  return bytes;
}

}  // namespace

std::string OpenAiServer::Shared::token_text(std::int32_t token) const {
  if (tokenizer) return tokenizer->decode(std::span(&token, 1));
  return fmt::format(" {}", token);
}

Generation::Generation(OpenAiServer::Shared& shared, CompletionRequest request,
                       std::shared_ptr<HttpReply> reply)
    : shared_(shared),
      request_(std::move(request)),
      reply_(std::move(reply)),
      id_(fmt::format("{}-{}", request_.chat ? "chatcmpl" : "cmpl", shared.next_id++)),
      created_(OpenAiServer::Shared::unix_seconds()) {}

// The prompts as token ids: the chat rendered with the model's template, texts tokenized, ids
// checked against the vocabulary.
std::vector<std::vector<std::int32_t>> Generation::prompts() const {
  const Tokenizer* tokenizer = shared_.tokenizer;
  std::vector<std::vector<std::int32_t>> prompts = request_.prompt_ids;
  if (request_.chat) {
    if (!tokenizer || !shared_.chat)
      throw ApiError(400, "this model has no chat template (or tokenizer): use /v1/completions");
    prompts.push_back(shared_.chat->render(request_.messages, *tokenizer));
  }
  if (!request_.prompt_texts.empty() && !tokenizer)
    throw ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt");
  for (const std::string& text : request_.prompt_texts)
    prompts.push_back(tokenizer->encode_prompt(text));
  for (const auto& prompt : prompts) {
    if (prompt.empty()) throw ApiError(400, "the prompt is empty", "prompt");
    for (const std::int32_t id : prompt)
      if (id >= shared_.model.vocab_size)
        throw ApiError(400,
                       fmt::format("prompt token id {} is outside the vocabulary [0, {})", id,
                                   shared_.model.vocab_size),
                       "prompt");
  }
  return prompts;
}

// max_tokens as asked, else 16 (completions, as the API) or what the context leaves (chat);
// a prompt and max_tokens past the context is a 400, as the API's.
std::int64_t Generation::max_tokens(std::size_t prompt_tokens) const {
  const std::int64_t context = shared_.model.max_position_embeddings;
  const auto prompt = static_cast<std::int64_t>(prompt_tokens);
  const std::int64_t left = context - prompt;
  const std::int64_t room = shared_.options.max_sequence_tokens > 0
                                ? std::min(left, shared_.options.max_sequence_tokens - prompt)
                                : left;
  const std::int64_t wanted = request_.max_tokens.value_or(
      std::max<std::int64_t>(1, request_.chat ? room : std::min<std::int64_t>(16, room)));
  if (left <= 0 || prompt + wanted > context)
    throw ApiError(400,
                   fmt::format("This model's maximum context length is {} tokens. However, you "
                               "requested {} tokens ({} in the prompt, {} for the completion). "
                               "Please reduce the prompt or max_tokens.",
                               context, prompt + std::max<std::int64_t>(wanted, 1), prompt,
                               std::max<std::int64_t>(wanted, 1)),
                   request_.max_tokens ? "max_tokens" : "messages", "invalid_request_error",
                   "context_length_exceeded");
  return wanted;
}

WorkloadRequest Generation::engine_request(const std::vector<std::int32_t>& prompt,
                                           std::size_t choice, std::int64_t max_tokens) const {
  WorkloadRequest r;
  r.prompt = prompt;
  r.output_tokens = max_tokens;
  r.priority = request_.priority;
  r.tenant = request_.user;
  r.cache_salt = request_.cache_salt;
  SamplingParams& s = r.sampling;
  s.temperature = request_.temperature;
  s.top_p = request_.top_p;
  s.top_k = request_.top_k;
  s.seed = request_.seed ? *request_.seed + choice : shared_.next_seed++;
  s.max_tokens = static_cast<std::int32_t>(max_tokens);
  s.ignore_eos = request_.ignore_eos;
  s.logprobs = request_.logprobs;
  return r;
}

std::optional<ApiError> Generation::submit() {
  const auto all_prompts = prompts();
  std::vector<std::int64_t> limits;
  for (const auto& prompt : all_prompts) limits.push_back(max_tokens(prompt.size()));
  std::lock_guard lock(mutex_);
  const std::size_t n = static_cast<std::size_t>(request_.n);
  choices_.resize(all_prompts.size() * n);
  remaining_ = choices_.size();
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    Choice& c = choices_[i];
    const auto& prompt = all_prompts[i / n];
    c.prompt_tokens = static_cast<std::int64_t>(prompt.size());
    if (shared_.tokenizer) c.decoder.emplace(*shared_.tokenizer);
    c.stops.emplace(request_.stop);
    c.submitted = Clock::now();
    LiveCallbacks callbacks{
        [self = shared_from_this(), i](std::int32_t t, const GeneratedLogprobs* lp) {
          self->on_token(i, t, lp);
        },
        [self = shared_from_this(), i](const LiveOutcome& o) { self->on_done(i, o); }};
    const SubmitResult result =
        shared_.engine.submit(engine_request(prompt, i % n, limits[i / n]), std::move(callbacks));
    if (result.status == SubmitStatus::accepted) {
      c.id = result.id;
      continue;
    }
    answered_ = true;  // the refusal is the answer; what was accepted is cancelled
    for (std::size_t k = 0; k < i; ++k) shared_.engine.cancel(choices_[k].id);
    if (shared_.journal)
      shared_.journal->append({{"request", id_},
                               {"choice", i},
                               {"created", created_},
                               {"user", request_.user},
                               {"refused", submit_status_name(result.status)}});
    if (result.status == SubmitStatus::queue_full)
      return ApiError(429, "the server's queue is full; retry after the Retry-After seconds", "",
                      "rate_limit_error", "queue_full");
    if (result.status == SubmitStatus::failed)
      return ApiError(500, result.reason, "", "server_error", "routing_failed");
    return ApiError(503, "the server is shutting down", "", "server_error", "shutting_down");
  }
  return std::nullopt;
}

void Generation::cancel_all() {
  std::lock_guard lock(mutex_);
  answered_ = true;  // nobody to answer
  for (const Choice& c : choices_)
    if (!c.done && c.id >= 0) shared_.engine.cancel(c.id);
}

void Generation::on_token(std::size_t i, std::int32_t token, const GeneratedLogprobs* logprobs) {
  std::lock_guard lock(mutex_);
  Choice& c = choices_[i];
  if (c.done || c.stops->stopped()) return;
  const auto now = Clock::now();
  if (c.tokens.empty())
    shared_.ttft.observe(seconds_between(c.submitted, now));
  else
    shared_.itl.observe(seconds_between(c.last_token, now));
  if (c.tokens.empty()) c.first_token = now;
  c.last_token = now;
  c.tokens.push_back(token);
  const bool stop_token = !request_.ignore_eos && shared_.model.is_eos(token);
  std::string piece;
  if (!stop_token) piece = c.decoder ? c.decoder->push(token) : shared_.token_text(token);
  const std::string released = c.stops->push(piece);
  if (c.stops->stopped()) shared_.engine.cancel(c.id);  // the rest is not wanted
  std::optional<json> entry;
  if (logprobs && request_.logprobs >= 0) entry = logprob_entry(token, *logprobs);
  release(i, released, entry ? &*entry : nullptr);
}

// Text (and a token's logprobs) the client may see now: streamed, or kept for the whole answer.
void Generation::release(std::size_t i, const std::string& text, const json* logprob) {
  Choice& c = choices_[i];
  if (answered_ || (text.empty() && !logprob)) return;
  if (request_.stream) return send_chunk(chunk(i, text, logprob, nullptr));
  if (logprob && request_.chat) c.logprobs["content"].push_back(*logprob);
  if (logprob && !request_.chat) add_logprob(c.logprobs, *logprob, c.text.size());
  c.text += text;
}

void Generation::on_done(std::size_t i, const LiveOutcome& outcome) {
  std::lock_guard lock(mutex_);
  Choice& c = choices_[i];
  if (c.done) return;
  c.done = true;
  --remaining_;
  journal_end(i, outcome);
  if (outcome.rejected) return refuse_rejected(outcome.reject_reason);
  const bool stopped = c.stops->stopped();
  if (outcome.finish_reason == "cancelled" && !stopped)  // not ours: the server's shutdown
    return fail(ApiError(503, "the server shut down (--abort) before the answer was finished", "",
                         "server_error", "server_shutdown"));
  c.finish_reason = stopped ? "stop" : api_finish_reason(outcome.finish_reason);
  observe_end(c);
  if (!stopped) {
    std::string rest = c.decoder ? c.decoder->finish() : std::string{};
    rest = c.stops->push(rest);
    rest += c.stops->flush();
    if (c.stops->stopped()) c.finish_reason = "stop";
    release(i, rest, nullptr);
  }
  if (answered_) return;
  if (request_.stream) send_chunk(chunk(i, "", nullptr, c.finish_reason.c_str()));
  if (remaining_ > 0) return;
  if (request_.stream)
    end_stream();
  else
    answer_whole();
}

// A choice the engine rejected (it can never fit, a fault) or a shutdown cancelled: the whole
// request is answered with the reason, the other choices cancelled.
void Generation::refuse_rejected(const std::string& reason) {
  const bool fault = reason.starts_with("engine fault");
  fail(ApiError(fault ? 500 : 400, "the engine rejected the request: " + reason, "",
                fault ? "server_error" : "invalid_request_error",
                fault ? "engine_fault" : "request_never_fits"));
}

void Generation::fail(const ApiError& error) {
  if (answered_) return;
  answered_ = true;
  for (const Choice& c : choices_)
    if (!c.done && c.id >= 0) shared_.engine.cancel(c.id);
  shared_.count_answer(error.status);
  if (!header_sent_) {
    HttpResponse response{static_cast<http::status>(error.status), 11};
    response.set(http::field::content_type, "application/json");
    response.body() = error.body();
    return reply_->send(std::move(response));
  }
  reply_->chunk(fmt::format("data: {}\n\ndata: [DONE]\n\n", error.body()));
  reply_->end_stream();
}

// The choice's end as one line of the journal (RequestJournal), the moment it ends.
void Generation::journal_end(std::size_t i, const LiveOutcome& outcome) const {
  if (!shared_.journal) return;
  const Choice& c = choices_[i];
  json line = {{"request", id_},
               {"choice", i},
               {"engine_id", c.id},
               {"created", created_},
               {"user", request_.user},
               {"prompt_tokens", c.prompt_tokens},
               {"output_tokens", c.tokens.size()},
               {"e2e_s", seconds_between(c.submitted, Clock::now())}};
  if (!c.tokens.empty()) line["ttft_s"] = seconds_between(c.submitted, c.first_token);
  if (outcome.rejected)
    line["rejected"] = outcome.reject_reason;
  else
    line["finish_reason"] = outcome.finish_reason;
  shared_.journal->append(line);
}

void Generation::observe_end(const Choice& c) {
  const auto now = Clock::now();
  shared_.e2e.observe(seconds_between(c.submitted, now));
  if (c.tokens.size() >= 2)
    shared_.tpot.observe(seconds_between(c.first_token, c.last_token) /
                         static_cast<double>(c.tokens.size() - 1));
  shared_.prompt_tokens += c.prompt_tokens;
  shared_.completion_tokens += static_cast<std::int64_t>(c.tokens.size());
}

json Generation::logprob_entry(std::int32_t token, const GeneratedLogprobs& lp) const {
  const std::string text = shared_.token_text(token);
  json entry = {{"token", text}, {"logprob", lp.logprob}, {"bytes", byte_values(text)}};
  json& top = entry["top_logprobs"] = json::array();
  for (const TokenLogprob& alt : lp.top) {
    const std::string alt_text = shared_.token_text(alt.token);
    top.push_back(
        {{"token", alt_text}, {"logprob", alt.logprob}, {"bytes", byte_values(alt_text)}});
  }
  return entry;
}

// The completions API's logprobs object: parallel lists, top alternatives as {text: logprob}.
void Generation::add_logprob(json& logprobs, const json& entry, std::size_t text_offset) {
  json top = json::object();
  for (const json& alt : entry["top_logprobs"])
    top[alt["token"].get<std::string>()] = alt["logprob"];
  logprobs["tokens"].push_back(entry["token"]);
  logprobs["token_logprobs"].push_back(entry["logprob"]);
  logprobs["top_logprobs"].push_back(std::move(top));
  logprobs["text_offset"].push_back(text_offset);
}

// One server-sent event's object: a choice's new text (and its token's logprobs), or its end.
json Generation::chunk(std::size_t i, const std::string& text, const json* logprob,
                       const char* finish_reason) {
  json choice = {{"index", i},
                 {"logprobs", nullptr},
                 {"finish_reason", finish_reason ? json(finish_reason) : json(nullptr)}};
  if (request_.chat) {
    json delta = json::object();
    if (!choices_[i].role_sent) delta["role"] = "assistant";
    choices_[i].role_sent = true;
    if (!text.empty() || !finish_reason) delta["content"] = text;
    choice["delta"] = std::move(delta);
    if (logprob) choice["logprobs"] = {{"content", json::array({*logprob})}};
  } else {
    choice["text"] = text;
    if (logprob) {
      json lp;
      add_logprob(lp, *logprob, 0);
      choice["logprobs"] = std::move(lp);
    }
  }
  return {{"id", id_},
          {"object", request_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", shared_.options.model_name},
          {"choices", json::array({std::move(choice)})}};
}

void Generation::send_chunk(const json& chunk) {
  if (!header_sent_) {
    header_sent_ = true;
    HttpResponse header{http::status::ok, 11};
    header.set(http::field::content_type, "text/event-stream");
    header.set(http::field::cache_control, "no-cache");
    header.set(http::field::server, "kvlab");
    reply_->start_stream(std::move(header));
    shared_.count_answer(200);
  }
  reply_->chunk("data: " + dump(chunk) + "\n\n");
}

json Generation::usage() const {
  std::int64_t prompt = 0, completion = 0;
  for (const Choice& c : choices_) {
    completion += static_cast<std::int64_t>(c.tokens.size());
    prompt += c.prompt_tokens;
  }
  if (request_.n > 1) prompt /= request_.n;  // the API counts each prompt once
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

void Generation::end_stream() {
  answered_ = true;
  if (!header_sent_) send_chunk(chunk(0, "", nullptr, choices_[0].finish_reason.c_str()));
  if (request_.include_usage) {
    json last = chunk(0, "", nullptr, nullptr);
    last["choices"] = json::array();
    last["usage"] = usage();
    reply_->chunk("data: " + dump(last) + "\n\n");
  }
  reply_->chunk("data: [DONE]\n\n");
  reply_->end_stream();
}

void Generation::answer_whole() {
  answered_ = true;
  json choices = json::array();
  for (std::size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = choices_[i];
    json choice = {{"index", i}, {"finish_reason", c.finish_reason}, {"logprobs", nullptr}};
    if (request_.logprobs >= 0) choice["logprobs"] = c.logprobs;
    if (request_.chat)
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    else
      choice["text"] = c.text;
    choices.push_back(std::move(choice));
  }
  const json body = {{"id", id_},
                     {"object", request_.chat ? "chat.completion" : "text_completion"},
                     {"created", created_},
                     {"model", shared_.options.model_name},
                     {"choices", std::move(choices)},
                     {"usage", usage()}};
  HttpResponse response{http::status::ok, 11};
  response.set(http::field::content_type, "application/json");
  response.set(http::field::server, "kvlab");
  response.body() = dump(body);
  shared_.count_answer(200);
  reply_->send(std::move(response));
}

std::string models_body(const OpenAiServer::Shared& shared) {
  const json model = {{"id", shared.options.model_name},
                      {"object", "model"},
                      {"created", shared.started},
                      {"owned_by", "kvlab"},
                      {"max_model_len", shared.model.max_position_embeddings}};
  return dump(json{{"object", "list"}, {"data", json::array({model})}});
}

}  // namespace kvlab::serve
