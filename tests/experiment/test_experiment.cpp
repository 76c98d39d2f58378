// The experiment library called directly, as the CLI calls it: load (strict TOML, --set, sweep
// expansion), validate every point before anything runs, run one point, write its results.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/summary_table.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const std::filesystem::path kQuickstart =
    std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "quickstart.toml";

// quickstart, small: the tiny preset, six short requests, the build's plugins.
std::vector<std::string> small(std::vector<std::string> more = {}) {
  std::vector<std::string> overrides{
      "model.name=\"tiny\"", "workload.requests=6",
      "workload.prompt_tokens={dist=\"uniform\", min=4, max=12}",
      "workload.output_tokens={dist=\"uniform\", min=2, max=6}",
      std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"};
  more.insert(more.begin(), overrides.begin(), overrides.end());
  return more;
}

TEST(ExperimentLibrary, LoadExpandsTheSweepWithLabelsAndOverrides) {
  const auto runs = load_experiment(kQuickstart, small());
  ASSERT_EQ(runs.size(), 2u);  // [[sweep]] scheduler.name = static, fcfs
  EXPECT_EQ(runs[0].config.scheduler, "static");
  EXPECT_EQ(runs[1].config.scheduler, "fcfs");
  EXPECT_EQ(runs[1].config.label, "scheduler.name=fcfs");
  EXPECT_EQ(runs[1].config.model, "tiny");
  EXPECT_EQ(runs[1].config.workload.requests, 6);
  EXPECT_NO_THROW(validate_experiment(runs, false));
}

// A file sweeping a zipped scheduler pair (name + params) and a rate.
const char* kZippedSweep = R"(
[model]
name = "tiny"
[workload]
requests = 2
[scheduler]
name = "static"
[[sweep]]
key = "scheduler.name"
values = ["static", "fcfs"]
zip = "scheduler"
[[sweep]]
key = "scheduler.params"
values = [{ max_batch = 4 }, { max_batch = 8 }]
zip = "scheduler"
[[sweep]]
key = "workload.rate"
values = [1.0, 2.0, 4.0]
)";

std::int64_t max_batch(const ExperimentRun& run) {
  return std::get<std::int64_t>(run.config.scheduler_params.at("max_batch"));
}

TEST(ExperimentLibrary, SetOnASweptKeyReplacesItsAxisAndTheAxesZippedWithIt) {
  const test::TempDir dir;
  test::write_file(dir / "e.toml", kZippedSweep);
  std::vector<std::string> notes;
  const auto runs = load_experiment(dir / "e.toml", {{"scheduler.name=fcfs"}, {}}, &notes);
  ASSERT_EQ(runs.size(), 3u);  // the rate axis only
  for (const auto& run : runs) {
    EXPECT_EQ(run.config.scheduler, "fcfs");
    EXPECT_FALSE(run.config.scheduler_params.contains("max_batch"));  // its zipped pair went too
  }
  EXPECT_EQ(runs[2].config.label, "workload.rate=4.0");
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0],
            "--set scheduler.name=fcfs replaces the file's [[sweep]] over scheduler.name (2 "
            "values) and scheduler.params (2 values)");
  // A table holding a swept key replaces its axis too.
  const auto whole =
      load_experiment(dir / "e.toml", {{"workload={rate=3.0, requests=2}"}, {}}, &notes);
  EXPECT_EQ(whole.size(), 2u);
  EXPECT_NE(notes.at(0).find("over workload.rate (3 values)"), std::string::npos) << notes[0];
}

TEST(ExperimentLibrary, SetInsideASweptTableReachesEveryPoint) {
  const test::TempDir dir;
  test::write_file(dir / "e.toml", kZippedSweep);
  std::vector<std::string> notes;
  const auto runs = load_experiment(
      dir / "e.toml", {{"scheduler.params.max_batch=3", "workload.requests=5"}, {}}, &notes);
  ASSERT_EQ(runs.size(), 6u);
  EXPECT_TRUE(notes.empty());
  for (const auto& run : runs) {
    EXPECT_EQ(max_batch(run), 3) << run.config.label;  // on top of the swept { max_batch = 4 }
    EXPECT_EQ(run.config.workload.requests, 5);
  }
  EXPECT_EQ(runs[3].config.scheduler, "fcfs");
  // A misspelt key inside the swept table is not lost under the sweep: it fails validation.
  auto misspelt =
      load_experiment(dir / "e.toml",
                      {{std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
                        "scheduler.params.max_batchh=3"},
                       {}},
                      nullptr);
  const std::string message = test::error_of<Error>([&] { validate_experiment(misspelt, false); });
  EXPECT_NE(message.find("no parameter \"max_batchh\""), std::string::npos) << message;
}

// What KV groups and latent attention cannot run is refused before anything runs, each with the
// setting named; what they can (prefix caching under groups, a quantized latent) validates.
TEST(ExperimentLibrary, KvGroupsAndLatentAttentionRefuseOnlyWhatTheyCannotRun) {
  const auto refused = [](std::vector<std::string> more) {
    const auto runs = load_experiment(kQuickstart, small(std::move(more)));
    return test::error_of<Error>([&] { validate_experiment(runs, false); });
  };
  const auto accepted = [](std::vector<std::string> more) {
    const auto runs = load_experiment(kQuickstart, small(std::move(more)));
    EXPECT_NO_THROW(validate_experiment(runs, false));
  };
  const std::string gemma = "model.name=\"gemma3-tiny\"", groups = "kv_cache.groups=\"per_kind\"";
  accepted({gemma, groups, "kv_cache.allocator=\"paged\"", "kv_cache.params={block_size=16}"});
  EXPECT_NE(
      refused({gemma, groups, "scheduler.name=\"fcfs\"", "scheduler.params.preemption=\"swap\""})
          .find("swap preemption"),
      std::string::npos);
  const std::string mla = "model.name=\"mla-tiny\"";
  accepted({mla, "kv_cache.dtype=\"bf16\""});
  EXPECT_NE(refused({mla, "kv_cache.dtype=\"q8_0\""}).find("half the latent"), std::string::npos);
  EXPECT_NE(refused({mla, "kv_cache.dtype=\"kivi4\"", "kv_cache.params={block_size=32}"})
                .find("latent attention"),
            std::string::npos);
  EXPECT_NE(refused({mla, "attention.variant=\"gqa\"", "attention.params={group_size=2}"})
                .find("no K/V heads to group"),
            std::string::npos);
}

TEST(ExperimentLibrary, SweepOnTheCommandLineAddsOrReplacesAnAxis) {
  const test::TempDir dir;
  test::write_file(dir / "e.toml", kZippedSweep);
  std::vector<std::string> notes;
  const auto crossed = load_experiment(dir / "e.toml", {{}, {"workload.requests=1,3"}}, &notes);
  ASSERT_EQ(crossed.size(), 12u);  // 2 schedulers x 3 rates x 2 request counts
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(crossed[1].config.label,
            "scheduler.name=static, scheduler.params={ max_batch = 4 }, workload.rate=1.0, "
            "workload.requests=3");
  EXPECT_EQ(crossed[1].config.workload.requests, 3);
  // Words are strings, a TOML list's items keep their types.
  const auto replaced = load_experiment(
      dir / "e.toml", {{}, {"scheduler.name=fcfs,static,chunked", "workload.rate=0.5,8"}}, &notes);
  ASSERT_EQ(replaced.size(), 6u);
  EXPECT_EQ(replaced[4].config.scheduler, "chunked");
  EXPECT_DOUBLE_EQ(replaced[5].config.workload.arrival.rate_per_s, 8.0);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("--sweep scheduler.name=fcfs,static,chunked replaces"),
            std::string::npos);
  const auto tables = load_experiment(
      dir / "e.toml", {{}, {"scheduler.params={max_batch=2},{max_batch=6}"}}, nullptr);
  ASSERT_EQ(tables.size(), 6u);  // the scheduler pair replaced: 2 tables x 3 rates
  EXPECT_EQ(max_batch(tables[3]), 6);
  // What cannot be meant is an error, not a guess.
  for (const auto& [changes, why] : std::vector<std::pair<CommandLineChanges, std::string>>{
           {{{"workload.rate=2"}, {"workload.rate=1,2"}}, "set the same key: keep one"},
           {{{}, {"workload.rate=1,,2"}}, "an empty value"},
           {{{}, {"workload.rate=1", "workload.rate=2"}}, "swept twice"},
           {{{"sweep.key=x"}, {}}, "the sweep is replaced whole"},
           {{{}, {"sweep=[]"}}, "or given an axis (--sweep"},
           {{{}, {"norate"}}, "expected key=value"}}) {
    const CommandLineChanges& change = changes;  // (clang captures no structured binding)
    EXPECT_NE(test::error_of<Error>([&] {
                (void)load_experiment(dir / "e.toml", change, nullptr);
              }).find(why),
              std::string::npos)
        << why;
  }
}

