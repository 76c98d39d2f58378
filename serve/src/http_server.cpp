#include "kvlab/serve/http_server.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "kvlab/error.hpp"

namespace kvlab::serve {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

// Sessions and handlers hold a plain pointer: the io_context is declared after what they touch,
// so its destruction (which destroys the sessions its handlers still hold) comes first.
struct HttpServer::State {
  HttpServerOptions options;
  HttpHandler handler;
  std::atomic<std::int64_t> connections{0};
  std::atomic<std::int64_t> busy{0};  // requests handed to the handler and not yet answered
  std::atomic<bool> stopping{false};
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
};

namespace {

constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

// A message's bytes as they go on the wire.
template <class Message>
std::string wire_bytes(const Message& message) {
  std::ostringstream out;
  out << message;
  return out.str();
}

// One connection: reads requests one after the other, hands each to the handler, writes its
// answer (whole or chunked), in order, on its own strand.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::State* state)
      : stream_(std::move(socket)), state_(state) {
    ++state_->connections;
  }
  ~Session() {
    --state_->connections;
    if (busy_) --state_->busy;
  }

  void start(bool over_capacity) {
    if (over_capacity) {
      refuse(http::status::service_unavailable,
             fmt::format("the server holds {} connections, its limit; retry later",
                         state_->options.max_connections));
      return;
    }
    read_next();
  }

