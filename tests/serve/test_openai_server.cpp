// kvlab serve's OpenAI routes against a live engine (stories15m-shaped random weights on the cpu
// backend, 127.0.0.1 only): whole and streamed answers, n and seeds, stop strings, logprobs, the
// API key, 429 on a full queue, 400 for a request that never fits, a disconnect freeing KV, the
// served run as a results record, and /metrics.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <set>
#include <sstream>

#include "serve_fixture.hpp"

namespace kvlab::test {
namespace {

using nlohmann::json;
namespace http = boost::beast::http;

json completion(const std::string& model, int max_tokens, json extra = json::object()) {
  json body = {{"model", model},
               {"prompt", {1, 2, 3, 4, 5, 6, 7, 8}},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"ignore_eos", true}};
  body.update(extra);
  return body;
}

std::vector<std::int32_t> ids_of(const std::string& text) {  // a preset's " <id>" text
  std::istringstream in(text);
  std::vector<std::int32_t> ids;
  for (std::int32_t id = 0; in >> id;) ids.push_back(id);
  return ids;
}

TEST(Serve, StreamedAndWholeAnswersCarryTheEnginesTokens) {
  ServedStack stack;
  const HttpResult whole =
      post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 12));
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json body = whole.json();
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["prompt_tokens"], 8);
  EXPECT_EQ(body["usage"]["completion_tokens"], 12);
  EXPECT_EQ(body["usage"]["total_tokens"], 20);
  const std::string text = body["choices"][0]["text"];

  const HttpResult streamed =
      post_json(stack.port(), "/v1/completions",
                completion(stack.model_name(), 12,
                           {{"stream", true}, {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_EQ(streamed.headers.at("Content-Type"), "text/event-stream");
  const auto events = sse_events(streamed.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string joined;
  for (std::size_t i = 0; i + 2 < events.size(); ++i) {
    const json chunk = json::parse(events[i]);
    joined += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, text);  // greedy: the same tokens either way
  EXPECT_EQ(json::parse(events[events.size() - 3])["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(json::parse(events[events.size() - 2])["usage"]["completion_tokens"], 12);

  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_EQ(out.engine.requests.size(), 2u);  // both in the run's record, in order
  EXPECT_EQ(out.engine.tokens[0], ids_of(text));
  EXPECT_EQ(out.engine.tokens[1], ids_of(text));
}

TEST(Serve, SeededChoicesAreReproducibleAndDiffer) {
  ServedStack stack;
  const json request =
      completion(stack.model_name(), 8, {{"temperature", 1.5}, {"n", 4}, {"seed", 7}});
  const json first = post_json(stack.port(), "/v1/completions", request).json();
  const json again = post_json(stack.port(), "/v1/completions", request).json();
  ASSERT_EQ(first["choices"].size(), 4u);
  std::set<std::string> distinct;
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(first["choices"][i]["index"], i);
    EXPECT_EQ(first["choices"][i]["text"], again["choices"][i]["text"]) << "choice " << i;
    distinct.insert(first["choices"][i]["text"].get<std::string>());
  }
  EXPECT_GT(distinct.size(), 1u);                 // seed + i per choice
  EXPECT_EQ(first["usage"]["prompt_tokens"], 8);  // the prompt once
  EXPECT_EQ(first["usage"]["completion_tokens"], 32);
}

TEST(Serve, StopStringCutsTheTextAndEndsTheRequest) {
  ServedStack stack;
  const std::string text =
      post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 24))
          .json()["choices"][0]["text"];
  const auto ids = ids_of(text);
  ASSERT_GE(ids.size(), 4u);
  const std::string stop = fmt::format(" {}", ids[2]);
  const std::string expected = text.substr(0, text.find(stop));
  for (const bool stream : {false, true}) {
    const HttpResult r =
        post_json(stack.port(), "/v1/completions",
                  completion(stack.model_name(), 24, {{"stop", {stop}}, {"stream", stream}}));
    ASSERT_EQ(r.status, 200) << r.body;
    std::string got;
    std::string finish;
    if (stream) {
      for (const auto& e : sse_events(r.body))
        if (e != "[DONE]") {
          const json c = json::parse(e)["choices"][0];
          got += c["text"].get<std::string>();
          if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
        }
    } else {
      got = r.json()["choices"][0]["text"];
      finish = r.json()["choices"][0]["finish_reason"];
      EXPECT_LT(r.json()["usage"]["completion_tokens"], 24);  // cancelled, not run to the end
    }
    EXPECT_EQ(got, expected) << "stream " << stream;
    EXPECT_EQ(finish, "stop");
  }
}

TEST(Serve, LogprobsComeWithEveryToken) {
  ServedStack stack;
  const json r = post_json(stack.port(), "/v1/completions",
                           completion(stack.model_name(), 6, {{"logprobs", 3}}))
                     .json();
  const json& lp = r["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 6u);
  ASSERT_EQ(lp["token_logprobs"].size(), 6u);
  ASSERT_EQ(lp["top_logprobs"].size(), 6u);
  std::string joined;
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_EQ(lp["top_logprobs"][i].size(), 3u);
    // Greedy: the chosen token is the most likely one.
    double best = -1e30;
    for (const auto& [token, logprob] : lp["top_logprobs"][i].items())
      best = std::max(best, logprob.get<double>());
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), best, 1e-6);
    EXPECT_EQ(lp["text_offset"][i], joined.size());
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, r["choices"][0]["text"]);
}

// [speculation] served: prompt lookup verifies the proposals of live requests, and a greedy
// answer with logprobs is the one a server without speculation gives, token for token, each
// token's logprob within 1e-5 (a verify's rows go through products of more rows than a decode's).
TEST(Serve, SpeculationAnswersAsDecodingWouldWithTheSameLogprobs) {
  const json request_extra = {{"logprobs", 2}};
  json plain_answer, speculative_answer;
  {
    ServedStack stack;
    plain_answer = post_json(stack.port(), "/v1/completions",
                             completion(stack.model_name(), 24, request_extra))
                       .json();
  }
  ServedStack stack({"speculation={tokens=4}"});
  speculative_answer =
      post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 24, request_extra))
          .json();
  const json &want = plain_answer["choices"][0], &got = speculative_answer["choices"][0];
  EXPECT_EQ(got["text"], want["text"]);
  ASSERT_EQ(got["logprobs"]["token_logprobs"].size(), 24u);
  for (std::size_t i = 0; i < 24; ++i)
    EXPECT_NEAR(got["logprobs"]["token_logprobs"][i].get<double>(),
                want["logprobs"]["token_logprobs"][i].get<double>(), 1e-5)
        << "token " << i;
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_FALSE(out.engine.verifies.empty()) << "the served run verified proposals";
  std::int64_t accepted = 0;
  for (const VerifyRecord& v : out.engine.verifies) accepted += v.accepted;
  EXPECT_GT(accepted, 0);
}

