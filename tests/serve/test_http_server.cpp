// kvlab serve's HTTP server against hostile clients (127.0.0.1 only, every loop bounded): bad
// JSON, unknown fields and a prompt past the context get the API's error shape; a 10 MB body a
// 413; a slow-loris client is cut off at the read timeout; 1,000 idle connections, garbage bytes
// and a connection limit leave the server serving.
#include <gtest/gtest.h>

#include "serve_fixture.hpp"

namespace kvlab::test {
namespace {

using nlohmann::json;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

bool healthy(std::uint16_t port) {
  return http_call(port, http::verb::get, "/health", "", {}, 10).status == 200;
}

// The API's error shape: {"error": {"message": "...", "type": "...", "param", "code"}}.
void expect_api_error(const HttpResult& r, int status, const std::string& words) {
  EXPECT_EQ(r.status, status) << r.body;
  const json body = json::parse(r.body);
  ASSERT_TRUE(body.contains("error")) << r.body;
  EXPECT_TRUE(body["error"]["type"].is_string());
  EXPECT_TRUE(body["error"].contains("param"));
  EXPECT_TRUE(body["error"].contains("code"));
  EXPECT_NE(body["error"]["message"].get<std::string>().find(words), std::string::npos) << r.body;
}

TEST(ServeHostile, BadRequestsGetTheApisErrorShape) {
  ServedStack stack;
  const auto port = stack.port();
  const std::string model = stack.model_name();
  expect_api_error(http_call(port, http::verb::post, "/v1/completions", "{\"model\": "), 400,
                   "not valid JSON");
  expect_api_error(http_call(port, http::verb::post, "/v1/completions", "[1, 2]"), 400,
                   "JSON object");
  expect_api_error(
      post_json(port, "/v1/completions", {{"model", model}, {"prompt", {1}}, {"x", 1}}), 400,
      "Unrecognized request argument supplied: x");
  expect_api_error(
      post_json(port, "/v1/completions", {{"model", model}, {"prompt", {1}}, {"max_tokens", 9999}}),
      400, "maximum context length is 256");
  expect_api_error(post_json(port, "/v1/completions",
                             {{"model", model}, {"prompt", {1}}, {"temperature", "hot"}}),
                   400, "'temperature' must be a number");
  expect_api_error(post_json(port, "/v1/completions", {{"model", model}, {"prompt", {1, -3}}}), 400,
                   "token ids");
  expect_api_error(post_json(port, "/v1/completions", {{"model", model}, {"prompt", {999999}}}),
                   400, "outside the vocabulary");
  expect_api_error(post_json(port, "/v1/completions", {{"model", model}, {"prompt", "text"}}), 400,
                   "no tokenizer");
  expect_api_error(post_json(port, "/v1/completions", {{"model", "gpt-4"}, {"prompt", {1}}}), 404,
                   "does not exist");
  EXPECT_TRUE(healthy(port));
}

TEST(ServeHostile, TenMegabyteBodyGets413) {
  serve::HttpServerOptions http_options;
  http_options.max_body_bytes = 4 << 20;
  ServedStack stack({}, {}, http_options);
  const std::string huge = "{\"prompt\": \"" + std::string(10 << 20, 'a') + "\"}";
  expect_api_error(http_call(stack.port(), http::verb::post, "/v1/completions", huge), 413,
                   "over the server's limit");
  EXPECT_TRUE(healthy(stack.port()));
}

TEST(ServeHostile, SlowLorisIsCutOffAtTheReadTimeout) {
  serve::HttpServerOptions http_options;
  http_options.read_timeout_s = 1;
  ServedStack stack({}, {}, http_options);
  net::io_context ioc;
  tcp::socket slow(ioc);
  slow.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  net::write(slow, net::buffer(std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\n")));
  const auto start = std::chrono::steady_clock::now();
  boost::system::error_code ec;
  for (int i = 0; i < 40 && !ec; ++i) {  // a header byte every 0.1 s: never a whole request
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    net::write(slow, net::buffer(std::string("X")), ec);
    if (!ec && i < 5) {
      EXPECT_TRUE(healthy(stack.port()));  // others are served meanwhile
    }
  }
  char byte = 0;
  if (!ec) slow.read_some(net::buffer(&byte, 1), ec);  // the server's close
  const double held =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(ec) << "the connection is still open after " << held << " s";
  EXPECT_LT(held, 3.0);
  EXPECT_TRUE(healthy(stack.port()));
}

TEST(ServeHostile, ThousandIdleConnectionsLeaveTheServerServing) {
  ServedStack stack;
  net::io_context ioc;
  std::vector<tcp::socket> idle;
  for (int i = 0; i < 1000; ++i) {
    idle.emplace_back(ioc);
    idle.back().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  }
  EXPECT_TRUE(healthy(stack.port()));
  const HttpResult r =
      post_json(stack.port(), "/v1/completions",
                {{"model", stack.model_name()}, {"prompt", {1, 2}}, {"max_tokens", 3}});
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(eventually_connections(stack, 1000));
}

TEST(ServeHostile, ConnectionsPastTheLimitGet503) {
  serve::HttpServerOptions http_options;
  http_options.max_connections = 4;
  ServedStack stack({}, {}, http_options);
  net::io_context ioc;
  std::vector<tcp::socket> held;
  for (int i = 0; i < 4; ++i) {
    held.emplace_back(ioc);
    held.back().connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  }
  ASSERT_TRUE(eventually_connections(stack, 4));
  expect_api_error(http_call(stack.port(), http::verb::get, "/health"), 503, "its limit");
  for (auto& s : held) s.close();
  ASSERT_TRUE(eventually_connections(stack, 0));
  EXPECT_TRUE(healthy(stack.port()));
}

// curl sends "Expect: 100-continue" before a body over 1 KiB and waits (1 s) for the interim
// answer: it gets it at once, then the whole answer.
TEST(ServeHostile, ExpectContinueGetsItsInterimAnswer) {
  ServedStack stack;
  net::io_context ioc;
  tcp::socket client(ioc);
  client.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  const std::string body =
      json{{"model", stack.model_name()}, {"prompt", {1, 2}}, {"max_tokens", 2}}.dump();
  net::write(client, net::buffer(fmt::format(
                         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         "application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
                         body.size())));
  std::string interim(25, '\0');
  net::read(client, net::buffer(interim));  // before any body byte was sent
  EXPECT_EQ(interim, "HTTP/1.1 100 Continue\r\n\r\n");
  net::write(client, net::buffer(body));
  boost::beast::flat_buffer buffer;
  http::response<http::string_body> response;
  http::read(client, buffer, response);
  EXPECT_EQ(response.result_int(), 200u) << response.body();
}

TEST(ServeHostile, GarbageBytesCloseOnlyThatConnection) {
  ServedStack stack;
  net::io_context ioc;
  tcp::socket garbage(ioc);
  garbage.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  net::write(garbage, net::buffer(std::string("\x16\x03\x01 not http at all\r\n\r\n\r\n")));
  char byte = 0;
  boost::system::error_code ec;
  garbage.read_some(net::buffer(&byte, 1), ec);
  EXPECT_TRUE(ec);  // closed
  EXPECT_TRUE(healthy(stack.port()));
}

}  // namespace
}  // namespace kvlab::test