// --set hardware.SECTION.KEY changes one key of the run's profile: a simulated run whose step
// overhead is 1 s lasts at least a second a step; a misspelt key is refused
// with the profile's own check; [hardware] needs a profile to change.
TEST(ExperimentLibrary, HardwareTableChangesOneKeyOfTheProfile) {
  const std::vector<std::string> simulated{"backend.name=\"simulated\"", "backend.profile=\"h200\"",
                                           "scheduler.name=fcfs"};
  auto load = [&](std::vector<std::string> more) {
    more.insert(more.begin(), simulated.begin(), simulated.end());
    auto runs = load_experiment(kQuickstart, small(std::move(more)));
    validate_experiment(runs, false);
    return runs;
  };
  const auto plain = load({}), slow = load({"hardware.overhead.step_s=1.0"});
  EXPECT_EQ(slow[0].config.hardware_changes, "[overhead]\nstep_s = 1.0");
  const RunOutput a = run_experiment(plain[0].config, false, nullptr),
                  b = run_experiment(slow[0].config, false, nullptr);
  // Every step of the changed run lasts at least its 1 s overhead; the plain H200's take ms.
  ASSERT_GT(b.engine.steps.size(), 0u);
  EXPECT_GE(b.summary.duration_s, static_cast<double>(b.engine.steps.size()) * 1.0);
  EXPECT_LT(a.summary.duration_s, static_cast<double>(a.engine.steps.size()) * 0.1);
  // summary.json's kv_dtype is the pool's: the simulated H200 keeps bf16 K/V (the config's
  // kv_cache.dtype, f32, is the cpu backend's).
  EXPECT_EQ(a.kv_dtype, "bf16");
  const test::TempDir outputs;
  write_run_outputs(outputs.path(), plain[0].config, a);
  EXPECT_EQ(nlohmann::json::parse(test::read_file(outputs / "summary.json")).at("kv_dtype"),
            "bf16");
  const std::string misspelt =
      test::error_of<Error>([&] { (void)load({"hardware.link.swap_gb_per_ss=3.0"}); });
  EXPECT_NE(misspelt.find("swap_gb_per_s"), std::string::npos) << misspelt;
  EXPECT_NE(misspelt.find("[hardware] changes"), std::string::npos) << misspelt;
  const test::TempDir dir;
  test::write_file(dir / "e.toml",
                   "[model]\nname = \"tiny\"\n[backend]\nname = \"cuda\"\n"
                   "[hardware.link]\nswap_gb_per_s = 3.0\n");
  const std::string none =
      test::error_of<Error>([&] { (void)load_experiment(dir / "e.toml", {}); });
  EXPECT_NE(none.find("this run has none"), std::string::npos) << none;
}