TEST(Serve, ApiKeyGuardsEveryRouteButHealth) {
  ServedStack stack(std::vector<std::string>{}, {}, {}, "sk-test");
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/health").status, 200);
  for (const char* route : {"/v1/models", "/metrics"}) {
    const HttpResult no_key = http_call(stack.port(), http::verb::get, route);
    EXPECT_EQ(no_key.status, 401) << route;
    EXPECT_EQ(no_key.json()["error"]["code"], "invalid_api_key");
    EXPECT_EQ(http_call(stack.port(), http::verb::get, route, "", {{"Authorization", "Bearer no"}})
                  .status,
              401);
    EXPECT_EQ(
        http_call(stack.port(), http::verb::get, route, "", {{"Authorization", "Bearer sk-test"}})
            .status,
        200);
  }
  EXPECT_EQ(post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 2)).status,
            401);
  // A browser opening /ui cannot send the header: the key as ?api_key= (only on /ui).
  for (const char* route : {"/ui", "/ui/data"}) {
    EXPECT_EQ(http_call(stack.port(), http::verb::get, route).status, 401) << route;
    EXPECT_EQ(http_call(stack.port(), http::verb::get, std::string(route) + "?api_key=no").status,
              401);
    EXPECT_EQ(http_call(stack.port(), http::verb::get, std::string(route) + "?x=1&api_key=sk-test")
                  .status,
              200);
  }
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/metrics?api_key=sk-test").status, 401);
}

