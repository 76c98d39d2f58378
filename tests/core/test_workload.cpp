#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include <cmath>
#include <numeric>

#include "kvlab/error.hpp"
#include "kvlab/workload/formats.hpp"
#include "kvlab/workload/real_workloads.hpp"
#include "kvlab/workload/workload.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using test::error_of;

TEST(Workload, SameSpecSameRequests) {
  SyntheticWorkload spec;
  spec.requests = 50;
  spec.seed = 3;
  spec.arrival.kind = ArrivalKind::poisson;
  spec.arrival.rate_per_s = 4;
  spec.prompt_tokens = {LengthKind::uniform, 0, 0, 0, 0, 10, 40};
  const auto a = generate_workload(spec), b = generate_workload(spec);
  ASSERT_EQ(a.size(), 50u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].arrival_s, b[i].arrival_s);
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].sampling.seed, b[i].sampling.seed);
  }
  spec.seed = 4;
  EXPECT_NE(generate_workload(spec)[0].prompt, a[0].prompt);
}

TEST(Workload, PoissonAndGammaArrivalsHaveTheRequestedRateAndVariability) {
  for (double cv : {1.0, 3.0}) {
    SyntheticWorkload spec;
    spec.requests = 20000;
    spec.arrival = {cv == 1.0 ? ArrivalKind::poisson : ArrivalKind::gamma, 10.0, cv, 1};
    const auto requests = generate_workload(spec);
    std::vector<double> gaps;
    double previous = 0;
    for (const auto& r : requests) {
      gaps.push_back(r.arrival_s - previous);
      previous = r.arrival_s;
    }
    const double mean =
        std::accumulate(gaps.begin(), gaps.end(), 0.0) / static_cast<double>(gaps.size());
    double variance = 0;
    for (double g : gaps) variance += (g - mean) * (g - mean);
    const double measured_cv = std::sqrt(variance / static_cast<double>(gaps.size())) / mean;
    EXPECT_NEAR(mean, 0.1, 0.1 * 0.05) << "cv " << cv;  // 5%: ~3.5 standard errors at cv 3
    EXPECT_NEAR(measured_cv, cv, cv * 0.1) << "cv " << cv;
  }
}

TEST(Workload, BurstsArriveTogether) {
  SyntheticWorkload spec;
  spec.requests = 12;
  spec.arrival = {ArrivalKind::bursts, 4.0, 1.0, 4};
  const auto r = generate_workload(spec);
  EXPECT_EQ(r[0].arrival_s, r[3].arrival_s);
  EXPECT_DOUBLE_EQ(r[4].arrival_s, 1.0);  // 4 requests per burst at 4 req/s
  EXPECT_DOUBLE_EQ(r[11].arrival_s, 2.0);
}

TEST(Workload, LengthDistributionsRespectClampsAndMeans) {
  SyntheticWorkload spec;
  spec.requests = 5000;
  spec.prompt_tokens = {LengthKind::lognormal, 0, 200, 100, 0, 1, 4000};
  spec.output_tokens = {LengthKind::zipf, 0, 0, 0, 1.5, 1, 50};
  double sum = 0;
  int ones = 0;
  for (const auto& r : generate_workload(spec)) {
    ASSERT_GE(static_cast<std::int64_t>(r.prompt.size()), 1);
    ASSERT_LE(static_cast<std::int64_t>(r.prompt.size()), 4000);
    ASSERT_GE(r.output_tokens, 1);
    ASSERT_LE(r.output_tokens, 50);
    sum += static_cast<double>(r.prompt.size());
    if (r.output_tokens == 1) ++ones;
  }
  EXPECT_NEAR(sum / 5000, 200, 200 * 0.05);
  EXPECT_GT(ones, 5000 * 0.3);  // zipf(1.5) on [1, 50]: P(1) ~ 0.39
  spec.prompt_tokens = {LengthKind::normal, 0, 50, 100, 0, 20, 80};  // heavy clamping
  for (const auto& r : generate_workload(spec)) {
    ASSERT_GE(r.prompt.size(), 20u);
    ASSERT_LE(r.prompt.size(), 80u);
  }
}

