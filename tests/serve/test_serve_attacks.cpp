// kvlab serve against an attacker and a careless client (127.0.0.1 only, every loop bounded):
// bodies nested a million deep, HEAD, HTTP/1.0 streams, the server's own refusals in /metrics,
// `user` strings that would forge the record's rows or bloat it, one client probing another's
// prompt through the prefix cache (the live view's detail, cache_salt), the journal that keeps
// the record when the process dies, and `created` as the answer's time.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <array>
#include <fstream>
#include <sstream>

#include "kvlab/experiment/results_view.hpp"
#include "serve_fixture.hpp"

namespace kvlab::test {
namespace {

using nlohmann::json;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Bytes sent on a fresh connection, everything read back until the server closes it.
std::string raw_exchange(std::uint16_t port, const std::string& bytes) {
  net::io_context ioc;
  boost::beast::tcp_stream stream(ioc);
  stream.expires_after(std::chrono::seconds(60));
  stream.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  net::write(stream.socket(), net::buffer(bytes));
  std::string answer;
  boost::beast::error_code ec;
  for (std::array<char, 4096> chunk{};;) {
    const std::size_t n = stream.read_some(net::buffer(chunk), ec);
    answer.append(chunk.data(), n);
    if (ec) break;
  }
  return answer;
}

std::string post_bytes(const std::string& target, const std::string& body,
                       const std::string& version = "1.1") {
  return fmt::format(
      "POST {} HTTP/{}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
      "{}\r\nConnection: close\r\n\r\n{}",
      target, version, body.size(), body);
}

std::string nested(std::size_t depth, const std::string& inside) {
  return std::string(depth, '[') + inside + std::string(depth, ']');
}

// A prompt (or prompt ids, or messages) nested 100,000 and 1,000,000 deep once killed the server
// with SIGSEGV: a message dumped part of it, recursively. Now a 400 before anything is parsed.
TEST(ServeAttacks, DeeplyNestedBodiesGet400AndTheServerLives) {
  serve::HttpServerOptions options;
  options.max_body_bytes = 8 << 20;
  ServedStack stack({}, {}, options);
  const std::string model = stack.model_name();
  for (const std::size_t depth : {100'000u, 1'000'000u}) {
    for (const std::string& body :
         {"{\"model\": \"" + model + "\", \"prompt\": " + nested(depth, "1") + "}",
          "{\"model\": \"" + model + "\", \"prompt\": [" + nested(depth, "") + "]}",
          "{\"model\": \"" + model + "\", \"messages\": [{\"role\": \"user\", \"content\": " +
              nested(depth, "") + "}]}"}) {
      const HttpResult r = http_call(stack.port(), http::verb::post, "/v1/completions", body);
      EXPECT_EQ(r.status, 400) << depth;
      EXPECT_NE(r.body.find("nested deeper than 32 levels"), std::string::npos) << r.body;
    }
  }
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/health", "", {}, 10).status, 200);
}

// HEAD answers as GET without a body (a 405 too, with Allow); HTTP/1.0 has no chunked encoding:
// its stream is the bytes as they come, ended by the close.
TEST(ServeAttacks, HeadHasNoBodyAndHttp10StreamsAreNotChunked) {
  ServedStack stack;
  const std::string head = raw_exchange(
      stack.port(), "HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(head.starts_with("HTTP/1.1 200")) << head;
  EXPECT_NE(head.find("Content-Length: 15"), std::string::npos) << head;  // {"status":"ok"}
  EXPECT_TRUE(head.ends_with("\r\n\r\n")) << head;
  const std::string refused =
      raw_exchange(stack.port(),
                   "HEAD /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(refused.starts_with("HTTP/1.1 405")) << refused;
  EXPECT_NE(refused.find("Allow: POST"), std::string::npos) << refused;
  EXPECT_TRUE(refused.ends_with("\r\n\r\n")) << refused;

  const json body = {{"model", stack.model_name()},
                     {"prompt", {1, 2, 3}},
                     {"max_tokens", 4},
                     {"stream", true},
                     {"ignore_eos", true}};
  const std::string old =
      raw_exchange(stack.port(), post_bytes("/v1/completions", body.dump(), "1.0"));
  EXPECT_TRUE(old.starts_with("HTTP/1.1 200")) << old;
  EXPECT_EQ(old.find("chunked"), std::string::npos) << old;
  const std::string events = old.substr(old.find("\r\n\r\n") + 4);
  EXPECT_TRUE(events.starts_with("data: {")) << events;  // no chunk size before it
  EXPECT_TRUE(events.ends_with("data: [DONE]\n\n")) << events;
  EXPECT_EQ(sse_events(events).size(), 6u);  // four tokens, the finish, [DONE]
  const std::string new_client =
      raw_exchange(stack.port(), post_bytes("/v1/completions", body.dump(), "1.1"));
  EXPECT_NE(new_client.find("Transfer-Encoding: chunked"), std::string::npos) << new_client;
}

// The HTTP layer's own answers (413 past the body limit, 503 past the connection limit) are
// counted in /metrics with the routes' answers.
TEST(ServeAttacks, MetricsCountTheHttpLayersOwnRefusals) {
  serve::HttpServerOptions options;
  options.max_body_bytes = 1 << 10;
  ServedStack stack({}, {}, options);
  const HttpResult big = http_call(stack.port(), http::verb::post, "/v1/completions",
                                   "{\"prompt\": \"" + std::string(4096, 'a') + "\"}");
  ASSERT_EQ(big.status, 413);
  const HttpResult m = http_call(stack.port(), http::verb::get, "/metrics");
  EXPECT_NE(m.body.find("kvlab_http_responses_total{code=\"413\"} 1\n"), std::string::npos)
      << m.body;
}

// `user` is written into requests.csv and the summary: control characters and a string past 256
// bytes are 400s; a comma or a quote is kept, and the CSV quotes it; past --max-users distinct
// users, a new one is a 400 (47 MB of user strings once made a 281 MB summary.json).
TEST(ServeAttacks, UserStringsAreBoundedAndCannotForgeTheRecord) {
  ServedStack stack(small_served_experiment({}), {}, {}, {},
                    [](serve::OpenAiOptions& o) { o.max_users = 2; });
  const auto ask = [&](const std::string& user) {
    json body = {{"model", stack.model_name()},
                 {"prompt", {1, 2}},
                 {"max_tokens", 2},
                 {"ignore_eos", true},
                 {"user", user}};
    return post_json(stack.port(), "/v1/completions", body);
  };
  for (const std::string& bad :
       {std::string("a\nb"), std::string("x\r"), std::string(1, '\0'), std::string(257, 'u')}) {
    const HttpResult r = ask(bad);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(r.json()["error"]["param"], "user");
  }
  EXPECT_EQ(ask("evil,\"tenant\"").status, 200);
  EXPECT_EQ(ask("b").status, 200);
  const HttpResult third = ask("c");
  EXPECT_EQ(third.status, 400);
  EXPECT_NE(third.body.find("at most 2 distinct 'user' values"), std::string::npos) << third.body;
  EXPECT_EQ(ask("b").status, 200);  // a known user still is
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  const TempDir dir;
  write_run_outputs(dir / "run", stack.config(), out);
  const std::string csv = read_file(dir / "run" / "requests.csv");
  EXPECT_NE(csv.find(",\"evil,\"\"tenant\"\"\","), std::string::npos) << csv;
  std::istringstream lines(csv);
  std::string header, row;
  std::getline(lines, header);
  const std::size_t columns = csv_row_cells(header).size();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(std::getline(lines, row));
    EXPECT_EQ(csv_row_cells(row).size(), columns) << row;
  }
}

// With prefix caching, a client could tell whether another's prompt starts with a guessed text
// from /ui/data's per-step prefill counts. By default /ui shows aggregates only; --ui full (the
// operator's choice) opens it, --ui off closes it.
TEST(ServeAttacks, TheLiveViewShowsOnlyAggregatesByDefault) {
  ServedStack stack;
  ASSERT_EQ(post_json(stack.port(), "/v1/completions",
                      {{"model", stack.model_name()}, {"prompt", {1, 2, 3}}, {"max_tokens", 3}})
                .status,
            200);
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().running == 0; }));
  const json run = http_call(stack.port(), http::verb::get, "/ui/data").json()["runs"][0];
  EXPECT_TRUE(run["steps"]["batch"].size() >= 3u);
  for (const char* hidden : {"prefill", "decode", "used", "cached", "capacity"})
    EXPECT_FALSE(run["steps"].contains(hidden)) << hidden;
  EXPECT_TRUE(run["requests"]["id"].empty());
  EXPECT_TRUE(run["events"].empty());
  EXPECT_TRUE(run["frames"].empty());
  EXPECT_NE(run["withheld"].get<std::string>().find("--ui full"), std::string::npos);
  ServedStack closed(small_served_experiment({}), {}, {}, {},
                     [](serve::OpenAiOptions& o) { o.ui = std::nullopt; });
  EXPECT_EQ(http_call(closed.port(), http::verb::get, "/ui").status, 404);
  EXPECT_EQ(http_call(closed.port(), http::verb::get, "/ui/data").status, 404);
}

// cache_salt (vLLM's): a prompt's prefix blocks are found only by requests with the same salt.
// A prober without the victim's salt prefills the whole guessed prompt whether it is right or
// not; the same salt (or none on both sides) still shares.
TEST(ServeAttacks, CacheSaltKeepsPrefixSharingWithinASalt) {
  ServedStack stack({"kv_cache.params.prefix_caching=true"});
  std::vector<int> prompt(40);  // two whole blocks of 16 a later request may find
  for (int i = 0; i < 40; ++i) prompt[static_cast<std::size_t>(i)] = 3 + i;
  std::int64_t asked = 0;
  // The hits after one more request. The engine's KV counters land at a turn of its loop after
  // the answer: wait for its 40 prompt tokens to be counted as looked up.
  const auto hits_after = [&](const json& extra) {
    json body = {{"model", stack.model_name()}, {"prompt", prompt}, {"max_tokens", 1}};
    body.update(extra);
    EXPECT_EQ(post_json(stack.port(), "/v1/completions", body).status, 200);
    asked += 40;
    EXPECT_TRUE(eventually(
        [&] { return stack.served().engine().stats().kv.prefix_query_tokens == asked; }));
    return stack.served().engine().stats().kv.prefix_hit_tokens;
  };
  const std::int64_t first = hits_after({{"cache_salt", "victim-secret"}});
  EXPECT_EQ(first, 0);
  EXPECT_EQ(hits_after(json::object()), first);             // no salt: no hit
  EXPECT_EQ(hits_after({{"cache_salt", "guess"}}), first);  // another salt: no hit
  const std::int64_t shared = hits_after({{"cache_salt", "victim-secret"}});
  EXPECT_EQ(shared - first, 32);  // both whole blocks
  const std::int64_t unsalted = hits_after(json::object());
  EXPECT_EQ(unsalted - shared, 32);  // unsalted requests share with each other
  EXPECT_EQ(post_json(stack.port(), "/v1/completions",
                      {{"model", stack.model_name()}, {"prompt", prompt}, {"cache_salt", ""}})
                .status,
            400);
}

// Each choice is in the journal the moment it ends (the record that survives a crash), and
// `created` is when the request came, not when the server started.
TEST(ServeAttacks, TheJournalHasEveryChoiceAsItEndsAndCreatedIsTheAnswersTime) {
  const TempDir dir;
  const std::filesystem::path journal = dir / "journal.jsonl";
  ServedStack stack(small_served_experiment({}), {}, {}, {},
                    [&](serve::OpenAiOptions& o) { o.journal = journal; });
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // past the server's start second
  const auto before = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const HttpResult r = post_json(stack.port(), "/v1/completions",
                                 {{"model", stack.model_name()},
                                  {"prompt", {1, 2, 3}},
                                  {"max_tokens", 3},
                                  {"n", 2},
                                  {"user", "u1"},
                                  {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200);
  EXPECT_GE(r.json()["created"].get<std::int64_t>(), before);
  std::ifstream in(journal);
  std::vector<json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(json::parse(line));
  ASSERT_EQ(lines.size(), 2u);  // written before the answer went out
  for (const json& line : lines) {
    EXPECT_EQ(line["request"], r.json()["id"]);
    EXPECT_EQ(line["user"], "u1");
    EXPECT_EQ(line["output_tokens"], 3);
    EXPECT_EQ(line["finish_reason"], "max_tokens");  // the engine's reason
    EXPECT_EQ(line["created"], r.json()["created"]);
  }
}

}  // namespace
}  // namespace kvlab::test