// /ui: kvlab view's page, live; /ui/data (--ui full): the engine's latest steps, requests,
// events and pool frames as the page's data, the steps the engine ran.
TEST(Serve, UiShowsTheEnginesLatestSteps) {
  ServedStack stack(small_served_experiment({}), {}, {}, {},
                    [](serve::OpenAiOptions& o) { o.ui = LiveViewDetail::full; });
  ASSERT_EQ(post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 5)).status,
            200);
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().running == 0; }));
  const HttpResult page = http_call(stack.port(), http::verb::get, "/ui");
  ASSERT_EQ(page.status, 200);
  EXPECT_EQ(page.headers.at("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page.body.find("data-live=\"true\""), std::string::npos);
  EXPECT_EQ(page.headers.at("Content-Security-Policy"), "frame-ancestors 'none'");
  EXPECT_EQ(page.headers.at("Referrer-Policy"), "no-referrer");
  const HttpResult data = http_call(stack.port(), http::verb::get, "/ui/data");
  ASSERT_EQ(data.status, 200);
  const nlohmann::json run = data.json()["runs"][0];
  const auto steps = run["steps"]["step"].size();
  EXPECT_EQ(static_cast<std::int64_t>(steps), stack.served().engine().stats().steps);
  ASSERT_EQ(run["requests"]["id"].size(), 1u);
  EXPECT_EQ(run["requests"]["output"][0], 5);
  EXPECT_EQ(run["requests"]["prompt"][0], 8);
  EXPECT_TRUE(run["requests"]["finish"][0].is_number());
  EXPECT_GE(run["frames"].size(), 1u);  // the first step's, at least (then ~10 a second)
  EXPECT_EQ(run["events"][0][1], "admit");
}

TEST(Serve, FullQueueAnswers429WithRetryAfter) {
  LiveOptions live;
  live.max_queued = 1;
  // Paced steps: the first two stay in flight (~1 s each) while the third arrives, under ASan too.
  ServedStack stack(paced_served_experiment({"scheduler.params.max_batch=1"}), live, {}, {});
  const json slow = completion(stack.model_name(), 200);
  auto first = std::async(std::launch::async,
                          [&] { return post_json(stack.port(), "/v1/completions", slow); });
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().running == 1; }));
  auto second = std::async(std::launch::async,
                           [&] { return post_json(stack.port(), "/v1/completions", slow); });
  ASSERT_TRUE(eventually([&] {
    const LiveStats s = stack.served().engine().stats();
    return s.waiting + s.queued == 1;
  }));
  const HttpResult refused =
      post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 2));
  EXPECT_EQ(refused.status, 429);
  EXPECT_EQ(refused.headers.at("Retry-After"), "1");
  EXPECT_EQ(refused.json()["error"]["type"], "rate_limit_error");
  EXPECT_EQ(first.get().status, 200);
  EXPECT_EQ(second.get().status, 200);
}

TEST(Serve, RequestThatCanNeverFitGets400WithTheEnginesReason) {
  ServedStack stack({"kv_cache.slots=64"});
  json request = completion(stack.model_name(), 16);
  request["prompt"] = std::vector<int>(100, 5);
  const HttpResult r = post_json(stack.port(), "/v1/completions", request);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(r.json()["error"]["code"], "request_never_fits");
  EXPECT_NE(r.body.find("64"), std::string::npos) << r.body;  // the pool's size, in the reason
  EXPECT_EQ(post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 2)).status,
            200);  // and the server goes on
  // Without max_tokens the answer's room is what the pool holds, not the context's 256.
  json unbounded = completion(stack.model_name(), 1);
  unbounded.erase("max_tokens");
  unbounded["prompt"] = std::vector<int>(60, 5);
  const HttpResult fits = post_json(stack.port(), "/v1/completions", unbounded);
  ASSERT_EQ(fits.status, 200) << fits.body;
  EXPECT_EQ(fits.json()["usage"]["completion_tokens"], 4);  // 64 slots - 60
}

