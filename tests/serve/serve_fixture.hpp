#pragma once
// kvlab serve in-process for the tests: an experiment file's stack behind a LiveEngine, the
// OpenAI routes and the HTTP server on 127.0.0.1 (any free port), and a blocking HTTP client.
// Everything binds and targets the loopback address; every client call has a deadline.
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/served_experiment.hpp"
#include "kvlab/serve/http_server.hpp"
#include "kvlab/serve/openai_api.hpp"
#include "kvlab/serve/openai_server.hpp"
#include "test_util.hpp"

namespace kvlab::test {

// An experiment file's text, loaded with `sets` (as --set) and validated: its runs.
inline std::vector<ExperimentRun> served_experiment_from(const std::string& toml,
                                                         const std::vector<std::string>& sets) {
  const TempDir dir;  // the file is read whole here
  write_file(dir / "serve.toml", toml);
  std::vector<ExperimentRun> runs = load_experiment(dir / "serve.toml", sets);
  validate_experiment(runs, false);
  return runs;
}

// stories15m-shaped random weights on the cpu backend, a paged pool, fcfs: a stack whose steps
// take milliseconds. `sets` change it as --set does.
inline std::vector<ExperimentRun> small_served_experiment(const std::vector<std::string>& sets) {
  return served_experiment_from(R"([experiment]
name = "serve_test"
seed = 1
[model]
name = "stories15m"
[backend]
name = "cpu"
threads = 1
[kv_cache]
allocator = "paged"
slots = 2048
[kv_cache.params]
block_size = 16
[scheduler]
name = "fcfs"
[scheduler.params]
max_batch = 8
[workload]
requests = 1
)",
                                sets);
}

// Llama-2-7B on the simulated backend, paced as an H200 would run it: each decode step takes a
// few milliseconds of wall clock whatever the machine (or a sanitizer) costs. For the tests that
// need requests to stay in flight while others arrive, not the tokens.
inline std::vector<ExperimentRun> paced_served_experiment(const std::vector<std::string>& sets) {
  return served_experiment_from(R"([experiment]
name = "serve_paced_test"
seed = 1
[model]
name = "llama2-7b"
[backend]
name = "simulated"
profile = "h200"
[kv_cache]
allocator = "paged"
[kv_cache.params]
block_size = 16
[scheduler]
name = "fcfs"
[workload]
requests = 1
)",
                                sets);
}

class ServedStack {
 public:
  explicit ServedStack(const std::vector<std::string>& sets = {}, LiveOptions live = {},
                       serve::HttpServerOptions http = {}, std::string api_key = {})
      : ServedStack(small_served_experiment(sets), live, http, std::move(api_key)) {}
  // Any experiment's (validated) run; `adjust` changes the OpenAI routes' options (/ui, users,
  // the journal) from what kvlab serve's defaults are.
  ServedStack(std::vector<ExperimentRun> runs, LiveOptions live, serve::HttpServerOptions http,
              std::string api_key, const std::function<void(serve::OpenAiOptions&)>& adjust = {})
      : runs_(std::move(runs)),
        served_(runs_.front().config, live, {}),
        openai_(served_.engine(), served_.model(), nullptr, std::nullopt,
                options(std::move(api_key), adjust)) {
    http.host = "127.0.0.1";
    http.port = 0;
    http.error_body = [](int, const std::string& message) {
      return serve::error_body(message, "server_error", "", "");
    };
    http.on_refused = [this](int status) { openai_.count_refusal(status); };
    server_ = std::make_unique<serve::HttpServer>(
        http, [this](serve::HttpRequest r, std::shared_ptr<serve::HttpReply> reply) {
          openai_.handle(std::move(r), std::move(reply));
        });
    thread_ = std::thread([this] { server_->run(); });
  }
  ~ServedStack() { stop(false); }

  // Ends the engine (draining or aborting what is in flight), then the server.
  ShutdownReport stop(bool drain) {
    if (stopped_) return {};
    stopped_ = true;
    const ShutdownReport report = served_.engine().shutdown(drain);
    server_->stop();
    thread_.join();
    return report;
  }

  std::uint16_t port() const { return server_->port(); }
  // The options the routes were made with (as kvlab serve's, then adjusted).
  serve::OpenAiOptions options(std::string api_key,
                               const std::function<void(serve::OpenAiOptions&)>& adjust) const {
    serve::OpenAiOptions o;
    o.model_name = served_.model().name;
    o.api_key = std::move(api_key);
    o.max_sequence_tokens = served_.kv_slots();
    if (adjust) adjust(o);
    return o;
  }
  ServedExperiment& served() { return served_; }
  const ExperimentConfig& config() const { return runs_.front().config; }
  serve::HttpServer& server() { return *server_; }
  serve::OpenAiServer& openai() { return openai_; }
  const std::string& model_name() const { return served_.model().name; }

 private:
  std::vector<ExperimentRun> runs_;
  ServedExperiment served_;
  serve::OpenAiServer openai_;
  std::unique_ptr<serve::HttpServer> server_;
  std::thread thread_;
  bool stopped_ = false;
};

inline bool eventually_connections(ServedStack& stack, std::int64_t n) {
  return eventually([&] { return stack.server().open_connections() == n; });
}

struct HttpResult {
  int status = 0;
  std::string body;
  std::map<std::string, std::string> headers;
  nlohmann::json json() const { return nlohmann::json::parse(body); }
};

// One request on a fresh connection to 127.0.0.1:port, answered within `timeout_s`.
inline HttpResult http_call(std::uint16_t port, boost::beast::http::verb verb,
                            const std::string& target, const std::string& body = {},
                            const std::map<std::string, std::string>& headers = {},
                            double timeout_s = 60) {
  namespace net = boost::asio;
  namespace beast = boost::beast;
  namespace http = beast::http;
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  stream.expires_after(std::chrono::milliseconds(static_cast<long>(timeout_s * 1000)));
  stream.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  http::request<http::string_body> request{verb, target, 11};
  request.set(http::field::host, "127.0.0.1");
  request.set(http::field::content_type, "application/json");
  for (const auto& [name, value] : headers) request.set(name, value);
  request.body() = body;
  request.prepare_payload();
  http::write(stream, request);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::uint64_t{1} << 30);
  http::read(stream, buffer, parser);
  HttpResult result;
  result.status = static_cast<int>(parser.get().result_int());
  result.body = parser.get().body();
  for (const auto& field : parser.get())
    result.headers[std::string(field.name_string())] = std::string(field.value());
  return result;
}

inline HttpResult post_json(std::uint16_t port, const std::string& target,
                            const nlohmann::json& body,
                            const std::map<std::string, std::string>& headers = {}) {
  return http_call(port, boost::beast::http::verb::post, target, body.dump(), headers);
}

// The `data:` payloads of a server-sent-events body, [DONE] included.
inline std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> events;
  std::size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const std::size_t end = body.find("\n\n", at);
    events.push_back(body.substr(at + 6, end - at - 6));
    at = end;
  }
  return events;
}

}  // namespace kvlab::test