TEST(Workload, SharedPrefixGroupsAndPriorityMix) {
  SyntheticWorkload spec;
  spec.requests = 400;
  spec.prefix_groups = 3;
  spec.prefix_tokens = 32;
  spec.prompt_tokens = {LengthKind::fixed, 40};
  spec.priority_weights = {3, 1};
  const auto requests = generate_workload(spec);
  std::map<std::int64_t, std::vector<std::int32_t>> prefix_of_group;
  int high = 0;
  for (const auto& r : requests) {
    ASSERT_GE(r.prefix_group, 0);
    ASSERT_EQ(r.prompt.size(), 40u);
    const std::vector<std::int32_t> prefix(r.prompt.begin(), r.prompt.begin() + 32);
    auto [it, inserted] = prefix_of_group.try_emplace(r.prefix_group, prefix);
    EXPECT_EQ(it->second, prefix) << "every request of a group starts with the group's prefix";
    high += r.priority == 1;
  }
  EXPECT_EQ(prefix_of_group.size(), 3u);
  EXPECT_NEAR(high / 400.0, 0.25, 0.07);
}

TEST(Workload, BadSpecsAreNamed) {
  SyntheticWorkload spec;
  spec.arrival = {ArrivalKind::poisson, 0.0, 1.0, 1};
  EXPECT_NE(error_of<Error>([&] { generate_workload(spec); }).find("arrival rate"),
            std::string::npos);
  spec = {};
  spec.output_tokens = {LengthKind::uniform, 0, 0, 0, 0, 10, 5};
  EXPECT_NE(
      error_of<Error>([&] { generate_workload(spec); }).find("output_tokens: need 1 <= min <= max"),
      std::string::npos);
  spec = {};
  spec.prefix_groups = 2;
  EXPECT_NE(error_of<Error>([&] { generate_workload(spec); }).find("shared prefix"),
            std::string::npos);
}

// Sizes from input are bounded before anything is allocated: a request's tokens, the shared
// prefixes, and the prompts of the whole workload against the machine's memory.
TEST(Workload, SizesAreBoundedBeforeAllocating) {
  SyntheticWorkload spec;
  spec.prompt_tokens = {LengthKind::fixed, 1e30, 0, 0, 0, 1, std::int64_t{1} << 40};
  EXPECT_NE(error_of<Error>([&] {
              generate_workload(spec);
            }).find("prompt_tokens: max 1099511627776 is above kvlab's limit of 16777216"),
            std::string::npos);
  spec.prompt_tokens.max = 64;  // 1e30 clamps to the max (no float-to-int overflow)
  spec.requests = 3;
  for (const auto& r : generate_workload(spec)) EXPECT_EQ(r.prompt.size(), 64u);
  spec = {};
  spec.prefix_groups = 1;
  spec.prefix_tokens = std::int64_t{1} << 40;
  EXPECT_NE(error_of<Error>([&] { generate_workload(spec); }).find("above kvlab's limits"),
            std::string::npos);
  spec = {};
  spec.requests = 10'000'000;
  spec.prompt_tokens = {LengthKind::fixed, 16'000'000, 0, 0, 0, 1, 16'000'000};
  const std::string message = error_of<Error>([&] { generate_workload(spec); });
  EXPECT_NE(message.find("workload.requests 10000000 x about 16000000 prompt_tokens) need more "
                         "than half of what this machine can hold"),
            std::string::npos)
      << message;
}