// Timed by the machine, a sweep's repeats go round (every point's first, then every point's
// second) so a load change hits every point alike; such a run records the load it started
// under. On the virtual clock each point's repeats stay together and no load is read.
TEST(ExperimentLibrary, MeasuredRepeatsGoRoundAndRecordTheLoad) {
  auto repeats_in_order = [](const std::vector<ExperimentRun>& runs) {
    std::vector<std::int64_t> order;
    for (const auto& r : runs) order.push_back(r.repeat);
    return order;
  };
  const auto measured = load_experiment(
      kQuickstart, small({"experiment.clock=\"measured\"", "experiment.repeats=2"}));
  EXPECT_EQ(repeats_in_order(measured), (std::vector<std::int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(measured[1].config.scheduler, "fcfs");
  const auto virtual_clock = load_experiment(kQuickstart, small({"experiment.repeats=2"}));
  EXPECT_EQ(repeats_in_order(virtual_clock), (std::vector<std::int64_t>{0, 1, 0, 1}));
  EXPECT_GE(run_experiment(measured[0].config, false, nullptr).machine_load_1m, 0);
  EXPECT_EQ(run_experiment(virtual_clock[0].config, false, nullptr).machine_load_1m, -1);
}

TEST(ExperimentLibrary, ValidateNamesTheSweepPointThatCannotRun) {
  // max_batch 0 is out of fcfs's range; static's own max_batch is untouched and fine.
  const auto runs = load_experiment(kQuickstart, small({"scheduler.params.max_batch=0"}));
  const std::string message = test::error_of<Error>([&] { validate_experiment(runs, false); });
  EXPECT_NE(message.find("max_batch"), std::string::npos) << message;
  EXPECT_NE(message.find("scheduler.name="), std::string::npos) << message;
}

// The Mooncake conversation trace on the cpu backend, lengths scaled for the tiny model (512-token
// blocks become 16, one page): every token equals the reference's, the prefix cache hits what the
// trace shares and never more than an infinite cache would.
TEST(ExperimentLibrary, MooncakeTraceReplaysTokenIdenticalOnTheCpuBackend) {
  const std::string trace =
      std::string(KVLAB_SOURCE_DIR) + "/data/mooncake-fast25/conversation_trace.jsonl";
  const auto runs =
      load_experiment(kQuickstart, small({"workload={trace=\"" + trace +
                                          "\", replay={length_scale=0.03125, max_requests=40}}"}));
  validate_experiment(runs, true);
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(runs[1].config, true, &mismatches);
  EXPECT_TRUE(mismatches.empty()) << mismatches.front();
  EXPECT_EQ(out.summary.submitted, 40);
  EXPECT_EQ(out.summary.finished, 40);
  ASSERT_TRUE(out.ideal_prefix_hit_rate.has_value());
  EXPECT_GT(out.prefix_hit_rate, 0.0);
  EXPECT_LE(out.prefix_hit_rate, *out.ideal_prefix_hit_rate);
  EXPECT_NE(out.workload_description.find("Mooncake trace conversation_trace.jsonl: 40 requests"),
            std::string::npos)
      << out.workload_description;
  // [workload.replay] is refused without a trace, and on a trace of kvlab's own format.
  EXPECT_NE(test::error_of<Error>([] {
              (void)load_experiment(kQuickstart, small({"workload.replay={max_requests=3}"}));
            }).find("[workload.replay] replays a part of workload.trace"),
            std::string::npos);
  const test::TempDir dir;
  test::write_file(dir.path() / "own.jsonl",
                   "{\"arrival_s\": 0, \"prompt_len\": 4, \"output_len\": 2}\n");
  const auto own = load_experiment(
      kQuickstart, small({"workload={trace=\"" + (dir.path() / "own.jsonl").string() +
                          "\", replay={max_requests=3}}"}));
  EXPECT_NE(test::error_of<Error>([&] {
              (void)run_experiment(own[1].config, false, nullptr);
            }).find("[workload.replay] is for a Mooncake trace"),
            std::string::npos);
}

// backend.context_parallel is the simulated backend's; a fixed length above the default clamp is
// kept, not cut to 4096.
TEST(ExperimentLibrary, ContextParallelAndFixedLengthsAreReadAsWritten) {
  EXPECT_NE(test::error_of<Error>([] {
              (void)load_experiment(kQuickstart, small({"backend.context_parallel=2"}));
            }).find("backend.context_parallel is the simulated backend's GPUs per model"),
            std::string::npos);
  const auto runs = load_experiment(
      kQuickstart,
      small({"workload.prompt_tokens={dist=\"fixed\", value=126195}", "backend.name=\"simulated\"",
             "backend.profile=\"h200\"", "backend.context_parallel=4"}));
  EXPECT_EQ(runs[0].config.context_parallel, 4);
  EXPECT_EQ(runs[0].config.workload.prompt_tokens.max, 126195);
  const auto clamped = load_experiment(
      kQuickstart, small({"workload.prompt_tokens={dist=\"fixed\", value=9000, max=4096}"}));
  EXPECT_EQ(clamped[0].config.workload.prompt_tokens.max, 4096);  // an explicit max still clamps
}

// experiments/kv_tiers.toml, as `kvlab check` runs it: the cpu backend's tiers really copy the
// blocks (a host buffer, a file), and every token of every point equals the reference's while
// blocks come back from host memory and from disk.
TEST(ExperimentLibrary, KvTiersGiveTheReferencesTokensOnTheCpuBackend) {
  const auto runs =
      load_experiment(std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "kv_tiers.toml",
                      {std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
                       "workload.requests=24"});
  ASSERT_EQ(runs.size(), 4u);
  validate_experiment(runs, true);
  std::vector<RunOutput> outs;
  for (const auto& run : runs) {
    std::vector<std::string> mismatches;
    outs.push_back(run_experiment(run.config, true, &mismatches));
    EXPECT_TRUE(mismatches.empty()) << run.config.label << ": " << mismatches.front();
    EXPECT_EQ(outs.back().summary.finished, outs.back().summary.submitted) << run.config.label;
  }
  EXPECT_FALSE(outs[0].kv_tiers.has_value());  // no tiers
  for (std::size_t i = 1; i < outs.size(); ++i) {
    ASSERT_TRUE(outs[i].kv_tiers.has_value()) << runs[i].config.label;
    EXPECT_GT(outs[i].kv_tiers->host_hit_rate, 0) << runs[i].config.label;
    EXPECT_GT(outs[i].prefix_hit_rate, outs[0].prefix_hit_rate) << runs[i].config.label;
    EXPECT_GT(outs[i].kv_tiers->time_s, 0) << runs[i].config.label;  // the cpu profile's copies
  }
  EXPECT_EQ(outs[1].kv_tiers->disk_hit_rate, 0);
  EXPECT_GT(outs[2].kv_tiers->disk_hit_rate, 0);
  EXPECT_GT(outs[3].kv_tiers->disk_hit_rate, 0);
}

// Disaggregated prefill and decode on the cpu backend: 1 prefill + 2 decode replicas, each
// request's KV really copied out of the prefill replica's pool and into a decode replica's.
// `kvlab check` holds every token equal to the reference; with sampling, the tokens equal the
// same requests' on one colocated replica (the decode side's sampler continues the stream).
TEST(ExperimentLibrary, DisaggregatedCpuClusterGivesTheSameTokens) {
  const auto file = std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "prefix_caching.toml";
  const std::vector<std::string> base{
      std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
      "workload.requests=12"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return load_experiment(file, more);
  };
  const auto split = with({"cluster.replicas=3", "cluster.prefill_replicas=1"});
  validate_experiment(split, true);
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(split[1].config, true, &mismatches);
  EXPECT_TRUE(mismatches.empty()) << mismatches.front();
  EXPECT_EQ(out.summary.finished, 12);
  EXPECT_EQ(out.summary.kv_transfer_s.count, 12);  // every request went on to a decode replica
  std::int64_t expected_bytes = 0;  // stories15m: 6 layers x 6 K/V heads x 48 x 2 x f32
  for (const auto& r : out.engine.requests) expected_bytes += r.prompt_tokens * 6 * 288 * 2 * 4;
  EXPECT_EQ(out.summary.kv_transfer_bytes, expected_bytes);
  for (const auto& r : out.engine.requests)
    EXPECT_EQ(r.output_tokens(), (int)out.engine.tokens[r.id].size());

  const std::vector<std::string> sampled{"workload.temperature=0.9", "workload.top_p=0.95"};
  auto sampled_with = [&](std::vector<std::string> more) {
    more.insert(more.end(), sampled.begin(), sampled.end());
    return run_experiment(with(more)[1].config, false, nullptr);
  };
  const RunOutput colocated = sampled_with({});
  const RunOutput disaggregated =
      sampled_with({"cluster.replicas=3", "cluster.prefill_replicas=1"});
  EXPECT_EQ(disaggregated.engine.tokens, colocated.engine.tokens);
  EXPECT_EQ(disaggregated.summary.kv_transfer_s.count, 12);
}

// On the simulated backend each handoff takes what the profile's [network] says for its bytes:
// latency + bytes / bandwidth, from the first token to the KV's arrival on the decode replica.
// Each handoff is priced over the profile's network, and transfers share each replica's link:
// replayed here first come first served (in handoff order), each starts when its prefill and
// decode replicas' links are both free. At 1 GB/s (a 400 ms transfer for 1,000 tokens) they
// queue; at the profile's 46 GB/s they mostly do not.
TEST(ExperimentLibrary, DisaggregatedHandoffsArePricedOverTheProfilesNetwork) {
  for (const double gb_per_s : {46.0, 1.0}) {
    const auto runs = load_experiment(
        std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "disaggregation.toml",
        {std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
         "workload.requests=60",
         fmt::format("hardware.network.kv_transfer_gb_per_s={}", gb_per_s)});
    const RunOutput out = run_experiment(runs[2].config, false, nullptr);  // 2 prefill, 2 decode
    HardwareProfile profile = load_hardware_profile("a100-80gb");
    profile.kv_transfer_gb_per_s = gb_per_s;
    const CostModel cost(model_preset("llama2-7b"), profile);
    ASSERT_EQ(out.summary.finished, 60);
    std::map<RequestId, std::vector<std::int64_t>> replicas;  // its prefill, then decode replica
    for (const EngineEvent& e : out.engine.events)
      if (e.kind == EventKind::event_route) replicas[e.request].push_back(e.replica);
    std::vector<const RequestTimeline*> by_handoff;
    for (const auto& r : out.engine.requests) by_handoff.push_back(&r);
    std::stable_sort(by_handoff.begin(), by_handoff.end(), [](const auto* a, const auto* b) {
      return a->token_times_s.front() < b->token_times_s.front();
    });
    std::map<std::int64_t, double> link_free;
    int queued = 0;
    for (const RequestTimeline* r : by_handoff) {
      ASSERT_TRUE(r->kv_arrival_s.has_value()) << r->id;
      ASSERT_EQ(replicas[r->id].size(), 2u) << r->id;
      const std::int64_t bytes =
          r->prompt_tokens * static_cast<std::int64_t>(cost.kv_bytes_per_token());
      EXPECT_EQ(r->kv_transfer_bytes, bytes) << r->id;
      double& from = link_free[replicas[r->id][0]];
      double& to = link_free[replicas[r->id][1]];
      const double start = std::max({r->token_times_s.front(), from, to});
      queued += start > r->token_times_s.front();
      from = to = start + cost.kv_transfer_seconds(bytes);
      EXPECT_NEAR(*r->kv_arrival_s, from, 1e-9) << r->id << " at " << gb_per_s << " GB/s";
      EXPECT_GE(*r->decode_scheduled_s, *r->kv_arrival_s) << r->id;
    }
    if (gb_per_s < 2) {
      EXPECT_GT(queued, 10) << "the slow links must have queued transfers";
    }
    EXPECT_EQ(out.replicas.size(), 4u);
    EXPECT_EQ(out.replicas[0].requests + out.replicas[1].requests, 60);  // prefill side
    EXPECT_EQ(out.replicas[2].requests + out.replicas[3].requests, 60);  // decode side
  }
}

// Each side its own tensor parallelism (DistServe's prefill TP 2 beside decode TP 1): each
// replica's pool is its GPUs' (a TP-2 replica holds half the weights per GPU: more KV), steps
// are priced for its GPUs, the handoff at the single decode GPU's share, and goodput per GPU
// counts 2 + 1 + 1.
TEST(ExperimentLibrary, DisaggregatedSidesHaveTheirOwnTensorParallelism) {
  const auto runs = load_experiment(
      std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "disaggregation.toml",
      {std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
       "workload.requests=60", "cluster.replicas=3", "cluster.prefill_replicas=1",
       "cluster.prefill_tensor_parallel=2", "cluster.decode_tensor_parallel=1"});
  ASSERT_EQ(runs.size(), 1u);  // the file's sweep over prefill_replicas replaced
  ExperimentConfig c = runs[0].config;
  ASSERT_EQ(c.prefill_replicas, 1);
  EXPECT_EQ(c.tensor_parallel_of(0), 2);
  EXPECT_EQ(c.tensor_parallel_of(2), 1);
  EXPECT_EQ(c.gpus(), 4);
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(c, false, nullptr);
  ASSERT_EQ(out.summary.finished, 60);
  const ModelConfig model = model_preset("llama2-7b");
  const CostModel tp1(model, load_hardware_profile("a100-80gb"));
  const CostModel tp2(model, load_hardware_profile("a100-80gb"), 2);
  ASSERT_EQ(out.replicas.size(), 3u);
  EXPECT_EQ(out.replicas[0].tensor_parallel, 2);
  EXPECT_EQ(out.replicas[0].kv_slots, tp2.kv_capacity_tokens() / 256 * 256);
  EXPECT_EQ(out.replicas[1].kv_slots, tp1.kv_capacity_tokens() / 256 * 256);
  EXPECT_GT(out.replicas[0].kv_slots, 2 * out.replicas[1].kv_slots);  // weights split in two
  int unqueued = 0;  // the decode GPU takes all of it: the TP-1 price (when its link was free)
  for (const auto& r : out.engine.requests) {
    const double took = *r.kv_arrival_s - r.token_times_s.front();
    const double price = tp1.kv_transfer_seconds(r.kv_transfer_bytes);
    EXPECT_GE(took, price - 1e-9) << r.id;
    unqueued += std::abs(took - price) < 1e-9;
  }
  EXPECT_GT(unqueued, 30);
  EXPECT_GT(tp1.kv_transfer_seconds(1 << 20), tp2.kv_transfer_seconds(1 << 20));
  const nlohmann::json goodput = [&] {
    for (const RunMetric& m : run_metrics())
      if (m.name == "goodput_per_gpu") return m.extract(c, out);
    return nlohmann::json();
  }();
  EXPECT_DOUBLE_EQ(goodput.get<double>(), out.summary.goodput_per_s / 4);
  // A side's TP needs a disaggregated cluster and the simulated backend.
  EXPECT_NE(test::error_of<Error>([] {
              (void)load_experiment(kQuickstart, small({"cluster.prefill_tensor_parallel=2"}));
            }).find("set cluster.prefill_replicas"),
            std::string::npos);
  EXPECT_NE(test::error_of<Error>([] {
              (void)load_experiment(kQuickstart,
                                    small({"cluster.replicas=2", "cluster.prefill_replicas=1",
                                           "cluster.decode_tensor_parallel=2"}));
            }).find("the simulated backend's GPUs per replica"),
            std::string::npos);
}

// [kv_tiers] mistakes are named before anything runs.
TEST(ExperimentLibrary, KvTierMistakesAreClearErrors) {
  auto error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(error({"kv_cache.allocator=\"static\"", "kv_tiers.host_gib=1"})
                .find("needs kv_cache.allocator = \"paged\""),
            std::string::npos);
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false", "kv_tiers.host_gib=1"})
                .find("needs kv_cache.params.prefix_caching = true"),
            std::string::npos);
  EXPECT_NE(error({"kv_tiers.disk_gib=1"}).find("the disk tier sits below host memory"),
            std::string::npos);
  const auto tiny_tier = load_experiment(kQuickstart, small({"kv_tiers.host_gib=1e-9"}));
  EXPECT_NE(test::error_of<Error>([&] {
              (void)run_experiment(tiny_tier[0].config, false, nullptr);
            }).find("the host tier's 1 bytes hold no block"),
            std::string::npos);
  EXPECT_NE(error({"kv_tiers.host_gib=-1"}).find("kv_tiers.host_gib must be in [0, 1e6] GiB"),
            std::string::npos);
  EXPECT_NE(error({"kv_tiers.host_gib=1", "kv_tiers.policy=\"lfu\""}).find("lfu"),
            std::string::npos);
  EXPECT_NE(error({"kv_tiers.host_gib=1", "kv_tiers.disk_gib=1",
                   "kv_tiers.disk_directory=\"/nonexistent/kvlab\""})
                .find("kv_tiers.disk_directory /nonexistent/kvlab is not a folder"),
            std::string::npos);
  EXPECT_NE(error({"kv_tiers.host_gib=1", "kv_tiers.size=1"}).find("size"), std::string::npos);
}

// [kv_policy] runs a policy in the engine: every request finishes with its outputs. Its mistakes
// are named before anything runs: a missing name, an allocator that cannot drop positions, a
// policy's own parameters, a backend without scores, and kvlab check without a tolerance.
TEST(ExperimentLibrary, KvPolicyRunsAndItsMistakesAreClearErrors) {
  const std::vector<std::string> policy = {"kv_cache.params.prefix_caching=false",
                                           "kv_policy={name=\"h2o\", params={budget=6}}"};
  const auto runs = load_experiment(kQuickstart, small(policy));
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(runs[0].config, false, nullptr);
  EXPECT_EQ(out.summary.finished, 6);
  EXPECT_EQ(out.summary.rejected, 0);
  auto error = [](std::vector<std::string> more, bool check = false) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), check); });
  };
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false", "kv_policy={params={budget=6}}"})
                .find("[kv_policy] needs name"),
            std::string::npos);
  EXPECT_NE(error({"kv_policy={name=\"h2o\"}"}).find("prefix_caching = false"), std::string::npos);
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false", "kv_policy={name=\"h20\"}"}).find("h2o"),
            std::string::npos);
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false",
                   "kv_policy={name=\"streaming_llm\", params={budget=4, sinks=4}}"})
                .find("sinks must be below the budget"),
            std::string::npos);
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false",
                   "kv_policy={name=\"snapkv\", params={budget=64}}", "backend.name=\"simulated\"",
                   "backend.profile=\"h200\""})
                .find("reads attention scores"),
            std::string::npos);
  EXPECT_NE(error(policy, true).find("--tolerance"), std::string::npos);
}