  // HttpReply's calls, carried to the strand.
  template <class F>
  void on_strand(F f) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), f = std::move(f)]() mutable { f(*self); });
  }
  // A HEAD request gets the header alone, with the Content-Length the body would have had.
  void send(HttpResponse response) {
    response.keep_alive(keep_alive_);
    response.prepare_payload();
    queue_write(head_request_ ? wire_bytes(response.base()) : wire_bytes(response), true);
  }
  // Chunked to an HTTP/1.1 client; to an HTTP/1.0 one (which has no chunked encoding) the bytes
  // as they come, the connection's close ending the body (RFC 9112 6.3).
  void start_stream(HttpResponse header) {
    http::response<http::empty_body> head{header.result(), 11};
    for (const auto& field : header) head.set(field.name_string(), field.value());
    chunked_ = http_version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    head.keep_alive(keep_alive_);
    head.chunked(chunked_);
    queue_write(wire_bytes(head.base()), false);
  }
  void chunk(const std::string& data) {
    if (data.empty()) return;  // an empty chunk would end the body
    queue_write(chunked_ ? fmt::format("{:x}\r\n{}\r\n", data.size(), data) : data, false);
  }
  void end_stream() { queue_write(chunked_ ? "0\r\n\r\n" : "", true); }
  void set_disconnect(std::function<void()> callback) {
    on_disconnect_ = std::move(callback);
    watch_disconnect();
  }

 private:
  // The header first: a client that sent "Expect: 100-continue" (curl, for a body over 1 KiB)
  // waits for the interim answer before it sends the body; then the body. One read timeout for
  // both.
  void read_next() {
    head_request_ = false;
    parser_.emplace();
    parser_->body_limit(static_cast<std::uint64_t>(state_->options.max_body_bytes));
    stream_.expires_after(seconds(state_->options.read_timeout_s));
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read(ec);
    const auto expect = parser_->get().find(http::field::expect);
    if (expect == parser_->get().end() || !beast::iequals(expect->value(), "100-continue"))
      return read_body();
    net::async_write(stream_, net::buffer(kContinue, sizeof kContinue - 1),
                     [self = shared_from_this()](beast::error_code write_ec, std::size_t) {
                       if (write_ec) return self->close();
                       self->read_body();
                     });
  }

  void read_body() {
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      refuse(http::status::payload_too_large,
             fmt::format("the request body is over the server's limit of {} bytes",
                         state_->options.max_body_bytes));
      return;
    }
    if (ec) return close();   // the client left, timed out, or sent something that is not HTTP
    stream_.expires_never();  // the answer may take as long as the engine does
    HttpRequest request = parser_->release();
    keep_alive_ = request.keep_alive() && !state_->stopping;
    head_request_ = request.method() == http::verb::head;
    http_version_ = request.version();
    busy_ = true;
    ++state_->busy;
    ended_ = false;
    state_->handler(std::move(request), make_reply());
  }

  std::shared_ptr<HttpReply> make_reply();

  // The server's own error answer, then the connection closes.
  void refuse(http::status status, const std::string& message) {
    if (state_->options.on_refused) state_->options.on_refused(static_cast<int>(status));
    keep_alive_ = false;
    busy_ = true;
    ++state_->busy;
    HttpResponse response{status, 11};
    response.set(http::field::content_type, "application/json");
    response.body() = state_->options.error_body
                          ? state_->options.error_body(static_cast<int>(status), message)
                          : message;
    send(std::move(response));
  }

  // `last`: the answer ends with these bytes.
  void queue_write(std::string bytes, bool last) {
    if (gone_ || ended_) return;
    if (last) ended_ = true;
    writes_.push_back({std::move(bytes), last});
    if (writes_.size() == 1) write_front();
  }

  void write_front() {
    stream_.expires_after(seconds(state_->options.read_timeout_s));  // a reader that stalls
    writing_ = true;
    net::async_write(
        stream_, net::buffer(writes_.front().bytes),
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_write(ec); });
  }

  void on_write(beast::error_code ec) {
    writing_ = false;
    if (ec || gone_) return client_gone();
    const bool last = writes_.front().last;
    writes_.pop_front();
    if (last) answer_ended();
    if (!writes_.empty()) return write_front();
    if (!gone_) stream_.expires_never();
  }

  void answer_ended() {
    busy_ = false;
    --state_->busy;
    on_disconnect_ = nullptr;  // it may hold the reply (and so this session)
    if (!keep_alive_ || state_->stopping) return linger_close();
    read_next();
  }

  // Closes after the answer without losing it: our side ends first, then what the client still
  // sends (the rest of a refused body) is read and dropped until it closes too or the read
  // timeout passes; closing with unread bytes would reset the connection, and a client still
  // writing would never read its 413.
  void linger_close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    stream_.expires_after(seconds(state_->options.read_timeout_s));
    drain_input();
  }

  void drain_input() {
    stream_.async_read_some(net::buffer(scratch_),
                            [self = shared_from_this()](beast::error_code ec, std::size_t) {
                              if (ec) return self->close();
                              self->drain_input();
                            });
  }

  // While the handler works: a client that closes its end is seen at once (a readable socket
  // with nothing to read), not only at the next write.
  void watch_disconnect() {
    if (watching_ || gone_) return;
    watching_ = true;
    stream_.socket().async_wait(tcp::socket::wait_read,
                                [self = shared_from_this()](beast::error_code ec) {
                                  self->watching_ = false;
                                  if (ec || !self->busy_) return;
                                  self->peek_for_close();
                                });
  }

  void peek_for_close() {
    char byte = 0;
    beast::error_code ec;
    stream_.socket().non_blocking(true, ec);
    const std::size_t n =
        stream_.socket().receive(net::buffer(&byte, 1), tcp::socket::message_peek, ec);
    if (ec == net::error::would_block) return watch_disconnect();
    if (ec || n == 0) return client_gone();
    // The client sent more (a pipelined request): read after this answer, watched no longer.
  }

  // The client closed, or a write failed. A write under way keeps its bytes until it completes.
  void client_gone() {
    if (!writing_) writes_.clear();
    if (gone_) return;
    gone_ = true;
    if (auto callback = std::exchange(on_disconnect_, nullptr); callback && busy_) callback();
    close();
  }

  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
  }

  struct Write {
    std::string bytes;
    bool last = false;
  };
  beast::tcp_stream stream_;
  HttpServer::State* state_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::deque<Write> writes_;
  std::array<char, 16384> scratch_{};  // linger_close's discarded input
  std::function<void()> on_disconnect_;
  bool keep_alive_ = true, busy_ = false, ended_ = false, gone_ = false, watching_ = false;
  bool writing_ = false;  // an async_write holds writes_.front()'s bytes
  bool head_request_ = false, chunked_ = true;
  unsigned http_version_ = 11;  // of the request being answered: 10 for HTTP/1.0
};

