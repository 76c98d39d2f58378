#pragma once
// kvlab serve's routes: the OpenAI API in front of a LiveCluster (its replicas behind a router;
// one replica for a file without [cluster]).
//   POST /v1/completions, /v1/chat/completions   streamed (server-sent events) or whole
//   GET  /v1/models                              the one served model
//   GET  /health                                 200, or 503 while draining (no key needed)
//   GET  /metrics                                Prometheus text: the engine's queue, KV and
//                                                 counters, and the latency histograms
//   GET  /ui, /ui/data                           kvlab view's page over the engine's latest
//                                                 steps (each replica a run), live; its data
// Each choice of a request is one engine request; its tokens are decoded as they come, stop
// strings are cut (and the request cancelled), and a client that disconnects cancels its
// requests (their KV is freed at the engine's next step). A full queue answers 429 with
// Retry-After; a request that can never fit answers 400 with the engine's reason.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvlab/engine/live_cluster.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "kvlab/serve/http_server.hpp"

namespace kvlab::serve {

struct OpenAiOptions {
  std::string model_name;  // what /v1/models lists and requests must name
  std::string api_key;     // non-empty: every route but /health needs "Bearer <key>" (else 401)
  double retry_after_s = 1;
  // The most tokens one sequence may hold (the KV pool's slots; 0: the context): a chat without
  // max_tokens answers up to it, not up to a context the pool could never hold.
  std::int64_t max_sequence_tokens = 0;
  // What /ui and /ui/data show (live_view.hpp): aggregates by default; nullopt: no /ui (404).
  std::optional<LiveViewDetail> ui = LiveViewDetail::aggregate;
  // Distinct `user` values the served run records (each is a tenant in its summary); a request
  // naming one more is a 400.
  std::int64_t max_users = 1000;
  // Non-empty: each finished or refused choice is appended here as one JSON line when it ends
  // (the run's record survives a crash of the process; kvlab serve writes it beside the
  // results).
  std::filesystem::path journal;
};

// A Prometheus histogram (cumulative buckets, sum, count); thread-safe.
class LatencyHistogram {
 public:
  explicit LatencyHistogram(std::vector<double> bounds);
  void observe(double seconds);
  // "# TYPE name histogram" and its lines.
  std::string text(const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mutex_;
  std::vector<double> bounds_;
  std::vector<std::int64_t> counts_;  // per bucket, not cumulative; the last: +Inf
  double sum_ = 0;
  std::int64_t count_ = 0;
};

class OpenAiServer {
 public:
  // `tokenizer` may be null (a preset: prompts as token ids, text as " <id>" per token); `chat`
  // is the model's chat template when it has one (else chat completions answer 400).
  OpenAiServer(LiveCluster& engine, const ModelConfig& model, const Tokenizer* tokenizer,
               std::optional<ChatTemplate> chat, OpenAiOptions options);
  ~OpenAiServer();
  void handle(HttpRequest request, std::shared_ptr<HttpReply> reply);
  std::string metrics_text() const;
  // The HTTP layer's own answers (413, 503: HttpServerOptions::on_refused), counted in /metrics.
  void count_refusal(int status);
  // While draining, /health answers 503 (load balancers stop sending).
  void set_draining() { draining_ = true; }

  struct Shared;  // what every request's generation reads (openai_server.cpp)

 private:
  struct Route;  // one line of the route table (openai_server.cpp)
  static const Route kRoutes[];
  template <typename Answer>
  void answer_errors(const std::shared_ptr<HttpReply>& reply, const Route* route, Answer answer);
  // The routes' answers.
  void health(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void completion(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void chat_completion(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void models(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void metrics(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void ui_page(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void ui_data(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply);
  void completions(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply, bool chat);
  void ui(bool page, const std::shared_ptr<HttpReply>& reply);
  void check_user(const std::string& user);
  std::unique_ptr<Shared> shared_;
  std::atomic<bool> draining_{false};
};

}  // namespace kvlab::serve