// A KV policy over Gemma 3's KV groups (gemma3-tiny: an 8-token window on 5 of its 6 layers,
// kv_cache.groups = "per_kind": one global group, five local ones): each group frees what none of
// its layers keeps, group 0 what no layer keeps. The heads choose among the same positions as
// over one table of every layer (what a local layer's window passed is hidden from its heads'
// choice either way), so the tokens are the same, and the grouped slots hold fewer positions.
TEST(ExperimentLibrary, AKvPolicyOverKvGroupsFreesEachGroupsPositionsAndKeepsTheTokens) {
  for (const std::string policy : {"h2o", "streaming_llm"}) {
    const auto run = [&](const std::string& groups) {
      const auto runs = load_experiment(
          kQuickstart, small({"model.name=\"gemma3-tiny\"", "scheduler.name=\"fcfs\"",
                              "workload.prompt_tokens={dist=\"uniform\", min=24, max=40}",
                              "workload.output_tokens={dist=\"uniform\", min=12, max=20}",
                              "kv_cache.allocator=\"paged\"",
                              "kv_cache.params={block_size=4, prefix_caching=false}",
                              "kv_cache.groups=\"" + groups + "\"",
                              "kv_policy={name=\"" + policy + "\", params={budget=5}}"}));
      validate_experiment(runs, false);
      return run_experiment(runs[0].config, false, nullptr);
    };
    const RunOutput uniform = run("uniform"), grouped = run("per_kind");
    EXPECT_EQ(grouped.summary.finished, 6) << policy;
    EXPECT_EQ(grouped.engine.tokens, uniform.engine.tokens) << policy;
    EXPECT_GT(grouped.engine.kv_policy.selections, 0) << policy;
    EXPECT_EQ(grouped.engine.kv_policy.selections, uniform.engine.kv_policy.selections) << policy;
    EXPECT_DOUBLE_EQ(grouped.engine.kv_policy.mean_seen(), uniform.engine.kv_policy.mean_seen())
        << policy;
    // Held, averaged over the 6 groups of one layer and one K/V head: group 0 the union (as the
    // uniform table holds it), each local group only the 5 positions its head keeps, fewer than
    // the 7 of the union its window still shows (measured: h2o 5.58 against 8.46, streaming_llm
    // 1.67 against 5.00: a local layer's window has passed its sinks).
    const double union_held = uniform.engine.kv_policy.mean_held();
    EXPECT_LE(grouped.engine.kv_policy.mean_held(), (union_held + 5 * 5.0) / 6 + 1e-9) << policy;
    EXPECT_LT(grouped.engine.kv_policy.mean_held(), 0.7 * union_held) << policy;
  }
}

