#pragma once
// An HTTP/1.1 server on Boost.Beast for kvlab serve: a few threads run every connection
// asynchronously; a handler gets each request with an HttpReply through which it answers at once,
// later (from any thread), or as a stream of chunks (server-sent events). What a hostile client
// can do is bounded: a request must arrive whole within read_timeout_s (a slow-loris client is
// cut off, and so is a keep-alive connection idle that long), a body past max_body_bytes gets a
// 413, and past max_connections a new connection gets a 503 and is closed.
// Errors are the handler's to shape (error_body): the server itself answers only 413 and 503.
// A HEAD request's answer goes out without its body; an HTTP/1.0 client's stream is not chunked
// (the connection's close ends it).
//
//   accept -> session: read request (timeout, body limit) -> handler(request, reply)
//                      reply.send(response)            one response, then the next request
//                      reply.start_stream / chunk / end_stream   chunked, then the next request
//                      client gone while the handler works -> reply's on_disconnect, once
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace kvlab::serve {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  std::uint16_t port = 8000;  // 0: any free port (HttpServer::port() says which)
  int threads = 2;
  std::int64_t max_connections = 2048;
  std::int64_t max_body_bytes = std::int64_t{4} << 20;
  // To receive one request, header and body, counted from the end of the last answer (or the
  // connection's start); also how long a client may take to read a chunk of the answer.
  double read_timeout_s = 30;
  // The JSON body of the server's own 413 and 503 (a handler's API error shape).
  std::function<std::string(int status, const std::string& message)> error_body;
  // Told of each of the server's own answers (413, 503), for the handler's counters; any thread.
  std::function<void(int status)> on_refused;
};

// One request's answer. Thread-safe: every call is carried to the connection's own strand.
class HttpReply {
 public:
  virtual ~HttpReply() = default;
  virtual void send(HttpResponse response) = 0;
  // A chunked response: the header (status, content type, extra fields), then chunks, then the
  // end. Calls after the client went away do nothing.
  virtual void start_stream(HttpResponse header) = 0;
  virtual void chunk(std::string data) = 0;
  virtual void end_stream() = 0;
  // Called once (on the connection's strand) if the client closes the connection before the
  // answer ended; set it before the work starts.
  virtual void on_disconnect(std::function<void()> callback) = 0;
};

using HttpHandler = std::function<void(HttpRequest, std::shared_ptr<HttpReply>)>;

class HttpServer {
 public:
  // Binds and listens now (throws kvlab::Error naming the address when it cannot).
  HttpServer(HttpServerOptions options, HttpHandler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  std::uint16_t port() const;
  // Runs the threads; returns after stop(). Call once.
  void run();
  // Any thread (a signal watcher): stops accepting and ends run(); open connections are closed.
  void stop();
  std::int64_t open_connections() const;

  struct State;  // the sessions' (http_server.cpp)

 private:
  std::unique_ptr<State> state_;
};

}  // namespace kvlab::serve