TEST(Serve, ClientThatDisconnectsIsCancelledAndItsKvFreed) {
  ServedStack stack;
  namespace net = boost::asio;
  net::io_context ioc;
  boost::beast::tcp_stream client(ioc);
  client.expires_after(std::chrono::seconds(30));
  client.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), stack.port()));
  http::request<http::string_body> request{http::verb::post, "/v1/completions", 11};
  request.set(http::field::host, "127.0.0.1");
  request.body() = completion(stack.model_name(), 200, {{"stream", true}}).dump();
  request.prepare_payload();
  http::write(client, request);
  char first[64];
  client.read_some(net::buffer(first));  // the answer has started
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().kv.used > 0; }));
  client.close();
  EXPECT_TRUE(eventually([&] {
    const LiveStats s = stack.served().engine().stats();
    return s.cancelled == 1 && s.kv.used == 0;
  }));
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_EQ(out.engine.requests.size(), 1u);
  EXPECT_EQ(out.engine.requests[0].finish_reason, "cancelled");
  EXPECT_LT(out.engine.tokens[0].size(), 200u);
}

TEST(Serve, MetricsShowTheEngineAndTheLatencies) {
  ServedStack stack;
  ASSERT_EQ(post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 5)).status,
            200);
  // The answer goes out as the request ends; the engine's counts follow at its loop's next turn.
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().running == 0; }));
  const HttpResult m = http_call(stack.port(), http::verb::get, "/metrics");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(m.headers.at("Content-Type"), "text/plain; version=0.0.4");
  for (const char* line :
       {"kvlab_finished_total 1\n", "kvlab_kv_slots 2048\n", "kvlab_ttft_s_count 1\n",
        "kvlab_itl_s_count 4\n", "kvlab_tpot_s_count 1\n", "kvlab_completion_tokens_total 5\n",
        "kvlab_prompt_tokens_total 8\n", "kvlab_running 0\n", "kvlab_queue_length 0\n",
        "kvlab_http_responses_total{code=\"200\"} 1\n"})
    EXPECT_NE(m.body.find(line), std::string::npos) << line << "\n" << m.body;
}

// priority (vLLM's extension) reaches the priority scheduler: with one sequence at a time, a
// request of priority 5 sent after two of priority 0 runs before the second of them; `user`
// is the engine request's tenant.
TEST(Serve, PriorityAndUserReachTheScheduler) {
  ServedStack stack(
      paced_served_experiment({"scheduler.name=priority", "scheduler.params.max_batch=1"}), {}, {},
      {});
  const auto send = [&](int priority, const std::string& user) {
    return std::async(std::launch::async, [&, priority, user] {
      return post_json(
          stack.port(), "/v1/completions",
          completion(stack.model_name(), 60, {{"priority", priority}, {"user", user}}));
    });
  };
  auto first = send(0, "a");
  ASSERT_TRUE(eventually([&] { return stack.served().engine().stats().running == 1; }));
  auto low = send(0, "b");
  ASSERT_TRUE(eventually([&] {
    const LiveStats s = stack.served().engine().stats();
    return s.waiting + s.queued == 1;
  }));
  auto high = send(5, "c");
  for (auto* f : {&first, &low, &high}) EXPECT_EQ(f->get().status, 200);
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_EQ(out.engine.requests.size(), 3u);
  EXPECT_EQ(out.engine.requests[2].priority, 5);
  EXPECT_EQ(out.engine.requests[1].tenant, "b");
  EXPECT_LT(*out.engine.requests[2].first_scheduled_s, *out.engine.requests[1].first_scheduled_s);
}

TEST(Serve, ModelsAndHealthAnswer) {
  ServedStack stack;
  const json models = http_call(stack.port(), http::verb::get, "/v1/models").json();
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], stack.model_name());
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/health").json()["status"], "ok");
  stack.openai().set_draining();
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/health").status, 503);
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/nowhere").status, 404);
  EXPECT_EQ(http_call(stack.port(), http::verb::get, "/v1/completions").status, 405);
}