// [speculation] runs prompt lookup in the engine (every request finishes, proposals verified);
// its mistakes are named before anything runs.
TEST(ExperimentLibrary, SpeculationRunsAndItsMistakesAreClearErrors) {
  const auto runs = load_experiment(kQuickstart, small({"speculation={tokens=3}"}));
  validate_experiment(runs, true);
  EXPECT_EQ(runs[0].config.speculation.tokens, 3);
  EXPECT_EQ(runs[0].config.speculation.adaptive, AdaptiveLength::off);
  for (const auto& [text, adaptive] :
       {std::pair{"true", AdaptiveLength::priced}, std::pair{"'priced'", AdaptiveLength::priced},
        std::pair{"'measured'", AdaptiveLength::measured}, std::pair{"false", AdaptiveLength::off}})
    EXPECT_EQ(
        load_experiment(kQuickstart, small({fmt::format("speculation={{adaptive={}}}", text)}))[0]
            .config.speculation.adaptive,
        adaptive)
        << text;
  const RunOutput out = run_experiment(runs[0].config, true, nullptr);
  EXPECT_EQ(out.summary.finished, 6);
  auto error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(error({"speculation={proposer=\"eagle\"}"}).find("eagle"), std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"eagle\"}"}).find("prompt_lookup"), std::string::npos)
      << "the proposers there are";
  EXPECT_NE(error({"speculation={proposer=\"simulated\"}"}).find("backend.name = \"simulated\""),
            std::string::npos);
  EXPECT_NE(error({"speculation={acceptance_rate=0.5}"}).find("the simulated proposer's"),
            std::string::npos);
  EXPECT_NE(error({"speculation={tokens=65}"}).find("tokens"), std::string::npos);
  EXPECT_NE(error({"speculation={min_ngram=4, max_ngram=2}"}).find("must not exceed max_ngram"),
            std::string::npos);
  EXPECT_NE(error({"speculation={adaptive=\"sometimes\"}"}).find("\"measured\""),
            std::string::npos);
  EXPECT_NE(error({"speculation={adaptive=1}"}).find("speculation.adaptive is false, true"),
            std::string::npos);
  EXPECT_NE(error({"speculation={accept_trace=\"v.csv\"}"}).find("the simulated proposer's"),
            std::string::npos);
  EXPECT_NE(error({"kv_cache.params.prefix_caching=false", "kv_policy={name=\"window\"}",
                   "speculation={tokens=2}"})
                .find("drop one of the two tables"),
            std::string::npos);
}

// The draft proposer on the cpu backend. A draft with the target's own weights (draft_model =
// the target's preset and weights seed) proposes the target's greedy tokens: every proposal is
// accepted. The target's first layer (draft_layers = 1: an early exit through its final norm and
// LM head) proposes tokens the target mostly rejects, so the draft's KV is cut back nearly every
// step. Both give the reference's tokens exactly (kvlab check's comparison, greedy).
TEST(ExperimentLibrary, ADraftModelOrTheTargetsFirstLayersProposeAndGiveTheReferencesTokens) {
  const auto run = [](const std::string& draft) {
    const auto runs = load_experiment(
        kQuickstart, small({"scheduler.name=\"fcfs\"", "workload.requests=5",
                            "workload.output_tokens={dist=\"uniform\", min=12, max=20}",
                            "speculation={proposer=\"draft\", tokens=3, " + draft + "}"}));
    validate_experiment(runs, true);
    std::vector<std::string> mismatches;
    RunOutput out = run_experiment(runs[0].config, true, &mismatches);
    EXPECT_TRUE(mismatches.empty()) << draft << ": " << mismatches.front();
    EXPECT_EQ(out.summary.finished, 5) << draft;
    EXPECT_GT(out.check.tokens, 0) << draft;
    return out;
  };
  const auto acceptance = [](const RunOutput& out) {
    std::int64_t proposed = 0, accepted = 0;
    for (const VerifyRecord& v : out.engine.verifies) {
      proposed += v.proposed;
      accepted += v.accepted;
    }
    EXPECT_GT(proposed, 20);
    return static_cast<double>(accepted) / static_cast<double>(std::max<std::int64_t>(proposed, 1));
  };
  EXPECT_EQ(acceptance(run("draft_model=\"tiny\"")), 1.0) << "the target's own weights";
  const double early_exit = acceptance(run("draft_layers=1"));
  EXPECT_LT(early_exit, 0.9) << "proposals rejected: the rollback runs";
}

// The draft's mistakes are named before anything runs.
TEST(ExperimentLibrary, DraftMistakesAreClearErrors) {
  auto error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(error({"speculation={proposer=\"draft\"}"}).find("draft_model"), std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"draft\", draft_layers=2, draft_model=\"tiny\"}"})
                .find("give one"),
            std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"draft\", draft_layers=64}"}).find("needs fewer than"),
            std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"draft\", draft_model=\"stories15m\"}"})
                .find("the same tokenizer"),
            std::string::npos);
  EXPECT_NE(error({"speculation={draft_layers=1}"}).find("prompt_lookup runs no draft"),
            std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"draft\", draft_layers=1}", "backend.name=\"simulated\"",
                   "backend.profile=\"h200\""})
                .find("backend.name = \"cpu\""),
            std::string::npos);
  EXPECT_NE(error({"speculation={proposer=\"draft\", draft_layers=1, max_ngram=2}"})
                .find("prompt_lookup's n-gram range"),
            std::string::npos);
  EXPECT_NE(error({"speculation={min_ngram=1, params={x=1}}"}).find("keys of [speculation]"),
            std::string::npos);
}

TEST(ExperimentLibrary, DisaggregationMistakesAreClearErrors) {
  auto error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(error({"cluster.replicas=2", "cluster.prefill_replicas=2"})
                .find("cluster.prefill_replicas (2) leaves no decode replica of 2"),
            std::string::npos);
  EXPECT_NE(error({"cluster.replicas=2", "cluster.prefill_replicas=1",
                   "cluster.decode_router=\"nearest\""})
                .find("nearest"),
            std::string::npos);
  EXPECT_NE(
      error({"cluster.replicas=2", "cluster.prefill_replicas=1", "attention.variant=\"recompute\""})
          .find("keeps no KV to hand over"),
      std::string::npos);
}

TEST(ExperimentLibrary, RunChecksEveryTokenAndWritesTheResults) {
  const auto runs = load_experiment(kQuickstart, small());
  validate_experiment(runs, true);
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(runs[1].config, true, &mismatches);
  EXPECT_TRUE(mismatches.empty()) << mismatches.front();
  EXPECT_EQ(out.summary.submitted, 6);
  EXPECT_EQ(out.summary.finished + out.summary.rejected, out.summary.submitted);
  EXPECT_GT(out.summary.finished, 0);
  test::TempDir dir;
  write_run_outputs(dir.path(), runs[1].config, out);
  for (const char* file : {"requests.csv", "steps.csv", "events.jsonl", "summary.json"})
    EXPECT_TRUE(std::filesystem::exists(dir / file)) << file;
  const auto summary = nlohmann::json::parse(test::read_file(dir / "summary.json"));
  EXPECT_EQ(summary["finished"], out.summary.finished);
  EXPECT_EQ(summary["steps"], out.engine.steps.size());
  EXPECT_EQ(summary["clock"], "virtual");  // and what priced it
  EXPECT_EQ(summary["profile"], "cpu");
  EXPECT_DOUBLE_EQ(summary["kv_waste_of_held_fraction"].get<double>(), out.kv_waste_of_held);
}

// A check of requests that ask for log-probabilities holds every token's, and its top k, to the
// reference's at the same position (within logprob_tolerance: 1e-3 here, exact settings).
TEST(ExperimentLibrary, CheckComparesLogprobsWhenTheRequestsAskForThem) {
  const auto runs = load_experiment(kQuickstart, small({"workload.logprobs=3"}));
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(runs[1].config, true, &mismatches);
  EXPECT_TRUE(mismatches.empty()) << mismatches.front();
  ASSERT_GT(out.check.tokens, 0);
  EXPECT_EQ(out.check.logprobs.tokens, out.check.tokens);
  EXPECT_EQ(out.check.logprobs.entries, 3 * out.check.tokens);
  EXPECT_LT(out.check.logprobs.max_abs_delta, logprob_tolerance(0));
  const RunOutput without =
      run_experiment(load_experiment(kQuickstart, small())[1].config, true, &mismatches);
  EXPECT_EQ(without.check.logprobs.tokens, 0);  // nobody asked
}

// workload.logprobs = k: logprobs.jsonl holds, per request, each generated token's
// log-probability and its position's k most likely tokens; out of range, or on the simulated
// backend (no logits), the file is refused by name.
TEST(ExperimentLibrary, LogprobsAreWrittenPerGeneratedToken) {
  const auto runs = load_experiment(
      kQuickstart, small({"workload.logprobs=4", "workload.temperature=0.7", "workload.top_k=5"}));
  EXPECT_EQ(runs[1].config.workload.logprobs, 4);
  const RunOutput out = run_experiment(runs[1].config, false, nullptr);
  test::TempDir dir;
  write_run_outputs(dir.path(), runs[1].config, out);
  std::istringstream lines(test::read_file(dir / "logprobs.jsonl"));
  std::string line;
  std::size_t requests = 0;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    const auto& tokens = out.engine.tokens[j["id"].get<std::size_t>()];
    ASSERT_EQ(j["tokens"].get<std::vector<std::int32_t>>(), tokens);
    ASSERT_EQ(j["token_logprobs"].size(), tokens.size());
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      const auto& top = j["top_logprobs"][t];
      ASSERT_EQ(top.size(), 4u);
      EXPECT_LE(j["token_logprobs"][t].get<float>(), 0.0f);
      // Most likely first; the sampled token (top_k 5) is no likelier than the first.
      for (std::size_t k = 1; k < 4; ++k)
        EXPECT_GE(top[k - 1][1].get<float>(), top[k][1].get<float>());
      EXPECT_LE(j["token_logprobs"][t].get<float>(), top[0][1].get<float>());
    }
    ++requests;
  }
  EXPECT_EQ(static_cast<std::int64_t>(requests), out.summary.finished);
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(load_error({"workload.logprobs=21"}).find("logprobs"), std::string::npos);
  EXPECT_NE(
      load_error({"workload.logprobs=2", "backend.name=\"simulated\"", "backend.profile=\"h200\""})
          .find("needs a backend with logits"),
      std::string::npos);
}

