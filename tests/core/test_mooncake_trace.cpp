// The Mooncake FAST'25 traces as workloads: equal hash ids give equal blocks of tokens and new
// ids new ones, the window / rate / length options, the ideal prefix hit rate (the installed
// traces' figures, which docs/workloads-and-metrics.md quotes), and bad rows named by line.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kvlab/error.hpp"
#include "kvlab/workload/real_workloads.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using test::error_of;

// Three requests: the second shares the first's two whole blocks (ids 0, 1), then differs; the
// third shares nothing. Timestamps in ms.
const char* const kRows =
    "{\"timestamp\": 0, \"input_length\": 1200, \"output_length\": 7, \"hash_ids\": [0, 1, 2]}\n"
    "{\"timestamp\": 2000, \"input_length\": 1300, \"output_length\": 5, \"hash_ids\": [0, 1, "
    "3]}\n"
    "\n"
    "{\"timestamp\": 4000, \"input_length\": 100, \"output_length\": 3, \"hash_ids\": [4]}\n";

std::vector<std::int32_t> slice(const std::vector<std::int32_t>& v, std::size_t from,
                                std::size_t to) {
  return {v.begin() + static_cast<std::ptrdiff_t>(from),
          v.begin() + static_cast<std::ptrdiff_t>(to)};
}

TEST(MooncakeTrace, EqualHashIdsGiveEqualBlocksAndNewIdsNewTokens) {
  test::TempDir dir;
  test::write_file(dir.path() / "m.jsonl", kRows);
  EXPECT_TRUE(is_mooncake_trace(dir.path() / "m.jsonl"));
  MooncakeTraceOptions options;
  options.seed = 11;
  const RealWorkload w = load_mooncake_trace(dir.path() / "m.jsonl", options);
  ASSERT_EQ(w.requests.size(), 3u);
  const auto& a = w.requests[0].prompt;
  const auto& b = w.requests[1].prompt;
  const auto& c = w.requests[2].prompt;
  ASSERT_EQ(a.size(), 1200u);
  ASSERT_EQ(b.size(), 1300u);
  ASSERT_EQ(c.size(), 100u);
  EXPECT_EQ(slice(a, 0, 1024), slice(b, 0, 1024));        // ids 0 and 1: the same 1,024 tokens
  EXPECT_NE(slice(a, 1024, 1100), slice(b, 1024, 1100));  // ids 2 and 3 differ from the start
  EXPECT_NE(slice(c, 0, 100), slice(a, 0, 100));          // id 4 is not id 0
  EXPECT_NE(slice(a, 0, 512), slice(a, 512, 1024));       // nor is id 1
  EXPECT_EQ(w.requests[1].arrival_s, 2.0);
  EXPECT_EQ(w.requests[1].output_tokens, 5);
  EXPECT_TRUE(w.requests[1].sampling.ignore_eos);
  // Another seed, other tokens; the same seed, the same.
  options.seed = 12;
  EXPECT_NE(load_mooncake_trace(dir.path() / "m.jsonl", options).requests[0].prompt, a);
  options.seed = 11;
  EXPECT_EQ(load_mooncake_trace(dir.path() / "m.jsonl", options).requests[0].prompt, a);
  // Whole blocks only: the second request's two shared blocks, of 2,600 prompt tokens.
  EXPECT_DOUBLE_EQ(w.ideal_prefix_hit_rate, 1024.0 / 2600.0);
  EXPECT_NE(w.description.find("ideal prefix hit rate 39.4%"), std::string::npos) << w.description;
}

TEST(MooncakeTrace, WindowRateAndLengthScale) {
  test::TempDir dir;
  test::write_file(dir.path() / "m.jsonl", kRows);
  MooncakeTraceOptions options;
  options.start_s = 1;
  options.duration_s = 10;
  options.rate_scale = 2;
  options.length_scale = 1.0 / 64;  // blocks of 8 tokens
  const RealWorkload w = load_mooncake_trace(dir.path() / "m.jsonl", options);
  ASSERT_EQ(w.requests.size(), 2u);         // the first is before the window
  EXPECT_EQ(w.requests[0].arrival_s, 0.5);  // (2 - 1) s, twice as fast
  EXPECT_EQ(w.requests[1].arrival_s, 1.5);
  EXPECT_EQ(w.requests[0].prompt.size(), 20u);  // round(1300 / 64)
  EXPECT_EQ(w.requests[0].output_tokens, 1);    // round(5 / 64), at least 1
  EXPECT_EQ(w.requests[1].prompt.size(), 2u);   // round(100 / 64)
  EXPECT_EQ(w.ideal_prefix_hit_rate, 0.0);      // nothing earlier in the window to share
  options = {};
  options.length_scale = 1.0 / 64;
  const RealWorkload all = load_mooncake_trace(dir.path() / "m.jsonl", options);
  EXPECT_EQ(slice(all.requests[0].prompt, 0, 16), slice(all.requests[1].prompt, 0, 16));
  EXPECT_DOUBLE_EQ(all.ideal_prefix_hit_rate, 16.0 / (19 + 20 + 2));
  options.max_requests = 1;
  options.context = 12;  // 19 + 1 tokens clipped to the context
  const RealWorkload clipped = load_mooncake_trace(dir.path() / "m.jsonl", options);
  ASSERT_EQ(clipped.requests.size(), 1u);
  EXPECT_EQ(clipped.requests[0].prompt.size(), 11u);
  EXPECT_EQ(clipped.clipped, 1);
}

