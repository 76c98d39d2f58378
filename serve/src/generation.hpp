#pragma once
// One completions request while the engine answers it (internal to openai_server.cpp): its
// choices (one engine request each), their text as the tokens come, stop strings, logprobs, and
// the answer, streamed or whole. Its engine callbacks run on the engine thread; the client's
// disconnect on the connection's strand; a mutex orders them.
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvlab/serve/openai_api.hpp"
#include "kvlab/serve/openai_server.hpp"
#include "kvlab/workload/workload.hpp"
#include "request_journal.hpp"

namespace kvlab::serve {

struct OpenAiServer::Shared {
  Shared(LiveCluster& live, const ModelConfig& served, const Tokenizer* tok,
         std::optional<ChatTemplate> chat_template, OpenAiOptions opts,
         const std::vector<double>& bounds)
      : engine(live),
        model(served),
        tokenizer(tok),
        chat(std::move(chat_template)),
        options(std::move(opts)),
        ttft(bounds),
        tpot(bounds),
        itl(bounds),
        e2e(bounds) {
    if (!options.journal.empty()) journal = std::make_unique<RequestJournal>(options.journal);
  }
  LiveCluster& engine;
  const ModelConfig& model;
  const Tokenizer* tokenizer;
  std::optional<ChatTemplate> chat;
  OpenAiOptions options;
  LatencyHistogram ttft, tpot, itl, e2e;
  std::atomic<std::uint64_t> next_seed{0};
  std::atomic<std::int64_t> next_id{0};
  std::atomic<std::int64_t> prompt_tokens{0}, completion_tokens{0};
  std::int64_t started = unix_seconds();    // what /v1/models says the model was created
  std::unique_ptr<RequestJournal> journal;  // null: none kept
  std::mutex users_mutex;
  std::set<std::string> users;  // the distinct `user` values seen (at most options.max_users)
  std::mutex answered_mutex;
  std::map<int, std::int64_t> answered;  // HTTP status -> answers
  void count_answer(int status) {
    std::lock_guard lock(answered_mutex);
    ++answered[status];
  }
  // A token as text: the tokenizer's, or " <id>" without one.
  std::string token_text(std::int32_t token) const;
  static std::int64_t unix_seconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

std::string models_body(const OpenAiServer::Shared& shared);
std::string metrics_text(OpenAiServer::Shared& shared);

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(OpenAiServer::Shared& shared, CompletionRequest request,
             std::shared_ptr<HttpReply> reply);
  // Tokenizes, checks the lengths (ApiError 400 thrown), and submits every choice; an answer to
  // send at once when the engine refused (429 queue full, 503 shutting down).
  std::optional<ApiError> submit();
  void cancel_all();  // the client went away

 private:
  using Clock = std::chrono::steady_clock;
  struct Choice {
    RequestId id = -1;
    std::int64_t prompt_tokens = 0;
    std::vector<std::int32_t> tokens;
    std::optional<StreamingDecoder> decoder;
    std::optional<StopStrings> stops;
    std::string text;           // released so far (whole answers)
    nlohmann::json logprobs;    // whole answers: the API's logprobs object so far
    std::string finish_reason;  // set when done
    bool done = false, role_sent = false;
    Clock::time_point submitted, first_token, last_token;
  };
  std::vector<std::vector<std::int32_t>> prompts() const;
  std::int64_t max_tokens(std::size_t prompt_tokens) const;
  WorkloadRequest engine_request(const std::vector<std::int32_t>& prompt, std::size_t choice,
                                 std::int64_t max_tokens) const;
  void on_token(std::size_t i, std::int32_t token, const GeneratedLogprobs* logprobs);
  void on_done(std::size_t i, const LiveOutcome& outcome);
  void refuse_rejected(const std::string& reason);
  void fail(const ApiError& error);  // the whole request answered with an error
  void release(std::size_t i, const std::string& text, const nlohmann::json* logprob);
  nlohmann::json logprob_entry(std::int32_t token, const GeneratedLogprobs& lp) const;
  static void add_logprob(nlohmann::json& logprobs, const nlohmann::json& entry,
                          std::size_t text_offset);
  nlohmann::json chunk(std::size_t i, const std::string& text, const nlohmann::json* logprobs,
                       const char* finish_reason);
  void send_chunk(const nlohmann::json& chunk);
  void answer_whole();
  void end_stream();
  nlohmann::json usage() const;
  void observe_end(const Choice& c);
  void journal_end(std::size_t i, const LiveOutcome& outcome) const;

  OpenAiServer::Shared& shared_;
  CompletionRequest request_;
  std::shared_ptr<HttpReply> reply_;
  std::string id_;
  std::int64_t created_;  // the answer's "created": when the request came (Unix seconds)
  std::mutex mutex_;
  std::vector<Choice> choices_;
  std::size_t remaining_ = 0;
  bool header_sent_ = false, answered_ = false;
};

}  // namespace kvlab::serve