// Behind a router each replica computes its requests' logprobs; the merged run keeps them by
// request, as one engine would (greedy: the same tokens; the CPU backend's rows agree to 1e-4
// whatever the batch, as kvlab check's logit line measures).
TEST(ExperimentLibrary, ClusterRunsKeepEachRequestsLogprobs) {
  const std::vector<std::string> greedy{"workload.logprobs=3", "workload.temperature=0"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), greedy.begin(), greedy.end());
    return run_experiment(load_experiment(kQuickstart, small(std::move(more)))[1].config, false,
                          nullptr);
  };
  const RunOutput one = with({});
  const RunOutput two = with({"cluster.replicas=2", "cluster.router=\"round_robin\""});
  ASSERT_EQ(two.engine.logprobs.size(), one.engine.logprobs.size());
  for (std::size_t i = 0; i < one.engine.tokens.size(); ++i) {
    ASSERT_EQ(two.engine.tokens[i], one.engine.tokens[i]) << i;
    ASSERT_EQ(two.engine.logprobs[i].size(), one.engine.tokens[i].size()) << i;
    for (std::size_t t = 0; t < one.engine.tokens[i].size(); ++t) {
      const GeneratedLogprobs &a = one.engine.logprobs[i][t], &b = two.engine.logprobs[i][t];
      EXPECT_NEAR(b.logprob, a.logprob, 1e-4) << i << " " << t;
      ASSERT_EQ(b.top.size(), 3u);
      for (std::size_t k = 0; k < 3; ++k) EXPECT_EQ(b.top[k].token, a.top[k].token) << i;
    }
  }
}

TEST(ExperimentLibrary, SameFileSameBytes) {
  const auto runs = load_experiment(kQuickstart, small());
  test::TempDir a, b;
  write_run_outputs(a.path(), runs[1].config, run_experiment(runs[1].config, false, nullptr));
  write_run_outputs(b.path(), runs[1].config, run_experiment(runs[1].config, false, nullptr));
  for (const char* file : {"requests.csv", "steps.csv", "events.jsonl", "summary.json"})
    EXPECT_EQ(test::read_file(a / file), test::read_file(b / file)) << file;
}

// The Azure trace as a workload: its first minute on the simulated H200.
TEST(ExperimentLibrary, AzureTraceReplaysTheTracesRequests) {
  const auto file =
      std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / "azure_conv_replay.toml";
  const auto runs = load_experiment(
      file,
      {"workload.azure_trace.duration_s=60", "sweep=[{key=\"scheduler.name\", values=[\"fcfs\"]}]",
       std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"});
  ASSERT_EQ(runs.size(), 1u);
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(runs[0].config, false, nullptr);
  AzureTraceOptions options;
  options.duration_s = 60;
  const auto expected =
      load_azure_trace(std::filesystem::path(KVLAB_SOURCE_DIR) / "data" /
                           "azure-llm-inference-2023" / "AzureLLMInferenceTrace_conv.csv",
                       options);
  EXPECT_EQ(out.summary.submitted, static_cast<std::int64_t>(expected.requests.size()));
  EXPECT_EQ(out.summary.finished, out.summary.submitted);
  EXPECT_NE(out.workload_description.find("clipped to the 4096-token context"), std::string::npos)
      << out.workload_description;
}

// [[workload.tenants]]: every key checked where it is written; a trace that names its tenants
// refuses shares and tenants it never names, when its requests are made.
TEST(ExperimentLibrary, TenantListsAreChecked) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"workload.tenants=[{name=\"a\", shares=1}]",
       "unknown key \"shares\" in [workload.tenants[0]] (did you mean \"share\"?)"},
      {"workload.tenants={name=\"a\"}", "workload.tenants must be a list of tables"},
      {"workload.tenants=[{share=1}]", "workload.tenants[0] needs name"},
      {"workload.tenants=[{name=\"a b\"}]", "tenant name \"a b\" must be 1-64 characters"},
      {"workload.tenants=[{name=\"a\", ttft_s=-1}]",
       "workload.tenants[0].ttft_s must be a finite number of seconds > 0"},
      {"workload.tenants=[{name=\"a\"}, {name=\"a\"}]", "tenant \"a\" is listed twice"},
      {"workload.tenants=[{name=\"a\", share=0}]", "must have a positive sum"},
      {"workload.tenants=[{name=\"a\", share=nan}]", "share must be a finite number >= 0"},
  };
  for (const auto& [set, expected] : cases)
    EXPECT_NE(load_error({set}).find(expected), std::string::npos)
        << set << ": " << load_error({set});
  test::TempDir dir;
  test::write_file(dir / "t.csv", "arrival_s,prompt_len,output_len,tenant\n0,8,2,a\n0,8,2,b\n");
  auto run_error = [&](const std::string& tenants) {
    auto runs =
        load_experiment(kQuickstart, small({fmt::format("workload={{trace=\"{}\", tenants={}}}",
                                                        (dir / "t.csv").string(), tenants)}));
    return test::error_of<Error>([&] { (void)run_experiment(runs[0].config, false, nullptr); });
  };
  EXPECT_NE(run_error("[{name=\"a\", share=1}]").find("the trace names each request's tenant"),
            std::string::npos);
  EXPECT_NE(run_error("[{name=\"c\"}]").find("tenant \"c\" sends no request: the trace names a, b"),
            std::string::npos);
}

TEST(ExperimentLibrary, RealWorkloadSectionsAreChecked) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(load_error({"workload.azure_trace={start_s=1}"}).find("needs file"), std::string::npos);
  EXPECT_NE(load_error({"workload.prompts={file=\"x.jsonl\", chatt=true}"})
                .find("unknown key \"chatt\" in [workload.prompts] (did you mean \"chat\"?)"),
            std::string::npos);
  EXPECT_NE(load_error({"workload.trace=\"t.csv\"", "workload.azure_trace={file=\"a.csv\"}"})
                .find("at most one of trace"),
            std::string::npos);
  EXPECT_NE(
      load_error({"workload.azure_trace={file=\"a.csv\", rate_scale=0}"}).find("rate_scale > 0"),
      std::string::npos);
  const auto prompts =
      std::filesystem::path(KVLAB_SOURCE_DIR) / "data" / "prompts" / "mt_bench_questions.jsonl";
  EXPECT_NE(load_error({"workload.prompts={file=\"" + prompts.string() + "\"}"})
                .find("needs a real model with a tokenizer; \"tiny\" is a preset"),
            std::string::npos);
  EXPECT_NE(load_error({"workload.azure_trace={file=\"/no/such.csv\"}"}).find("is not a file"),
            std::string::npos);
  // A setting the workload cannot honour is an error: the Azure trace draws no priorities.
  const auto azure = std::filesystem::path(KVLAB_SOURCE_DIR) / "data" / "azure-llm-inference-2023" /
                     "AzureLLMInferenceTrace_conv.csv";
  const std::string only_azure = "workload={azure_trace={file=\"" + azure.string() + "\"}}";
  EXPECT_NE(load_error({only_azure, "workload.priority_weights=[1.0, 2.0]"})
                .find("workload.priority_weights draws a priority for each synthetic request"),
            std::string::npos);
  // ... and so are the synthetic workload's settings beside a trace's own requests (the
  // quickstart's [workload] sets requests, arrival, rate and lengths), with what to do.
  const std::string synthetic =
      load_error({"workload.azure_trace={file=\"" + azure.string() + "\"}"});
  for (const char* part : {"workload.arrival, workload.output_tokens, workload.prompt_tokens, "
                           "workload.rate, workload.requests are the synthetic workload's",
                           "--set 'workload={azure_trace={file=\"FILE\"}}'"})
    EXPECT_NE(synthetic.find(part), std::string::npos) << synthetic;
  EXPECT_NE(load_error({only_azure, "workload.ignore_eos=false"})
                .find("workload.ignore_eos is the synthetic workload's"),
            std::string::npos);
  // Repeats of a simulated trace replay would be one run N times: refused, with what to do.
  const std::string repeats = load_error({only_azure, "backend.name=\"simulated\"",
                                          "backend.profile=\"h200\"", "experiment.repeats=3"});
  EXPECT_NE(repeats.find("every repeat is the same run"), std::string::npos) << repeats;
  EXPECT_NE(repeats.find("workload.azure_trace.start_s"), std::string::npos) << repeats;
  // The cpu backend on the virtual clock prices the same lengths the same way: refused too.
  EXPECT_NE(load_error({only_azure, "experiment.repeats=3"}).find("every repeat is the same run"),
            std::string::npos);
}