TEST(MooncakeTrace, BadRowsAndOptionsAreNamed) {
  test::TempDir dir;
  auto error_for = [&](const std::string& text, MooncakeTraceOptions options = {}) {
    test::write_file(dir.path() / "bad.jsonl", text);
    return error_of<Error>([&] { load_mooncake_trace(dir.path() / "bad.jsonl", options); });
  };
  const std::string good =
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [0, 1]}\n";
  EXPECT_NE(error_for(good + "{\"timestamp\": 1, \"input_length\": 600, \"output_length\": 2}\n")
                .find("bad.jsonl:2: \"hash_ids\" must be a list"),
            std::string::npos);
  EXPECT_NE(error_for(good + "{\"timestamp\": 1, \"input_length\": 600, \"output_length\": 2, "
                             "\"hash_ids\": [0, 1, 2]}\n")
                .find(":2: 3 hash_ids for 600 input tokens: at most 2 blocks of 512"),
            std::string::npos);
  EXPECT_NE(error_for("{\"timestamp\": -5, \"input_length\": 6, \"output_length\": 2, "
                      "\"hash_ids\": []}\n")
                .find(":1: \"timestamp\" must be a non-negative integer"),
            std::string::npos);
  EXPECT_NE(error_for("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 2, "
                      "\"hash_ids\": []}\n")
                .find("input_length and output_length must be in [1, "),
            std::string::npos);
  EXPECT_NE(error_for("{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 2, "
                      "\"hash_ids\": [-1]}\n")
                .find("hash_ids must be non-negative integers"),
            std::string::npos);
  EXPECT_NE(error_for("{not json\n").find(":1: not valid JSON"), std::string::npos);
  EXPECT_NE(error_for("\n").find("has no requests"), std::string::npos);
  MooncakeTraceOptions scale;
  scale.length_scale = 2;
  EXPECT_NE(error_for(good, scale).find("length_scale must be in (0, 1]"), std::string::npos);
  MooncakeTraceOptions late;
  late.start_s = 100;
  EXPECT_NE(error_for(good, late).find("no request in the window"), std::string::npos);
  // kvlab's own JSONL trace is not this format.
  test::write_file(dir.path() / "own.jsonl",
                   "{\"arrival_s\": 0, \"prompt_len\": 4, "
                   "\"output_len\": 2}\n");
  EXPECT_FALSE(is_mooncake_trace(dir.path() / "own.jsonl"));
  EXPECT_FALSE(is_mooncake_trace(dir.path() / "missing.jsonl"));
}

// The ideal prefix hit rates docs/workloads-and-metrics.md and docs/data.md quote, from the
// installed files (scripts/get_data.sh mooncake) (an independent count in Python gave 37.34%
// and 65.04%).
TEST(MooncakeTrace, IdealHitRatesOfTheVendoredTraces) {
  const auto dir =
      std::filesystem::path(KVLAB_FIXTURES_DIR) / ".." / ".." / "data" / "mooncake-fast25";
  for (const auto& [file, requests, ideal] :
       {std::tuple{"conversation_trace.jsonl", std::size_t{12031}, 0.3734},
        std::tuple{"synthetic_trace.jsonl", std::size_t{3993}, 0.6504}}) {
    const std::vector<MooncakeRow> rows = read_mooncake_trace(dir / file);
    ASSERT_EQ(rows.size(), requests) << file;
    std::vector<std::vector<std::int64_t>> ids;
    std::vector<std::int64_t> lengths;
    for (const MooncakeRow& row : rows) {
      ids.push_back(row.hash_ids);
      lengths.push_back(row.input);
    }
    const PrefixReuse reuse = ideal_prefix_reuse(ids, lengths, kMooncakeBlockTokens);
    EXPECT_NEAR(reuse.rate(), ideal, 0.00005) << file;
    EXPECT_EQ(reuse.hit_tokens % kMooncakeBlockTokens, 0) << file;
  }
}

}  // namespace
}  // namespace kvlab