class SessionReply : public HttpReply {
 public:
  explicit SessionReply(std::shared_ptr<Session> session) : session_(std::move(session)) {}
  // The reply may die on the engine thread; the session is let go on its own strand.
  ~SessionReply() override {
    Session& session = *session_;
    session.on_strand([released = std::move(session_)](Session&) {});
  }
  void send(HttpResponse response) override {
    session_->on_strand([r = std::move(response)](Session& s) mutable { s.send(std::move(r)); });
  }
  void start_stream(HttpResponse header) override {
    session_->on_strand(
        [h = std::move(header)](Session& s) mutable { s.start_stream(std::move(h)); });
  }
  void chunk(std::string data) override {
    session_->on_strand([d = std::move(data)](Session& s) { s.chunk(d); });
  }
  void end_stream() override {
    session_->on_strand([](Session& s) { s.end_stream(); });
  }
  void on_disconnect(std::function<void()> callback) override {
    session_->on_strand(
        [c = std::move(callback)](Session& s) mutable { s.set_disconnect(std::move(c)); });
  }

 private:
  std::shared_ptr<Session> session_;
};

std::shared_ptr<HttpReply> Session::make_reply() {
  return std::make_shared<SessionReply>(shared_from_this());
}

void accept_next(HttpServer::State* state) {
  state->acceptor.async_accept(
      net::make_strand(state->ioc), [state](beast::error_code ec, tcp::socket socket) {
        if (state->stopping) return;
        if (!ec) {
          const bool full = state->connections >= state->options.max_connections;
          std::make_shared<Session>(std::move(socket), state)->start(full);
        }
        accept_next(state);
      });
}

// Room for max_connections sockets: the soft limit on open files raised toward the hard one.
void raise_open_file_limit(std::int64_t connections) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const auto wanted = static_cast<rlim_t>(connections + 256);
  if (limit.rlim_cur >= wanted) return;
  limit.rlim_cur = std::min(wanted, limit.rlim_max);
  (void)setrlimit(RLIMIT_NOFILE, &limit);
}

}  // namespace

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler)
    : state_(std::make_unique<State>()) {
  state_->options = std::move(options);
  state_->handler = std::move(handler);
  raise_open_file_limit(state_->options.max_connections);
  const HttpServerOptions& o = state_->options;
  beast::error_code ec;
  const auto address = net::ip::make_address(o.host, ec);
  if (ec) throw Error(fmt::format("--host {}: not an IP address ({})", o.host, ec.message()));
  const tcp::endpoint endpoint{address, o.port};
  auto& acceptor = state_->acceptor;
  if (!acceptor.open(endpoint.protocol(), ec) &&
      !acceptor.set_option(net::socket_base::reuse_address(true), ec) &&
      !acceptor.bind(endpoint, ec) &&
      !acceptor.listen(net::socket_base::max_listen_connections, ec))
    return;
  throw Error(fmt::format("cannot listen on {}:{}: {}", o.host, o.port, ec.message()));
}

HttpServer::~HttpServer() {
  stop();
}

std::uint16_t HttpServer::port() const {
  beast::error_code ec;
  return state_->acceptor.local_endpoint(ec).port();
}

std::int64_t HttpServer::open_connections() const {
  return state_->connections;
}

void HttpServer::run() {
  accept_next(state_.get());
  std::vector<std::thread> threads;
  for (int i = 1; i < std::max(1, state_->options.threads); ++i)
    threads.emplace_back([this] { state_->ioc.run(); });
  state_->ioc.run();
  for (auto& t : threads) t.join();
}

namespace {

// Ends the io_context once no answer is under way, or at the deadline.
void stop_when_answered(HttpServer::State* state, std::shared_ptr<net::steady_timer> timer,
                        std::chrono::steady_clock::time_point deadline) {
  if (state->busy == 0 || std::chrono::steady_clock::now() >= deadline) {
    state->ioc.stop();
    return;
  }
  timer->expires_after(std::chrono::milliseconds(20));
  timer->async_wait(
      [state, timer, deadline](beast::error_code) { stop_when_answered(state, timer, deadline); });
}

}  // namespace

// Stops accepting, gives the answers under way up to 5 s to be written, then ends run().
void HttpServer::stop() {
  if (state_->stopping.exchange(true)) return;
  State* state = state_.get();
  net::post(state->ioc, [state] {
    beast::error_code ec;
    state->acceptor.close(ec);
    stop_when_answered(state, std::make_shared<net::steady_timer>(state->ioc),
                       std::chrono::steady_clock::now() + std::chrono::seconds(5));
  });
}

}  // namespace kvlab::serve