// Every virtual-clock run is priced by a hardware profile's cost model: the cpu backend's
// default is the shipped "cpu" profile; the old linear [time_model] and kv_cache.swap_gb_per_s
// are errors that say where their replacement lives; a plugin backend on the virtual clock
// needs a profile.
TEST(ExperimentLibrary, VirtualClockRunsArePricedByAProfile) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  const auto runs = load_experiment(kQuickstart, small());
  EXPECT_EQ(runs[0].config.profile, "cpu");
  EXPECT_EQ(load_experiment(kQuickstart, small({"backend.profile=\"h200\""}))[0].config.profile,
            "h200");
  const std::string time_model = load_error({"time_model.step_overhead_s=0.002"});
  EXPECT_NE(time_model.find("[time_model] is gone"), std::string::npos) << time_model;
  EXPECT_NE(time_model.find("backend.profile"), std::string::npos) << time_model;
  const std::string swap = load_error({"kv_cache.swap_gb_per_s=16.0"});
  EXPECT_NE(swap.find("[link] swap_gb_per_s"), std::string::npos) << swap;
  const std::string plugin = load_error({"backend.name=\"cuda\""});
#if KVLAB_HAVE_CUDA_PLUGIN
  EXPECT_NE(plugin.find("needs backend.profile"), std::string::npos) << plugin;
#else  // built without nvcc: no cuda plugin, and the error says so first
  EXPECT_NE(plugin.find("unknown backend plugin \"cuda\""), std::string::npos) << plugin;
#endif
}

// KIVI's fp16 residual (kv_cache.residual_length, a multiple of 32) is charged out of the KV
// budget for every request the scheduler may run, on the simulated backend too: LLaMA-7B's 160
// residual tokens x 512 KiB a token (fp16 K and V of 32 layers x 4096) x max_batch 8 leave
// (2048 MiB - 640 MiB) / 96 KiB (kivi2's token) slots, in whole blocks of 64; the run reports the
// residual its running requests hold (one open group of 32 tokens each: they stay short).
TEST(ExperimentLibrary, KiviResidualIsChargedOutOfTheKvBudget) {
  const std::vector<std::string> kivi{
      "backend.name=\"simulated\"",    "backend.profile=\"h200\"",
      "scheduler.name=\"fcfs\"",       "hardware.device.kv_dtype=\"kivi2\"",
      "kv_cache.params.block_size=32", "kv_cache.memory_mib=2048.0",
      "scheduler.params.max_batch=8",  "model.name=\"llama-7b\""};
  auto load = [&](std::vector<std::string> more) {
    more.insert(more.begin(), kivi.begin(), kivi.end());
    auto runs = load_experiment(kQuickstart, small(std::move(more)));
    validate_experiment(runs, false);
    return runs;
  };
  const RunOutput out = run_experiment(load({})[0].config, false, nullptr);
  const std::int64_t token_fp16 = 2 * 32 * 4096 * 2, token_kivi2 = 2 * 32 * 32 * 48;
  const std::int64_t expected =
      (2048LL * 1024 * 1024 - 8 * 160 * token_fp16) / token_kivi2 / 64 * 64;
  ASSERT_FALSE(out.engine.steps.empty());
  EXPECT_EQ(out.engine.steps.front().kv.capacity, expected);
  std::int64_t peak = 0;
  for (const auto& step : out.engine.steps) {
    EXPECT_LE(step.kv_residual_bytes, step.running * 32 * token_fp16);
    peak = std::max(peak, step.kv_residual_bytes);
  }
  EXPECT_EQ(peak % (32 * token_fp16), 0);
  EXPECT_GT(peak, 0);
  EXPECT_EQ(out.peak_kv_residual_bytes, peak);
  const RunOutput none =
      run_experiment(load({"kv_cache.residual_length=0"})[0].config, false, nullptr);
  EXPECT_EQ(none.engine.steps.front().kv.capacity,
            (2048LL * 1024 * 1024 - 8 * 32 * token_fp16) / token_kivi2 / 64 * 64);
  test::expect_error_containing(
      [&] {
        (void)run_experiment(load({"scheduler.params.max_batch=64"})[0].config, false, nullptr);
      },
      {"kv_cache.memory_mib 2048 does not hold KIVI's fp16 residual", "160 tokens", "64 requests",
       "lower max_batch or kv_cache.residual_length (128)"});
  test::expect_error_containing([&] { (void)load({"kv_cache.residual_length=100"}); },
                                {"kv_cache.residual_length", "multiple of 32, not 100"});
}

// Repeats become one row: mean ± the 95% interval's half-width, t with n-1 degrees of freedom.
TEST(SummaryTable, RepeatsAreAMeanWithA95PercentInterval) {
  // 1, 2, 6: mean 3, sd sqrt(7), t(0.975, 2) = 4.30265272974946 (tables give 4.303).
  const std::vector<double> values{1, 2, 6};
  EXPECT_NEAR(confidence_half_width_95(values), 4.30265272974946 * std::sqrt(7.0 / 3), 1e-12);
  EXPECT_EQ(confidence_half_width_95(std::vector<double>{5}), 0);
  const std::vector<SummaryColumn> columns{{"out tok/s", 1, false}, {"KV used", 1, true}};
  const std::vector<SummaryRow> rows{
      {"a", {1, 0.5}}, {"b", {10, 0.25}}, {"a", {2, 0.5}}, {"a", {6, 0.5}}};
  const std::string table = summary_table(columns, rows);
  EXPECT_NE(table.find("| run | out tok/s | KV used |\n|---|---|---|\n"), std::string::npos)
      << table;
  EXPECT_NE(table.find("| a (n=3) | 3.0 ± 6.6 | 50.0% ± 0.0 |\n"), std::string::npos) << table;
  EXPECT_NE(table.find("| b | 10.0 | 25.0% |\n"), std::string::npos) << table;
  EXPECT_LT(table.find("| a (n=3)"), table.find("| b |"));  // labels in first-seen order
}

// A latency over no request (a priority level nobody was drawn into) is "-", not 0.000.
TEST(SummaryTable, AValueNoRequestHasIsADashNotZero) {
  const auto runs = load_experiment(
      kQuickstart, small({"output.columns=[\"ttft_by_priority\"]",
                          "workload.priority_weights=[1.0, 1.0]", "experiment.repeats=1"}));
  const ExperimentConfig& c = runs[0].config;
  const RunOutput nothing;  // no request at either level
  const std::vector<SummaryRow> rows{{"a", summary_values(c, nothing)},
                                     {"a", summary_values(c, nothing)}};
  const std::string table = summary_table(summary_columns(c), rows);
  EXPECT_EQ(table.find("0.000"), std::string::npos) << table;
  EXPECT_NE(table.find("| - | - | - | - |\n"), std::string::npos) << table;  // 2 levels x p50, p99
}

