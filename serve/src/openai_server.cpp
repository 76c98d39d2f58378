#include "kvlab/serve/openai_server.hpp"

#include <fmt/format.h>

#include <boost/beast/http/field.hpp>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "generation.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/results_view.hpp"
#include "kvlab/serve/openai_api.hpp"

namespace kvlab::serve {
namespace http = boost::beast::http;
using nlohmann::json;

namespace {

HttpResponse json_response(http::status status, const std::string& body) {
  HttpResponse response{status, 11};
  response.set(http::field::content_type, "application/json");
  response.set(http::field::server, "kvlab");
  response.body() = body;
  return response;
}

HttpResponse error_response(const ApiError& e) {
  return json_response(static_cast<http::status>(e.status), e.body());
}

std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
          0.75,  1,      2.5,   5,    7.5,   10,   20,    40,  80,   160};
}

// Bearer-key check of every route but /health. A browser opening /ui cannot send the header:
// /ui and /ui/data also take the key as ?api_key=KEY (the page passes it on to /ui/data).
bool authorized(const HttpRequest& request, const std::string& key) {
  if (key.empty()) return true;
  const auto it = request.find(http::field::authorization);
  if (it != request.end() && it->value() == "Bearer " + key) return true;
  const std::string_view target(request.target().data(), request.target().size());
  if (!target.starts_with("/ui")) return false;
  const std::size_t query = target.find('?');
  if (query == std::string_view::npos) return false;
  for (std::string_view rest = target.substr(query + 1); !rest.empty();) {
    const std::size_t amp = rest.find('&');
    if (rest.substr(0, amp) == "api_key=" + key) return true;
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
  }
  return false;
}

// The replicas' latest steps as kvlab view's data: a run each.
std::string live_view_data(const LiveCluster& engine, const std::string& model,
                           LiveViewDetail detail) {
  std::string text = "{\"title\":" +
                     nlohmann::json(model + " (live)")
                         .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                     ",\"runs\":[";
  for (std::size_t r = 0; r < engine.size(); ++r)
    (text += r ? "," : "") += engine.replica_view_json(
        r, engine.size() == 1 ? model : fmt::format("replica {}", r), detail);
  return text + "]}";
}

}  // namespace

LatencyHistogram::LatencyHistogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void LatencyHistogram::observe(double seconds) {
  std::lock_guard lock(mutex_);
  std::size_t b = 0;
  while (b < bounds_.size() && seconds > bounds_[b]) ++b;
  ++counts_[b];
  sum_ += seconds;
  ++count_;
}

std::string LatencyHistogram::text(const std::string& name, const std::string& help) const {
  std::lock_guard lock(mutex_);
  std::string out = fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
  std::int64_t cumulative = 0;
  for (std::size_t b = 0; b < bounds_.size(); ++b) {
    cumulative += counts_[b];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[b], cumulative);
  }
  out += fmt::format("{0}_bucket{{le=\"+Inf\"}} {1}\n{0}_sum {2}\n{0}_count {1}\n", name, count_,
                     sum_);
  return out;
}

OpenAiServer::OpenAiServer(LiveCluster& engine, const ModelConfig& model,
                           const Tokenizer* tokenizer, std::optional<ChatTemplate> chat,
                           OpenAiOptions options)
    : shared_(std::make_unique<Shared>(engine, model, tokenizer, std::move(chat),
                                       std::move(options), latency_bounds())) {
  shared_->next_seed = std::random_device{}();
}

OpenAiServer::~OpenAiServer() = default;

// The routes, one a line: path, method (GET answers HEAD too), whether the API key is needed,
// and what answers (llama.cpp's server registers its routes the same way).
struct OpenAiServer::Route {
  std::string_view path;
  http::verb method;
  bool keyed;
  void (OpenAiServer::*answer)(const HttpRequest&, const std::shared_ptr<HttpReply>&);
};

const OpenAiServer::Route OpenAiServer::kRoutes[] = {
    {"/health", http::verb::get, false, &OpenAiServer::health},
    {"/v1/completions", http::verb::post, true, &OpenAiServer::completion},
    {"/v1/chat/completions", http::verb::post, true, &OpenAiServer::chat_completion},
    {"/v1/models", http::verb::get, true, &OpenAiServer::models},
    {"/metrics", http::verb::get, true, &OpenAiServer::metrics},
    {"/ui", http::verb::get, true, &OpenAiServer::ui_page},
    {"/ui/data", http::verb::get, true, &OpenAiServer::ui_data},
};

void OpenAiServer::handle(HttpRequest request, std::shared_ptr<HttpReply> reply) {
  const std::string target(request.target().substr(0, request.target().find('?')));
  const Route* route = nullptr;
  for (const Route& r : kRoutes)
    if (r.path == target) route = &r;
  answer_errors(reply, route, [&] {
    if ((!route || route->keyed) && !authorized(request, shared_->options.api_key))
      throw ApiError(401, "Incorrect API key provided", "", "invalid_request_error",
                     "invalid_api_key");
    if (!route)
      throw ApiError(404,
                     fmt::format("no route {} {}", std::string(request.method_string()), target),
                     "", "invalid_request_error", "not_found");
    // HEAD as GET: the HTTP layer sends the header alone (RFC 9110 9.3.2).
    const http::verb method =
        request.method() == http::verb::head ? http::verb::get : request.method();
    if (method != route->method)
      throw ApiError(405,
                     fmt::format("use {} {}", std::string(http::to_string(route->method)), target));
    (this->*route->answer)(request, reply);
  });
}

