#include "generation.hpp"

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
      id_(fmt::format("{}-{}", request_.chat ? "chatcmpl" : "cmpl", shared.next_id++)) {}

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
          {"created", shared_.created},
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
                     {"created", shared_.created},
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
                      {"created", shared.created},
                      {"owned_by", "kvlab"},
                      {"max_model_len", shared.model.max_position_embeddings}};
  return dump(json{{"object", "list"}, {"data", json::array({model})}});
}

namespace {

void metric(std::string& out, const char* name, const char* help, double value,
            const char* type = "gauge") {
  out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, value);
}

// The counters, cumulative since the server started.
void counter_lines(std::string& out, const LiveStats& s, const OpenAiServer::Shared& shared) {
  const KvAllocatorStats& kv = s.kv;
  struct Counter {
    const char* name;
    const char* help;
    std::int64_t value;
  };
  const Counter counters[] = {
      {"kvlab_steps_total", "engine steps that ran a batch", s.steps},
      {"kvlab_finished_total", "requests finished (EOS, max_tokens, a full context)", s.finished},
      {"kvlab_cancelled_total", "requests cancelled (a client gone, a stop string, --abort)",
       s.cancelled},
      {"kvlab_rejected_total", "requests the engine rejected (never fit, a fault)", s.rejected},
      {"kvlab_kv_handoffs_total",
       "requests prefilled and handed with their KV to a decode replica (disaggregated)",
       s.handed_off},
      {"kvlab_preemptions_total", "running requests preempted for memory", s.preemptions},
      {"kvlab_prefill_tokens_total", "prompt tokens computed", s.prefill_tokens},
      {"kvlab_decode_tokens_total", "tokens decoded", s.decode_tokens},
      {"kvlab_swapped_bytes_total", "KV bytes copied to and from the host swap pool", s.swap_bytes},
      {"kvlab_tier_bytes_stored_total", "KV bytes stored into the host and disk tiers",
       kv.host_bytes_stored + kv.disk_bytes_stored},
      {"kvlab_tier_bytes_loaded_total", "KV bytes loaded back from the host and disk tiers",
       kv.host_bytes_loaded + kv.disk_bytes_loaded},
      {"kvlab_prompt_tokens_total", "prompt tokens of the requests answered",
       shared.prompt_tokens.load()},
      {"kvlab_completion_tokens_total", "tokens generated for the requests answered",
       shared.completion_tokens.load()}};
  for (const Counter& c : counters)
    metric(out, c.name, c.help, static_cast<double>(c.value), "counter");
}

// A cluster's gauges per replica (label replica="i"): what a gateway or autoscaler scraping the
// replicas one by one would read.
void replica_lines(std::string& out, const LiveCluster& cluster) {
  struct Gauge {
    const char* name;
    const char* help;
    double (*value)(const LiveStats&);
  };
  static const Gauge gauges[] = {
      {"kvlab_replica_queue_length", "requests waiting on the replica",
       [](const LiveStats& s) { return static_cast<double>(s.waiting + s.queued); }},
      {"kvlab_replica_running", "requests in the replica's running batch",
       [](const LiveStats& s) { return static_cast<double>(s.running); }},
      {"kvlab_replica_kv_used_fraction", "the replica's pool slots holding live tokens' KV",
       [](const LiveStats& s) {
         return s.kv.capacity > 0
                    ? static_cast<double>(s.kv.used) / static_cast<double>(s.kv.capacity)
                    : 0.0;
       }},
      {"kvlab_replica_finished_total", "requests the replica finished",
       [](const LiveStats& s) { return static_cast<double>(s.finished); }},
      {"kvlab_replica_kv_handoffs_total", "requests the replica prefilled and handed off",
       [](const LiveStats& s) { return static_cast<double>(s.handed_off); }}};
  std::vector<LiveStats> stats;
  for (std::size_t r = 0; r < cluster.size(); ++r) stats.push_back(cluster.replica_stats(r));
  for (const Gauge& g : gauges) {
    const bool counter = std::string_view(g.name).ends_with("_total");
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n", g.name, g.help,
                       counter ? "counter" : "gauge");
    for (std::size_t r = 0; r < stats.size(); ++r)
      out += fmt::format("{}{{replica=\"{}\"}} {}\n", g.name, r, g.value(stats[r]));
  }
}

}  // namespace

// The engine's state after its last step and the server's counters, in the metric registry's
// names (kvlab_ + the name; counters end in _total).
std::string metrics_text(OpenAiServer::Shared& shared) {
  const LiveStats s = shared.engine.stats();
  const KvAllocatorStats& kv = s.kv;
  const double capacity = kv.capacity > 0 ? static_cast<double>(kv.capacity) : 1.0;
  std::string out;
  metric(out, "kvlab_queue_length", "requests waiting: taken by the engine, not running",
         static_cast<double>(s.waiting + s.queued));
  metric(out, "kvlab_running", "requests in the running batch", static_cast<double>(s.running));
  metric(out, "kvlab_kv_used_fraction", "pool slots holding live tokens' KV",
         static_cast<double>(kv.used) / capacity);
  metric(out, "kvlab_kv_waste_fraction",
         "pool slots reserved ahead or in unfilled last blocks (mean_kv_waste_fraction's parts)",
         static_cast<double>(kv.reserved_unused + kv.last_block_slack) / capacity);
  metric(out, "kvlab_prefix_hit_rate", "prompt tokens found in the prefix cache / looked up",
         kv.prefix_query_tokens > 0 ? static_cast<double>(kv.prefix_hit_tokens) /
                                          static_cast<double>(kv.prefix_query_tokens)
                                    : 0.0);
  metric(out, "kvlab_kv_slots", "the pool's capacity in tokens", static_cast<double>(kv.capacity));
  counter_lines(out, s, shared);
  if (shared.engine.size() > 1) replica_lines(out, shared.engine);
  out += shared.ttft.text("kvlab_ttft_s", "time to first token, as the server saw it");
  out += shared.tpot.text("kvlab_tpot_s", "time per output token after the first, per request");
  out += shared.itl.text("kvlab_itl_s", "time between consecutive tokens");
  out += shared.e2e.text("kvlab_e2e_s", "request submission to its end");
  out +=
      "# HELP kvlab_http_responses_total answers by status\n"
      "# TYPE kvlab_http_responses_total counter\n";
  std::lock_guard lock(shared.answered_mutex);
  for (const auto& [status, count] : shared.answered)
    out += fmt::format("kvlab_http_responses_total{{code=\"{}\"}} {}\n", status, count);
  return out;
}

}  // namespace kvlab::serve