// [output] columns add what an experiment is about; unknown names list the choices.
TEST(SummaryTable, ExperimentColumnsAreCheckedAndFilled) {
  const auto runs = load_experiment(
      kQuickstart, small({"output.columns=[\"prefix_hit_rate\", \"ttft_by_priority\", "
                          "\"swapped_mib\"]",
                          "workload.priority_weights=[1.0, 1.0]", "experiment.repeats=1"}));
  const ExperimentConfig& c = runs[1].config;
  const auto columns = summary_columns(c);
  const auto base = summary_columns(runs[1].config).size() - 6;  // p50 + p99 x 2 levels + 2
  EXPECT_EQ(columns[base].header, "prefix hit");
  EXPECT_EQ(columns[base + 1].header, "TTFT p50 prio 0");
  EXPECT_EQ(columns[base + 2].header, "TTFT p99 prio 0");
  EXPECT_EQ(columns[base + 3].header, "TTFT p50 prio 1");
  EXPECT_EQ(columns[base + 4].header, "TTFT p99 prio 1");
  EXPECT_EQ(columns.back().header, "swapped MiB");
  std::vector<std::string> mismatches;
  const RunOutput out = run_experiment(c, false, &mismatches);
  const auto values = summary_values(c, out);
  ASSERT_EQ(values.size(), columns.size());
  EXPECT_DOUBLE_EQ(values[2], out.summary.requests_per_s);
  EXPECT_DOUBLE_EQ(values[base], out.prefix_hit_rate);
  EXPECT_GE(values[base + 1], 0);
  const std::string message = test::error_of<Error>(
      [&] { load_experiment(kQuickstart, small({"output.columns=[\"goodputt\"]"})); });
  EXPECT_NE(message.find("\"goodputt\" is not a column"), std::string::npos) << message;
  EXPECT_NE(message.find("goodput, goodput_per_gpu"), std::string::npos) << message;
  for (const std::string& option : metric_column_options()) {  // every name the registry shows
    EXPECT_NO_THROW(load_experiment(kQuickstart, small({"output.columns=[\"" + option + "\"]"})))
        << option;
    ExperimentConfig with = c;  // and fills it from a run's figures
    with.table_columns = {option};
    EXPECT_NO_THROW((void)summary_values(with, out)) << option;
  }
}

// The cuda backend's device pool: fp8 and int8 pass the rule (whether the plugin is here or not),
// the host pool's other formats are refused naming the two.
TEST(ExperimentLibrary, CudaTakesFp8AndInt8KvOnly) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  const std::string cuda_q8 = load_error({"backend.name=\"cuda\"", "kv_cache.dtype=\"q8_0\""});
  EXPECT_NE(cuda_q8.find("quantized: kv_cache.dtype \"fp8\" or \"int8\""), std::string::npos)
      << cuda_q8;
  for (const char* dtype : {"fp8", "int8"}) {
    std::string message;  // none with the cuda plugin built; without it, its absence
    try {
      validate_experiment(
          load_experiment(kQuickstart, small({"backend.name=\"cuda\"",
                                              std::string("kv_cache.dtype=\"") + dtype + "\""})),
          false);
    } catch (const std::exception& e) {
      message = e.what();
    }
    EXPECT_EQ(message.find("kv_cache.dtype"), std::string::npos) << dtype << ": " << message;
  }
}

// [backend] weights and [kv_cache] dtype: what the cpu backend multiplies in and stores K/V as.
TEST(ExperimentLibrary, WeightFormatAndKvDtypeAreCheckedAndRun) {
  auto load_error = [](std::vector<std::string> more, bool check = false) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), check); });
  };
  EXPECT_NE(load_error({"backend.weights=\"q5_k\""}).find("backend.weights must be one of stored"),
            std::string::npos);
  EXPECT_NE(load_error({"kv_cache.dtype=\"q5_k\""}).find("kv_cache.dtype must be one of f32"),
            std::string::npos);
  EXPECT_NE(load_error({"kv_cache.dtype=\"int8\""}, true).find("check with kv_cache.dtype"),
            std::string::npos);
  EXPECT_NE(load_error({"kv_cache.rotation=\"givens\""})
                .find("kv_cache.rotation must be \"none\" or \"hadamard\", not \"givens\""),
            std::string::npos);
  EXPECT_NO_THROW(validate_experiment(
      load_experiment(kQuickstart,
                      small({"kv_cache.rotation=\"hadamard\"", "kv_cache.dtype=\"int8\""})),
      false));
  const std::string blocks = load_error({"kv_cache.dtype=\"q8_0\""});  // small(): tiny, hd 16
  EXPECT_NE(blocks.find("multiple of 32, and tiny has 16"), std::string::npos) << blocks;
  EXPECT_NE(load_error({"kv_cache.dtype=\"f16\""}, true).find("check with kv_cache.dtype"),
            std::string::npos);
  // KIVI's key groups: 32 consecutive slots of a paged block, every position kept.
  const std::string kivi = load_error({"kv_cache.dtype=\"kivi2\""});
  EXPECT_NE(kivi.find("needs allocator \"paged\" with block_size a multiple of 32"),
            std::string::npos)
      << kivi;
  EXPECT_NE(kivi.find("with block_size 16"), std::string::npos) << kivi;
  const std::string kivi_hd =
      load_error({"kv_cache.dtype=\"kivi4\"", "kv_cache.params.block_size=64"});
  EXPECT_NE(kivi_hd.find("multiple of 32, and tiny has 16"), std::string::npos) << kivi_hd;
  const std::string kivi_window =
      load_error({"kv_cache.dtype=\"kivi2\"", "kv_cache.params.block_size=32",
                  "attention.variant=\"sliding_window\""});
  EXPECT_NE(kivi_window.find("drops positions from inside them"), std::string::npos) << kivi_window;
  EXPECT_NE(load_error({"backend.weights=\"q4_0\""}, true).find("rounds them first"),
            std::string::npos);
  EXPECT_NE(load_error({"backend.activations=\"int4\""})
                .find("backend.activations must be one of f32, q8, bf16"),
            std::string::npos);
  EXPECT_NE(load_error({"backend.activations=\"q8\""}, true).find("rounds the activations"),
            std::string::npos);
  const auto runs = load_experiment(
      kQuickstart,
      small({"backend.weights=\"q8_0\"", "kv_cache.dtype=\"bf16\"", "backend.activations=\"q8\""}));
  EXPECT_EQ(runs[1].config.cpu_weights, cpu::WeightFormat::q8_0);
  EXPECT_EQ(runs[1].config.cpu_activations, cpu::ActivationFormat::q8);
  // The same as the cpu plugin's parameters: parsed once into the same fields; both ways at once
  // is refused.
  const auto as_params = load_experiment(
      kQuickstart,
      small({"backend.params.weights=\"q4_0\"", "backend.params.activations=\"bf16\""}));
  EXPECT_EQ(as_params[1].config.cpu_weights, cpu::WeightFormat::q4_0);
  EXPECT_EQ(as_params[1].config.cpu_activations, cpu::ActivationFormat::bf16);
  EXPECT_TRUE(as_params[1].config.backend_params.empty());
  EXPECT_NE(load_error({"backend.weights=\"q8_0\"", "backend.params.weights=\"q4_0\""})
                .find("backend.weights and backend.params.weights name one parameter"),
            std::string::npos);
  EXPECT_NE(load_error({"backend.params.weights=\"q5_k\""}).find("backend.weights must be one of"),
            std::string::npos);
  EXPECT_EQ(runs[1].config.kv_dtype, DType::dtype_bf16);
  validate_experiment(runs, false);
  const RunOutput out = run_experiment(runs[1].config, false, nullptr);
  EXPECT_EQ(out.summary.finished + out.summary.rejected, out.summary.submitted);
  EXPECT_GT(out.summary.finished, 0);
  EXPECT_NE(out.weights_description.find("8-bit activations"), std::string::npos)
      << out.weights_description;
}

// kv_cache.value_dtype: V's rows in a dtype of their own, the cpu backend's pool only.
TEST(ExperimentLibrary, ValueDtypeIsCheckedAndRun) {
  auto load_error = [](std::vector<std::string> more) {
    return test::error_of<Error>(
        [&] { validate_experiment(load_experiment(kQuickstart, small(std::move(more))), false); });
  };
  EXPECT_NE(
      load_error({"kv_cache.value_dtype=\"q5_k\""}).find("kv_cache.value_dtype must be one of f32"),
      std::string::npos);
  test::expect_error_containing(
      [&] {
        validate_experiment(load_experiment(kQuickstart, small({"kv_cache.value_dtype=\"f16\"",
                                                                "backend.name=\"simulated\"",
                                                                "backend.profile=\"h200\""})),
                            false);
      },
      {"value_dtype = \"f16\"", "backend \"simulated\" keeps K and V in one dtype"});
  const auto split = load_experiment(
      kQuickstart, small({"kv_cache.dtype=\"bf16\"", "kv_cache.value_dtype=\"int8\""}));
  validate_experiment(split, false);
  EXPECT_EQ(split[1].config.kv_dtype_of(true), DType::dtype_kv_int8);
  const RunOutput split_out = run_experiment(split[1].config, false, nullptr);
  EXPECT_EQ(split_out.kv_dtype, "bf16/int8");
  EXPECT_EQ(split_out.summary.finished + split_out.summary.rejected, split_out.summary.submitted);
  EXPECT_GT(split_out.summary.finished, 0);
}

}  // namespace
}  // namespace kvlab