// Runs `answer`; what it throws becomes the API's error answer: an ApiError its status, a
// kvlab::Error (the request's content: a chat the template cannot render) a 400, anything else
// a 500. A 405 names the methods the route takes.
template <typename Answer>
void OpenAiServer::answer_errors(const std::shared_ptr<HttpReply>& reply, const Route* route,
                                 Answer answer) {
  try {
    answer();
  } catch (const ApiError& e) {
    shared_->count_answer(e.status);
    HttpResponse response = error_response(e);
    if (e.status == 405 && route)
      response.set(http::field::allow, route->method == http::verb::get ? "GET, HEAD" : "POST");
    reply->send(std::move(response));
  } catch (const Error& e) {
    shared_->count_answer(400);
    reply->send(error_response(ApiError(400, e.what())));
  } catch (const std::exception& e) {
    shared_->count_answer(500);
    reply->send(error_response(ApiError(500, e.what(), "", "server_error")));
  }
}

void OpenAiServer::health(const HttpRequest&, const std::shared_ptr<HttpReply>& reply) {
  shared_->count_answer(draining_ ? 503 : 200);
  reply->send(json_response(draining_ ? http::status::service_unavailable : http::status::ok,
                            draining_ ? R"({"status":"draining"})" : R"({"status":"ok"})"));
}

void OpenAiServer::models(const HttpRequest&, const std::shared_ptr<HttpReply>& reply) {
  shared_->count_answer(200);
  reply->send(json_response(http::status::ok, models_body(*shared_)));
}

void OpenAiServer::metrics(const HttpRequest&, const std::shared_ptr<HttpReply>& reply) {
  HttpResponse response = json_response(http::status::ok, metrics_text());
  shared_->count_answer(200);  // after: the text counts the answers before this one
  response.set(http::field::content_type, "text/plain; version=0.0.4");
  reply->send(std::move(response));
}

void OpenAiServer::completion(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply) {
  completions(request, reply, false);
}

void OpenAiServer::chat_completion(const HttpRequest& request,
                                   const std::shared_ptr<HttpReply>& reply) {
  completions(request, reply, true);
}

void OpenAiServer::ui_page(const HttpRequest&, const std::shared_ptr<HttpReply>& reply) {
  ui(true, reply);
}

void OpenAiServer::ui_data(const HttpRequest&, const std::shared_ptr<HttpReply>& reply) {
  ui(false, reply);
}

// GET /ui: kvlab view's page over the engine's latest steps, polling /ui/data for more.
void OpenAiServer::ui(bool page, const std::shared_ptr<HttpReply>& reply) {
  if (!shared_->options.ui)
    throw ApiError(404, "this server shows no /ui (kvlab serve --ui off)", "",
                   "invalid_request_error", "not_found");
  std::string data =
      live_view_data(shared_->engine, shared_->options.model_name, *shared_->options.ui);
  HttpResponse response =
      json_response(http::status::ok, page ? results_view_html(std::move(data), true) : data);
  if (page) response.set(http::field::content_type, "text/html; charset=utf-8");
  response.set(http::field::cache_control, "no-store");
  // Beside the page's own policy (a meta element: scripts by nonce only): no framing by another
  // site, no sniffing the JSON as HTML, and the ?api_key= in the address sent to nobody.
  response.set("Content-Security-Policy", "frame-ancestors 'none'");
  response.set("X-Content-Type-Options", "nosniff");
  response.set("Referrer-Policy", "no-referrer");
  shared_->count_answer(200);
  reply->send(std::move(response));
}

void OpenAiServer::completions(const HttpRequest& request, const std::shared_ptr<HttpReply>& reply,
                               bool chat) {
  CompletionRequest parsed = parse_completion_request(request.body(), chat);
  if (parsed.model != shared_->options.model_name)
    throw ApiError(404,
                   fmt::format("The model `{}` does not exist; this server serves `{}`",
                               parsed.model, shared_->options.model_name),
                   "model", "invalid_request_error", "model_not_found");
  check_user(parsed.user);
  auto generation = std::make_shared<Generation>(*shared_, std::move(parsed), reply);
  reply->on_disconnect([weak = std::weak_ptr<Generation>(generation)] {
    if (auto g = weak.lock()) g->cancel_all();
  });
  if (const std::optional<ApiError> refused = generation->submit()) {
    HttpResponse response = error_response(*refused);
    if (refused->status == 429)
      response.set(http::field::retry_after,
                   std::to_string(static_cast<int>(std::ceil(shared_->options.retry_after_s))));
    shared_->count_answer(refused->status);
    reply->send(std::move(response));
  }
}

// A served run records each distinct user as a tenant (its summary, its fairness counters):
// past options.max_users of them, a new one is refused rather than recorded.
void OpenAiServer::check_user(const std::string& user) {
  if (user.empty()) return;
  std::lock_guard lock(shared_->users_mutex);
  if (shared_->users.contains(user)) return;
  if (static_cast<std::int64_t>(shared_->users.size()) >= shared_->options.max_users)
    throw ApiError(400,
                   fmt::format("this server records at most {} distinct 'user' values (its "
                               "--max-users); this one is new",
                               shared_->options.max_users),
                   "user");
  shared_->users.insert(user);
}

void OpenAiServer::count_refusal(int status) {
  shared_->count_answer(status);
}

std::string OpenAiServer::metrics_text() const {
  return kvlab::serve::metrics_text(*shared_);
}

}  // namespace kvlab::serve
