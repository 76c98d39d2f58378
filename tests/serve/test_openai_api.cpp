// The OpenAI API's request JSON as kvlab serve reads it, and stop strings over streamed text.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvlab/serve/openai_api.hpp"

namespace kvlab::serve {
namespace {

using nlohmann::json;

ApiError error_of(const json& body, bool chat = false) {
  try {
    (void)parse_completion_request(body.dump(), chat);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for " << body.dump();
  return ApiError(0, "");
}

TEST(OpenAiApi, CompletionFieldsAreRead) {
  const CompletionRequest r =
      parse_completion_request(json{{"model", "m"},
                                    {"prompt", {{1, 2}, {3}}},
                                    {"max_tokens", 7},
                                    {"temperature", 0.5},
                                    {"top_p", 0.9},
                                    {"n", 2},
                                    {"seed", 11},
                                    {"stop", {"a", "b"}},
                                    {"logprobs", 3},
                                    {"stream", true},
                                    {"stream_options", {{"include_usage", true}}},
                                    {"priority", 5},
                                    {"presence_penalty", 0},
                                    {"user", "u"}}
                                   .dump(),
                               false);
  EXPECT_EQ(r.prompt_ids, (std::vector<std::vector<std::int32_t>>{{1, 2}, {3}}));
  // One prompt of many token ids is one prompt (the limit on prompts does not count its ids).
  const CompletionRequest one = parse_completion_request(
      json{{"model", "m"}, {"prompt", std::vector<int>(1000, 7)}}.dump(), false);
  ASSERT_EQ(one.prompt_ids.size(), 1u);
  EXPECT_EQ(one.prompt_ids[0].size(), 1000u);
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_EQ(r.temperature, 0.5);
  EXPECT_EQ(r.top_p, 0.9);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.seed, 11u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.priority, 5);
  EXPECT_EQ(r.user, "u");
}

TEST(OpenAiApi, ChatFieldsAreRead) {
  const CompletionRequest r = parse_completion_request(
      json{{"model", "m"},
           {"messages",
            {{{"role", "developer"}, {"content", "be brief"}},
             {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "hi"}}}}}}},
           {"max_completion_tokens", 9},
           {"logprobs", true},
           {"top_logprobs", 2},
           {"stop", "x"}}
          .dump(),
      true);
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "hi");
  EXPECT_EQ(r.max_tokens, 9);
  EXPECT_EQ(r.logprobs, 2);
  EXPECT_EQ(r.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(r.temperature, 1.0);  // the API's default
}

TEST(OpenAiApi, EveryBadFieldIsNamed) {
  const json base = {{"model", "m"}, {"prompt", "p"}};
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"nope", 1}}, "nope"},
      {{{"temperature", 2.5}}, "temperature"},
      {{{"top_p", 0}}, "top_p"},
      {{{"n", 0}}, "n"},
      {{{"n", 1000}}, "n"},
      {{{"max_tokens", 0}}, "max_tokens"},
      {{{"max_tokens", 1.5}}, "max_tokens"},
      {{{"logprobs", 21}}, "logprobs"},
      {{{"stop", {1}}}, "stop"},
      {{{"stream", "yes"}}, "stream"},
      {{{"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {{{"echo", true}}, "echo"},
      {{{"presence_penalty", 1}}, "presence_penalty"},
      {{{"best_of", 3}}, "best_of"},
      {{{"seed", "s"}}, "seed"},
      {{{"prompt", json::array()}}, "prompt"},
      {{{"prompt", {"a", {1}}}}, "prompt"},
      {{{"messages", json::array()}}, "messages"},  // a chat field on completions
      {{{"user", 7}}, "user"},
      {{{"user", "two\nlines"}}, "user"},
      {{{"user", std::string(257, 'u')}}, "user"},
      {{{"cache_salt", ""}}, "cache_salt"},
      {{{"cache_salt", 1}}, "cache_salt"},
  };
  for (const auto& [change, param] : cases) {
    json body = base;
    body.update(change);
    const ApiError e = error_of(body);
    EXPECT_EQ(e.status, 400) << body.dump();
    EXPECT_EQ(e.param, param) << body.dump() << ": " << e.message;
  }
  EXPECT_EQ(
      error_of({{"model", "m"}, {"messages", {{{"role", "tool"}, {"content", "x"}}}}}, true).param,
      "messages");
  EXPECT_EQ(error_of({{"model", "m"}, {"messages", {{{"role", "user"}}}}}, true).param, "messages");
  EXPECT_EQ(error_of({{"model", "m"},
                      {"messages", {{{"role", "user"}, {"content", "x"}}}},
                      {"top_logprobs", 2}},
                     true)
                .param,
            "top_logprobs");
  EXPECT_EQ(error_of({{"prompt", "p"}}).param, "model");
  // An assistant's tool_calls (or any key but role and content) is refused, never dropped.
  const ApiError tools = error_of(
      {{"model", "m"},
       {"messages",
        {{{"role", "assistant"}, {"content", "x"}, {"tool_calls", json::array({{{"id", "c"}}})}}}}},
      true);
  EXPECT_EQ(tools.param, "messages");
  EXPECT_NE(tools.message.find("messages[0].tool_calls is not supported"), std::string::npos)
      << tools.message;
}

TEST(OpenAiApi, UserAndCacheSaltAreRead) {
  const CompletionRequest r = parse_completion_request(
      R"({"model": "m", "prompt": "p", "user": "a, \"b\"", "cache_salt": "s3cret"})", false);
  EXPECT_EQ(r.user, "a, \"b\"");
  EXPECT_EQ(r.cache_salt, "s3cret");
  try {
    (void)parse_completion_request(
        "{\"model\": \"m\", \"prompt\": " + std::string(40, '[') + std::string(40, ']') + "}",
        false);
    ADD_FAILURE() << "a body nested 40 deep was taken";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_NE(e.message.find("nested deeper than 32 levels"), std::string::npos) << e.message;
  }
}

TEST(OpenAiApi, ErrorBodyHasTheApisShape) {
  const json body = json::parse(ApiError(429, "full", "", "rate_limit_error", "queue_full").body());
  EXPECT_EQ(body["error"]["message"], "full");
  EXPECT_EQ(body["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(body["error"]["code"], "queue_full");
  // Bytes that are not UTF-8 (a message quoting the request) still make valid JSON.
  EXPECT_TRUE(json::accept(error_body("bad \xff byte", "t", "", "")));
}

TEST(OpenAiApi, StopStringsHoldBackWhatMayStartOne) {
  StopStrings stops({"END", "xy"});
  EXPECT_EQ(stops.push("hello E"), "hello ");  // "E" may start END
  EXPECT_EQ(stops.push("N"), "");
  EXPECT_EQ(stops.push("o"), "ENo");  // it did not
  EXPECT_EQ(stops.push("ab x"), "ab ");
  EXPECT_FALSE(stops.stopped());
  EXPECT_EQ(stops.push("y and more"), "");
  EXPECT_TRUE(stops.stopped());
  EXPECT_EQ(stops.push("later"), "");
  EXPECT_EQ(stops.flush(), "");

  StopStrings split({"stop"});
  EXPECT_EQ(split.push("one st"), "one ");
  EXPECT_EQ(split.push("op two"), "");
  EXPECT_TRUE(split.stopped());

  StopStrings none({});
  EXPECT_EQ(none.push("abc"), "abc");
  StopStrings tail({"zz"});
  EXPECT_EQ(tail.push("abz"), "ab");
  EXPECT_EQ(tail.flush(), "z");  // the end came first
}

}  // namespace
}  // namespace kvlab::serve