// [cluster]: two replicas behind round robin. Four requests answer; /metrics shows each replica;
// the served record is a cluster's (each replica's summary, a route event per request).
TEST(Serve, AClusterServesBehindItsRouterAndRecordsEachReplica) {
  ServedStack stack({"cluster.replicas=2", "cluster.router=round_robin"});
  std::vector<std::future<HttpResult>> answers;
  for (int i = 0; i < 4; ++i)
    answers.push_back(std::async(std::launch::async, [&] {
      return post_json(stack.port(), "/v1/completions", completion(stack.model_name(), 6));
    }));
  std::set<std::string> texts;
  for (auto& a : answers) {
    const HttpResult r = a.get();
    ASSERT_EQ(r.status, 200) << r.body;
    texts.insert(r.json()["choices"][0]["text"].get<std::string>());
  }
  EXPECT_EQ(texts.size(), 1u) << "greedy: the same prompt, the same text on either replica";
  // The answers go out as the requests end; the counts follow at each replica's next loop turn.
  ASSERT_TRUE(eventually([&] {
    const LiveStats s = stack.served().engine().stats();
    return s.finished == 4 && s.running == 0;
  }));
  const HttpResult m = http_call(stack.port(), http::verb::get, "/metrics");
  for (const char* line : {"kvlab_finished_total 4\n", "kvlab_kv_slots 4096\n",
                           "kvlab_replica_finished_total{replica=\"0\"} 2\n",
                           "kvlab_replica_finished_total{replica=\"1\"} 2\n",
                           "kvlab_replica_running{replica=\"1\"} 0\n"})
    EXPECT_NE(m.body.find(line), std::string::npos) << line << "\n" << m.body;
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_EQ(out.replicas.size(), 2u);
  EXPECT_EQ(out.replicas[0].requests, 2);
  EXPECT_EQ(out.replicas[1].requests, 2);
  ASSERT_EQ(out.engine.requests.size(), 4u);
  const auto routes =
      std::count_if(out.engine.events.begin(), out.engine.events.end(),
                    [](const EngineEvent& e) { return e.kind == EventKind::event_route; });
  EXPECT_EQ(routes, 4);
}

// [cluster] prefill_replicas = 1 of 3: each request is prefilled on replica 0 and its KV handed
// to a decode replica (round robin), the answer streaming from both: the same greedy text as one
// replica gives. /metrics counts the handoffs; the record has every request's decode route.
TEST(Serve, ADisaggregatedClusterHandsEachRequestsKvToADecodeReplica) {
  const std::string alone = [] {
    ServedStack one;
    return post_json(one.port(), "/v1/completions", completion(one.model_name(), 6))
        .json()["choices"][0]["text"]
        .get<std::string>();
  }();
  ServedStack stack({"cluster.replicas=3", "cluster.prefill_replicas=1",
                     "cluster.router=round_robin", "cluster.decode_router=round_robin"});
  for (const bool stream : {false, true, false, true}) {
    const HttpResult r = post_json(stack.port(), "/v1/completions",
                                   completion(stack.model_name(), 6, {{"stream", stream}}));
    ASSERT_EQ(r.status, 200) << r.body;
    std::string text;
    if (stream) {
      for (const auto& e : sse_events(r.body))
        if (e != "[DONE]") text += json::parse(e)["choices"][0]["text"].get<std::string>();
    } else {
      text = r.json()["choices"][0]["text"];
    }
    EXPECT_EQ(text, alone) << "stream " << stream;
  }
  ASSERT_TRUE(eventually([&] {
    const LiveStats s = stack.served().engine().stats();
    return s.finished == 4 && s.running == 0;
  }));
  const HttpResult m = http_call(stack.port(), http::verb::get, "/metrics");
  for (const char* line :
       {"kvlab_kv_handoffs_total 4\n", "kvlab_replica_kv_handoffs_total{replica=\"0\"} 4\n",
        "kvlab_replica_finished_total{replica=\"1\"} 2\n",
        "kvlab_replica_finished_total{replica=\"2\"} 2\n"})
    EXPECT_NE(m.body.find(line), std::string::npos) << line << "\n" << m.body;
  stack.stop(true);
  const RunOutput out = stack.served().finish();
  ASSERT_EQ(out.replicas.size(), 3u);
  ASSERT_EQ(out.engine.requests.size(), 4u);
  for (const RequestTimeline& t : out.engine.requests) {
    EXPECT_EQ(t.finish_reason, "max_tokens");
    EXPECT_GT(t.kv_transfer_bytes, 0);
    EXPECT_EQ(t.token_times_s.size(), 6u);
  }
}

}  // namespace
}  // namespace kvlab::test