TEST(Trace, CsvAndJsonlReplay) {
  test::TempDir dir;
  test::write_file(dir / "t.csv",
                   "arrival_s,prompt_len,output_len,priority\n0.5,10,4,1\n0.0,3,2,0\n\n");
  TraceOptions options;
  options.vocab_size = 100;
  const auto csv = load_trace(dir / "t.csv", options);
  ASSERT_EQ(csv.size(), 2u);
  EXPECT_EQ(csv[0].arrival_s, 0.0);  // sorted by arrival
  EXPECT_EQ(csv[0].prompt.size(), 3u);
  EXPECT_EQ(csv[1].priority, 1);
  EXPECT_EQ(csv[1].sampling.max_tokens, 4);
  test::write_file(dir / "t.jsonl",
                   R"({"arrival_s": 0.1, "prompt_ids": [1, 2, 3], "output_len": 5})"
                   "\n"
                   R"({"arrival_s": 0.2, "prompt_len": 7, "output_len": 1, "priority": 2})"
                   "\n");
  const auto jsonl = load_trace(dir / "t.jsonl", options);
  ASSERT_EQ(jsonl.size(), 2u);
  EXPECT_EQ(jsonl[0].prompt, (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(jsonl[1].prompt.size(), 7u);
  test::write_file(dir / "ids.csv", "arrival_s,prompt_ids,output_len\n0,5 6 7,3\n");
  EXPECT_EQ(load_trace(dir / "ids.csv", options)[0].prompt, (std::vector<std::int32_t>{5, 6, 7}));
}

TEST(Trace, EveryBadRowNamesFileAndLine) {
  test::TempDir dir;
  TraceOptions options;
  options.vocab_size = 100;
  auto error_for = [&](const std::string& name, const std::string& text) {
    test::write_file(dir / name, text);
    return error_of<Error>([&] { load_trace(dir / name, options); });
  };
  const std::string csv = "arrival_s,prompt_len,output_len\n";
  EXPECT_NE(error_for("a.csv", csv + "0,5,3\n0.1,x,3\n")
                .find("a.csv:3: prompt_len \"x\" is not a valid number"),
            std::string::npos);
  EXPECT_NE(
      error_for("b.csv", csv + "0,5\n").find("b.csv:2: 2 cells, but the header has 3 columns"),
      std::string::npos);
  EXPECT_NE(error_for("c.csv", "arival_s,prompt_len,output_len\n")
                .find("c.csv:1: unknown field \"arival_s\" (did you mean \"arrival_s\"?)"),
            std::string::npos);
  EXPECT_NE(error_for("dup.csv", "arrival_s,prompt_len,output_len,prompt_len\n0,5,3,6\n")
                .find("dup.csv:1: column \"prompt_len\" appears twice in the header"),
            std::string::npos);
  test::write_file(dir / "bom.csv", "\xEF\xBB\xBF" + csv + "0,5,3\n");  // Excel's UTF-8 CSV
  EXPECT_EQ(load_trace(dir / "bom.csv", options).size(), 1u);
  EXPECT_NE(error_for("d.csv", csv + "-1,5,3\n")
                .find("d.csv:2: arrival_s must be in [0, 1e+09] seconds, got -1"),
            std::string::npos);
  EXPECT_NE(error_for("e.csv", csv + "0,5,0\n")
                .find("e.csv:2: output_len must be in [1, 16777216], got 0"),
            std::string::npos);
  EXPECT_NE(error_for("f.jsonl", "{\"arrival_s\": 0, \"output_len\": 3}\n")
                .find("f.jsonl:1: missing prompt_len or prompt_ids"),
            std::string::npos);
  EXPECT_NE(
      error_for("g.jsonl", "\n{\"arrival_s\": 0, \"prompt_ids\": [1, 200], \"output_len\": 3}\n")
          .find("g.jsonl:2: prompt id 200 is outside the vocabulary [0, 100)"),
      std::string::npos);
  EXPECT_NE(error_for("h.jsonl", "{oops\n").find("h.jsonl:1: not valid JSON"), std::string::npos);
  EXPECT_NE(error_for("h2.jsonl", "{\"arrival_s\": 1e999}\n").find("h2.jsonl:1: not valid JSON"),
            std::string::npos);
  // Integers that do not fit their field are errors, not wrapped values.
  EXPECT_NE(error_for("p.csv", "arrival_s,prompt_len,output_len,priority\n0,5,3,4294967297\n")
                .find("p.csv:2: priority 4294967297 does not fit in 32 bits"),
            std::string::npos);
  EXPECT_NE(error_for("q.jsonl",
                      "{\"arrival_s\": 0, \"prompt_ids\": [4294967297], "
                      "\"output_len\": 3}\n")
                .find("q.jsonl:1: prompt id 4294967297 does not fit in 32 bits"),
            std::string::npos);
  EXPECT_NE(error_for("i.txt", "x").find("unknown format \".txt\""), std::string::npos);
  EXPECT_NE(error_for("j.csv", csv).find("holds no requests"), std::string::npos);
  EXPECT_NE(
      error_of<Error>([&] { load_trace(dir / "missing.csv", options); }).find("cannot read trace"),
      std::string::npos);
}

// A trace's tenant column (CSV and JSONL), and names kvlab refuses.
TEST(Trace, TenantColumnNamesEachRequestsTenant) {
  test::TempDir dir;
  TraceOptions options;
  options.vocab_size = 100;
  test::write_file(dir / "t.csv", "arrival_s,prompt_len,output_len,tenant\n0,3,2,a\n1,3,2,b-2\n");
  const auto csv = load_trace(dir / "t.csv", options);
  EXPECT_EQ(csv[0].tenant, "a");
  EXPECT_EQ(csv[1].tenant, "b-2");
  test::write_file(dir / "t.jsonl",
                   R"({"arrival_s": 0, "prompt_len": 3, "output_len": 2, "tenant": "x_1"})"
                   "\n");
  EXPECT_EQ(load_trace(dir / "t.jsonl", options)[0].tenant, "x_1");
  test::write_file(dir / "bad.csv", "arrival_s,prompt_len,output_len,tenant\n0,3,2,a b\n");
  EXPECT_NE(error_of<Error>([&] {
              load_trace(dir / "bad.csv", options);
            }).find("bad.csv:2: tenant name \"a b\" must be 1-64 characters"),
            std::string::npos);
  test::write_file(dir / "bad.jsonl",
                   R"({"arrival_s": 0, "prompt_len": 3, "output_len": 2, "tenant": 7})"
                   "\n");
  EXPECT_NE(error_of<Error>([&] {
              load_trace(dir / "bad.jsonl", options);
            }).find("bad.jsonl:1: tenant must be a string, got 7"),
            std::string::npos);
}

std::vector<WorkloadRequest> unnamed_requests(std::size_t count) {
  std::vector<WorkloadRequest> requests(count);
  for (std::size_t i = 0; i < count; ++i) requests[i].id = static_cast<std::int64_t>(i);
  return requests;
}

// Tenants drawn by share (within 3 standard deviations over 20,000 requests), the same for the
// same seed; each request's SLOs are its tenant's over the run's, key by key.
TEST(Tenants, DrawnByShareWithTheirOwnSlosOverTheRuns) {
  std::vector<WorkloadRequest> requests = unnamed_requests(20000);
  ServiceLevelObjectives run;
  run.ttft_s = 5.0;
  run.tpot_s = 0.1;
  std::vector<TenantSpec> tenants{{"heavy", 3.0, {}}, {"light", 1.0, {}}, {"none", 0.0, {}}};
  tenants[1].slo.ttft_s = 0.5;
  assign_tenants(requests, tenants, run, 42);
  std::map<std::string, int> count;
  for (const WorkloadRequest& r : requests) {
    ++count[r.tenant];
    EXPECT_EQ(*r.slo.ttft_s, r.tenant == "light" ? 0.5 : 5.0);
    EXPECT_EQ(*r.slo.tpot_s, 0.1);
    EXPECT_FALSE(r.slo.e2e_s);
  }
  EXPECT_NEAR(count["heavy"], 15000, 3 * std::sqrt(20000 * 0.75 * 0.25));
  EXPECT_EQ(count["none"], 0);
  std::vector<WorkloadRequest> again = unnamed_requests(20000);
  assign_tenants(again, tenants, run, 42);
  for (std::size_t i = 0; i < again.size(); ++i) ASSERT_EQ(again[i].tenant, requests[i].tenant);
  // Without tenants every request gets the run's SLOs and no tenant.
  std::vector<WorkloadRequest> plain = unnamed_requests(3);
  assign_tenants(plain, {}, run, 1);
  EXPECT_EQ(plain[2].tenant, "");
  EXPECT_EQ(*plain[2].slo.ttft_s, 5.0);
}

// A workload that names its tenants (a trace column): the list gives SLOs by name; a share, or
// a listed tenant that sends nothing, is an error; so are bad lists.
TEST(Tenants, NamedByTheTraceOrRefusedWithTheReason) {
  std::vector<WorkloadRequest> requests = unnamed_requests(2);
  requests[0].tenant = "a";
  requests[1].tenant = "b";
  std::vector<TenantSpec> slos{{"b", std::nullopt, {}}};
  slos[0].slo.e2e_s = 9.0;
  assign_tenants(requests, slos, {}, 1);
  EXPECT_EQ(requests[0].tenant, "a");
  EXPECT_FALSE(requests[0].slo.e2e_s);
  EXPECT_EQ(*requests[1].slo.e2e_s, 9.0);
  auto error = [&](std::vector<TenantSpec> tenants) {
    return error_of<Error>([&] { assign_tenants(requests, tenants, {}, 1); });
  };
  EXPECT_NE(error({{"a", 1.0, {}}}).find("tenant \"a\" has a share, but the trace names"),
            std::string::npos);
  EXPECT_NE(
      error({{"c", std::nullopt, {}}}).find("tenant \"c\" sends no request: the trace names a, b"),
      std::string::npos);
  std::vector<WorkloadRequest> unnamed = unnamed_requests(2);
  auto draw_error = [&](std::vector<TenantSpec> tenants) {
    return error_of<Error>([&] { assign_tenants(unnamed, tenants, {}, 1); });
  };
  EXPECT_NE(draw_error({{"a", 1.0, {}}, {"a", 1.0, {}}}).find("tenant \"a\" is listed twice"),
            std::string::npos);
  EXPECT_NE(draw_error({{"a", -1.0, {}}}).find("share must be a finite number >= 0"),
            std::string::npos);
  EXPECT_NE(draw_error({{"a", 0.0, {}}}).find("positive sum"), std::string::npos);
  EXPECT_NE(draw_error({{"a.b", 1.0, {}}}).find("must be 1-64 characters"), std::string::npos);
}

const std::filesystem::path kData =
    std::filesystem::path(KVLAB_FIXTURES_DIR) / ".." / ".." / "data";
const std::filesystem::path kAzureConv =
    kData / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_conv.csv";

// The Azure conversation trace (scripts/get_data.sh azure): its first ten minutes, compressed,
// clipped.
// The table of workload sources: a trace file is read by the row that recognizes it (Mooncake's
// fields, the Azure header, else kvlab's), and each row gives what its own reader gives.
TEST(WorkloadFormats, EachTraceIsReadByTheRowThatRecognizesIt) {
  test::TempDir dir;
  test::write_file(dir / "kvlab.csv", "arrival_s,prompt_len,output_len\n0,3,2\n1,4,2\n");
  test::write_file(dir / "azure.csv",
                   "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:47.0000000,12,3\n");
  test::write_file(
      dir / "mooncake.jsonl",
      R"({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]})"
      "\n");
  EXPECT_STREQ(trace_format(dir / "kvlab.csv").name, "kvlab");
  EXPECT_STREQ(trace_format(dir / "azure.csv").name, "azure");
  EXPECT_STREQ(trace_format(dir / "mooncake.jsonl").name, "mooncake");
  WorkloadInput input;
  input.vocab_size = 1000;
  input.seed = 3;
  input.file = dir / "kvlab.csv";
  TraceOptions kvlab_options;
  kvlab_options.vocab_size = 1000;
  kvlab_options.seed = 3;
  kvlab_options.sampling.ignore_eos = input.synthetic.ignore_eos;
  const auto kvlab_rows = load_trace(input.file, kvlab_options);
  const RealWorkload kvlab = trace_format(input.file).load(input);
  ASSERT_EQ(kvlab.requests.size(), kvlab_rows.size());
  for (std::size_t i = 0; i < kvlab_rows.size(); ++i)
    EXPECT_EQ(kvlab.requests[i].prompt, kvlab_rows[i].prompt);
  input.file = dir / "azure.csv";
  input.window.rate_scale = 2;
  AzureTraceOptions azure_options;
  azure_options.vocab_size = 1000;
  azure_options.seed = 3;
  azure_options.rate_scale = 2;
  const RealWorkload azure = trace_format(input.file).load(input),
                     direct = load_azure_trace(input.file, azure_options);
  ASSERT_EQ(azure.requests.size(), 2u);
  EXPECT_EQ(azure.requests[1].arrival_s, direct.requests[1].arrival_s);
  EXPECT_EQ(azure.requests[1].prompt, direct.requests[1].prompt);
  input.window.length_scale = 0.5;  // a Mooncake trace's alone
  EXPECT_THROW((void)trace_format(input.file).load(input), Error);
  input.file = dir / "mooncake.jsonl";
  EXPECT_EQ(trace_format(input.file).load(input).requests.front().prompt.size(), 300u);
  input.synthetic.requests = 5;
  EXPECT_EQ(workload_format("synthetic").load(input).requests.size(), 5u);
  const std::string unknown = test::error_of<Error>([] { (void)workload_format("sharegpt"); });
  EXPECT_NE(unknown.find("mooncake"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("prompts"), std::string::npos) << unknown;
}

TEST(AzureTrace, WindowRateScaleAndContextClipping) {
  AzureTraceOptions options;
  options.duration_s = 600;
  options.vocab_size = 32000;
  const RealWorkload all = load_azure_trace(kAzureConv, options);
  EXPECT_EQ(all.requests.size(), 2867u);  // rows within 600 s of the first
  EXPECT_EQ(all.clipped, 0);
  EXPECT_DOUBLE_EQ(all.requests.front().arrival_s, 0.0);
  EXPECT_LT(all.requests.back().arrival_s, 600.0);
  EXPECT_EQ(all.requests.front().prompt.size(), 374u);  // the trace's first row: 374, 44
  EXPECT_EQ(all.requests.front().output_tokens, 44);
  for (std::size_t i = 1; i < all.requests.size(); ++i)
    ASSERT_GE(all.requests[i].arrival_s, all.requests[i - 1].arrival_s);
  for (const auto& r : all.requests) {
    ASSERT_TRUE(r.sampling.ignore_eos);  // the trace's lengths, as Splitwise replays them
    ASSERT_EQ(r.sampling.max_tokens, r.output_tokens);
  }

  options.rate_scale = 2.0;
  options.context = 4096;
  const RealWorkload fast = load_azure_trace(kAzureConv, options);
  ASSERT_EQ(fast.requests.size(), all.requests.size());
  EXPECT_DOUBLE_EQ(fast.requests.back().arrival_s, all.requests.back().arrival_s / 2);
  EXPECT_EQ(fast.clipped, 205);
  std::int64_t clipped = 0;
  for (std::size_t i = 0; i < fast.requests.size(); ++i) {
    const auto& r = fast.requests[i];
    const auto total = static_cast<std::int64_t>(r.prompt.size()) + r.output_tokens;
    ASSERT_LE(total, 4096) << i;
    ASSERT_GE(r.output_tokens, 1);
    clipped += total < static_cast<std::int64_t>(all.requests[i].prompt.size()) +
                           all.requests[i].output_tokens;
  }
  EXPECT_EQ(clipped, fast.clipped);
  EXPECT_NE(fast.description.find("205 clipped"), std::string::npos) << fast.description;

  options.start_s = 300;
  options.max_requests = 10;
  const RealWorkload later = load_azure_trace(kAzureConv, options);
  EXPECT_EQ(later.requests.size(), 10u);
  // Times count from the window's start (300 s after the first request), compressed x2.
  EXPECT_GE(later.requests.front().arrival_s, 0.0);
  EXPECT_LT(later.requests.front().arrival_s, 5.0);
}

TEST(AzureTrace, BadRowsAndOptionsAreNamed) {
  test::TempDir dir;
  AzureTraceOptions options;
  auto error_for = [&](const std::string& text) {
    test::write_file(dir / "t.csv", text);
    return error_of<Error>([&] { load_azure_trace(dir / "t.csv", options); });
  };
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  EXPECT_NE(error_for("time,in,out\n").find("t.csv:1: the header must be"), std::string::npos);
  test::write_file(dir / "bom.csv",  // saved by Excel as "CSV UTF-8": a BOM before the header
                   "\xEF\xBB\xBF" + header + "2023-11-16 18:15:46.68,374,44\n");
  EXPECT_EQ(load_azure_trace(dir / "bom.csv", options).requests.size(), 1u);
  EXPECT_NE(error_for(header + "2023-11-16 18:15:46.68,374\n").find("t.csv:2: 2 cells"),
            std::string::npos);
  EXPECT_NE(error_for(header + "2023-13-16 18:15:46.68,374,44\n").find("not a valid date"),
            std::string::npos);
  EXPECT_NE(error_for(header + "yesterday,374,44\n").find("t.csv:2: TIMESTAMP \"yesterday\""),
            std::string::npos);
  EXPECT_NE(error_for(header + "2023-11-16 18:15:46.68,0,44\n").find("must be in [1,"),
            std::string::npos);
  EXPECT_NE(error_for(header + "2023-11-16 18:15:46.68,3x,44\n").find("ContextTokens \"3x\""),
            std::string::npos);
  EXPECT_NE(error_for(header).find("has no requests"), std::string::npos);
  options.start_s = 1e6;
  EXPECT_NE(error_for(header + "2023-11-16 18:15:46.68,374,44\n").find("no request in the window"),
            std::string::npos);
  options = {};
  options.rate_scale = 0;
  EXPECT_NE(error_for(header).find("rate_scale must be > 0"), std::string::npos);
  EXPECT_NE(error_of<Error>([&] { load_azure_trace(dir / "missing.csv", {}); }).find("cannot read"),
            std::string::npos);
}

TEST(PromptSet, TextsOfEachVendoredSet) {
  const auto mt_bench = load_prompt_texts(kData / "prompts" / "mt_bench_questions.jsonl");
  EXPECT_EQ(mt_bench.size(), 80u);
  EXPECT_EQ(mt_bench[0].rfind("Compose an engaging travel blog post", 0), 0u);
  EXPECT_EQ(load_prompt_texts(kData / "prompts" / "vicuna_bench_questions.jsonl").size(), 80u);
  const auto gsm8k = load_prompt_texts(kData / "prompts" / "gsm8k_test.jsonl");
  EXPECT_EQ(gsm8k.size(), 1319u);
  EXPECT_EQ(gsm8k[0].rfind("Janet", 0), 0u);
}

TEST(PromptSet, RequestsEndAtEosWithACapCutToTheContext) {
  const std::vector<std::string> texts = {"aa", "bbbb", "c"};
  auto encode = [](const std::string& text) {  // one id per character
    return std::vector<std::int32_t>(text.begin(), text.end());
  };
  PromptSetOptions options;
  options.requests = 7;
  options.max_tokens = 8;
  options.context = 10;
  options.arrival.kind = ArrivalKind::poisson;
  options.arrival.rate_per_s = 5;
  const RealWorkload w = prompt_set_workload(texts, encode, options);
  ASSERT_EQ(w.requests.size(), 7u);
  EXPECT_EQ(w.requests[3].prompt, encode("aa"));  // cycles through the prompts
  EXPECT_EQ(w.requests[1].output_tokens, 6);      // 4 + 8 > 10: the cap is cut
  EXPECT_EQ(w.requests[0].output_tokens, 8);
  EXPECT_EQ(w.clipped, 2);  // requests 1 and 4
  for (std::size_t i = 0; i < w.requests.size(); ++i) {
    EXPECT_FALSE(w.requests[i].sampling.ignore_eos);
    if (i > 0) {
      EXPECT_GT(w.requests[i].arrival_s, w.requests[i - 1].arrival_s);
    }
  }
  options.context = 4;
  EXPECT_NE(error_of<Error>([&] {
              prompt_set_workload(texts, encode, options);
            }).find("prompt 1 (\"bbbb...\") is 4 tokens: no room to answer"),
            std::string::npos);
}

TEST(PromptSet, BadFilesAreNamed) {
  test::TempDir dir;
  auto error_for = [&](const std::string& text) {
    test::write_file(dir / "p.jsonl", text);
    return error_of<Error>([&] { load_prompt_texts(dir / "p.jsonl"); });
  };
  EXPECT_NE(error_for("{\"turns\": [\"hi\"]}\n{oops\n").find("p.jsonl:2: not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_for("{\"answer\": \"4\"}\n").find("p.jsonl:1: no prompt text"),
            std::string::npos);
  EXPECT_NE(error_for("[1]\n").find("p.jsonl:1: each line must be a JSON object"),
            std::string::npos);
  EXPECT_NE(error_for("\n").find("holds no prompts"), std::string::npos);
}

}  // namespace
}  // namespace kvlab
