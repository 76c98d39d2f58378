// The lessons the teaching experiments state, asserted over several seeds with a margin. Each
// runs its experiment file on the simulated backend with the file's own hardware profile: on
// the virtual clock the time of a step is the profile's roofline either way, so the timing
// equals the cpu backend's (which would also compute the random model's tokens). A lesson
// that fails is investigated and its cause reported (docs/concepts), never loosened.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <functional>
#include <iostream>
#include <map>

#include <fstream>
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

std::filesystem::path experiment_file(const char* name) {
  return std::filesystem::path(KVLAB_SOURCE_DIR) / "experiments" / name;
}

// Every sweep point of FILE with `overrides`, simulated, one seed, each point's config changed
// by `adjust` (for what a sweep axis sets): the runs' outputs by label.
std::map<std::string, RunOutput> run_points(
    const char* file, std::uint64_t seed, std::vector<std::string> overrides = {},
    const std::function<void(ExperimentConfig&)>& adjust = {}) {
  overrides.push_back(std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]");
  overrides.push_back(fmt::format("experiment.seed={}", seed));
  overrides.push_back("backend.name=\"simulated\"");
  auto runs = load_experiment(experiment_file(file), overrides);
  std::map<std::string, RunOutput> out;
  for (auto& run : runs) {
    if (adjust) adjust(run.config);
    std::vector<std::string> mismatches;
    out[run.config.label] = run_experiment(run.config, false, &mismatches);
  }
  return out;
}

constexpr std::uint64_t kSeeds[] = {1, 2, 3};

// Orca's lesson with static batching as Hugging Face generate() runs it (finished rows padded
// until the batch ends): iteration-level scheduling serves the same requests >= 1.5x faster.
TEST(Lesson, ContinuousBatchingBeatsPaddedStaticByHalfAgain) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("static_vs_continuous.toml", seed, {"backend.profile=\"cpu\""});
    const RunSummary& stat = runs.at("scheduler.name=static").summary;
    const RunSummary& cont = runs.at("scheduler.name=fcfs").summary;
    EXPECT_GE(cont.output_tokens_per_s, 1.5 * stat.output_tokens_per_s) << "seed " << seed;
    EXPECT_LT(cont.ttft_s.p50, stat.ttft_s.p50) << "seed " << seed;
  }
}

// Chunked prefill splits long prompts so decodes are not stalled behind them: lower p99 ITL at
// the same throughput (within 2%).
TEST(Lesson, ChunkedPrefillLowersTailItlAtEqualThroughput) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("chunked_prefill.toml", seed, {"backend.profile=\"cpu\""});
    const RunSummary* plain = nullptr;
    const RunSummary* chunked = nullptr;
    for (const auto& [label, out] : runs)
      (label.find("chunked") != std::string::npos ? chunked : plain) = &out.summary;
    ASSERT_TRUE(plain && chunked);
    EXPECT_LT(chunked->itl_s.p99, 0.8 * plain->itl_s.p99) << "seed " << seed;
    EXPECT_NEAR(chunked->output_tokens_per_s / plain->output_tokens_per_s, 1.0, 0.02)
        << "seed " << seed;
  }
}

// Shared prompt prefixes computed once: lower TTFT (median and tail).
TEST(Lesson, PrefixCachingLowersTtft) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("prefix_caching.toml", seed, {"backend.profile=\"cpu\""});
    const RunOutput& off = runs.at("kv_cache.params.prefix_caching=false");
    const RunOutput& on = runs.at("kv_cache.params.prefix_caching=true");
    EXPECT_GT(on.prefix_hit_rate, 0.3) << "seed " << seed;
    EXPECT_LT(on.summary.ttft_s.p50, 0.8 * off.summary.ttft_s.p50) << "seed " << seed;
    EXPECT_LT(on.summary.ttft_s.p99, off.summary.ttft_s.p99) << "seed " << seed;
  }
}

// Long sequences in paged blocks of 16: the only waste is each sequence's unfilled last block,
// a few percent of what sequences hold; static reservation wastes most of it.
TEST(Lesson, PagedWasteAmongHeldSlotsIsSmallOnLongSequences) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points(
        "allocator_waste.toml", seed,
        {"model.name=\"llama2-7b\"", "backend.profile=\"h100-sxm\"", "kv_cache.slots=65536",
         "workload.prompt_tokens={dist=\"uniform\", min=512, max=1024}",
         "workload.output_tokens={dist=\"uniform\", min=128, max=512}"},
        [](ExperimentConfig& c) {  // static reserves the model's whole 4,096 context
          if (c.allocator == "static") c.allocator_params.clear();
        });
    for (const auto& [label, out] : runs) {
      if (label.find("paged") != std::string::npos) {
        EXPECT_LT(out.kv_waste_of_held, 0.04) << label << " seed " << seed;
      }
      if (label.find("static") != std::string::npos) {
        EXPECT_GT(out.kv_waste_of_held, 0.5) << label << " seed " << seed;
      }
    }
  }
}

// The waste columns by their definitions, recomputed from the steps: waste/held over the slots
// sequences hold; waste/pool adds free holes only on steps where a refused request would have
// fitted in the free slots in all (dynamic's growing extents fragment the pool). Every request
// arrives at once, so the pool is under pressure whatever the profile prices a step at (the
// file's Poisson rate suits one profile: at its old 60 req/s, a CPU profile fitted to faster
// kernels served the requests before dynamic's holes ever blocked an admission, and the test had
// nothing to check).
TEST(Lesson, WasteCountsHolesOnlyWhenTheyBlockAnAdmission) {
  auto runs = run_points("allocator_waste.toml", 1,
                         {"backend.profile=\"cpu\"", "workload.arrival=\"all_at_once\""});
  bool blocked = false;
  for (const auto& [label, out] : runs) {
    double held = 0, held_waste = 0, pool_waste = 0;
    for (const StepRecord& s : out.engine.steps) {
      const double waste =
          static_cast<double>(s.kv.reserved_unused + s.kv.last_block_slack + s.padding_slots);
      held += static_cast<double>(s.kv.used + s.kv.reserved_unused + s.kv.last_block_slack);
      held_waste += waste;
      pool_waste += (waste + static_cast<double>(s.blocking_unusable_free)) /
                    static_cast<double>(s.kv.capacity);
      EXPECT_TRUE(s.blocking_unusable_free == 0 || s.blocking_unusable_free == s.kv.unusable_free)
          << label;
      blocked |= s.blocking_unusable_free > 0;
    }
    EXPECT_NEAR(out.kv_waste_of_held, held_waste / held, 1e-12) << label;
    EXPECT_NEAR(out.mean_kv_waste, pool_waste / static_cast<double>(out.engine.steps.size()), 1e-12)
        << label;
  }
  EXPECT_TRUE(blocked) << "dynamic's holes blocked some admission";
}

// Fewer K/V heads read per decoded token: on a memory-bound device (an H100 decoding a 7B model
// at long context) GQA-8 gives a lower TPOT than MHA at the same batch, MQA lower still.
TEST(Lesson, GqaLowersTpotOnAMemoryBoundDevice) {
  for (const std::uint64_t seed : kSeeds) {
    std::map<std::string, double> tpot;
    std::map<std::string, std::int64_t> kv_heads;
    auto runs = run_points(
        "gqa_mqa_memory.toml", seed,
        {"model.name=\"llama2-7b\"", "backend.profile=\"h100-sxm\"", "kv_cache.slots=262144",
         "workload.prompt_tokens={dist=\"uniform\", min=1024, max=2048}",
         "scheduler.params.max_batch=32", "workload.requests=64"},
        [](ExperimentConfig& c) {  // the file's GQA is group 2 on stories15m; here GQA-8
          c.kv_memory_mib.reset();
          if (c.attention == "gqa") c.attention_params = {{"group_size", std::int64_t{4}}};
        });
    for (const auto& [label, out] : runs)
      tpot[label.substr(label.find('=') + 1, 3)] = out.summary.tpot_s.p50;
    ASSERT_EQ(tpot.size(), 3u);
    EXPECT_LT(tpot["gqa"], 0.9 * tpot["mha"]) << "seed " << seed;
    EXPECT_LT(tpot["mqa"], tpot["gqa"]) << "seed " << seed;
  }
}

// Swap or recompute a preempted sequence? Swapping n tokens costs two copies of n x (K/V bytes
// per token) over the link; recomputing costs n prefill tokens. The profile puts the crossover
// at link = 2 x bytes per token / prefill seconds per token: a link 4x slower than that makes
// recompute the faster policy, 4x faster makes swap faster (preemption.toml, fcfs).
TEST(Lesson, SwapOrRecomputeCrossesOverWhereTheLinkMeetsThePrefill) {
  HardwareProfile profile = load_hardware_profile("cpu");
  const CostModel cost(model_preset("stories15m"), profile);
  const std::vector<EntryShape> long_prefill{{65, 0, 0}}, one_token{{1, 0, 0}};
  const double prefill_s_per_token =
      (cost.step(long_prefill).total() - cost.step(one_token).total()) / 64;
  const double crossover_gb_per_s =
      2.0 * static_cast<double>(cost.kv_bytes_per_token()) / prefill_s_per_token / 1e9;
  RecordProperty("crossover_gb_per_s", std::to_string(crossover_gb_per_s));
  test::TempDir dir;
  for (const double factor : {0.25, 4.0}) {
    profile.swap_gb_per_s = crossover_gb_per_s * factor;
    profile.swap_latency_s = 0;
    const auto file = dir.path() / "link.toml";
    std::ofstream(file, std::ios::trunc) << hardware_profile_to_toml(profile);
    for (const std::uint64_t seed : kSeeds) {
      auto runs =
          run_points("preemption.toml", seed, {"backend.profile=\"" + file.string() + "\""});
      const RunSummary* recompute = nullptr;
      const RunSummary* swap = nullptr;
      for (const auto& [label, out] : runs)
        if (label.find("fcfs") != std::string::npos)
          (label.find("swap") != std::string::npos ? swap : recompute) = &out.summary;
      ASSERT_TRUE(recompute && swap);
      ASSERT_GT(swap->swapped_bytes, 0);
      if (factor < 1) {
        EXPECT_LT(swap->output_tokens_per_s, recompute->output_tokens_per_s)
            << "link " << profile.swap_gb_per_s << " GB/s, seed " << seed;
      } else {
        EXPECT_GT(swap->output_tokens_per_s, recompute->output_tokens_per_s)
            << "link " << profile.swap_gb_per_s << " GB/s, seed " << seed;
      }
    }
  }
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// Cache-aware routing (SGLang's router, Preble): on 4 replicas whose prefix caches cannot each
// hold all 16 system prompts, sending a prefix where it went before raises the cluster's hit
// rate and cuts TTFT against round robin, which makes every replica compute every prefix.
TEST(Lesson, PrefixAffinityRoutingRaisesHitsAndLowersTtft) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("cluster_prefix_routing.toml", seed, {"workload.requests=1000"});
    const RunOutput& rr = runs.at("cluster.router=round_robin");
    const RunOutput& affinity = runs.at("cluster.router=prefix_affinity");
    EXPECT_EQ(affinity.summary.finished, 1000) << "seed " << seed;
    EXPECT_GE(affinity.prefix_hit_rate, rr.prefix_hit_rate + 0.2) << "seed " << seed;
    EXPECT_LT(affinity.summary.ttft_s.p50, 0.5 * rr.summary.ttft_s.p50) << "seed " << seed;
    EXPECT_LT(affinity.summary.ttft_s.p99, rr.summary.ttft_s.p99) << "seed " << seed;
    ASSERT_EQ(affinity.replicas.size(), 4u);
    std::int64_t served = 0;
    for (const auto& r : affinity.replicas) served += r.requests;
    EXPECT_EQ(served, 1000);
  }
}

// The Mooncake conversation trace (issue 36's first lesson, its half without tiers), in three
// 10-minute windows, lengths a quarter (512-token blocks become 128, eight of kvlab's 16-token
// pages) and the clock a quarter as fast, on one simulated H200: with a pool that keeps every
// block the prefix hit rate is the trace's ideal (an infinite cache of whole blocks), within
// half a point (pages can also match the start of a partial block that recurs); with a quarter
// of the pool an H200 holds next to Llama-3.1-8B (204,800 tokens, for quarter lengths) it keeps
// under a third of it, and TTFT p50 is higher. The gap is what a host tier is for.
TEST(Lesson, MooncakePrefixHitsReachTheIdealOnlyWithRoomForEveryBlock) {
  for (const int start_s : {0, 1200, 2400}) {
    auto run = [&](std::int64_t slots) {
      return run_points("mooncake_replay.toml", 1,
                        {fmt::format("workload.replay.start_s={}", start_s),
                         "workload.replay.duration_s=600", "workload.replay.length_scale=0.25",
                         "workload.replay.rate_scale=0.25", "cluster.replicas=1",
                         fmt::format("kv_cache.slots={}", slots)})
          .at("");
    };
    const RunOutput unbounded = run(30'000'000), bounded = run(204'800);
    ASSERT_TRUE(unbounded.ideal_prefix_hit_rate.has_value());
    const double ideal = *unbounded.ideal_prefix_hit_rate;
    EXPECT_GT(ideal, 0.2) << "window at " << start_s << " s";
    EXPECT_NEAR(unbounded.prefix_hit_rate, ideal, 0.005) << "window at " << start_s << " s";
    EXPECT_LT(bounded.prefix_hit_rate, ideal / 3) << "window at " << start_s << " s";
    EXPECT_GT(bounded.summary.ttft_s.p50, unbounded.summary.ttft_s.p50)
        << "window at " << start_s << " s";
    EXPECT_EQ(unbounded.summary.finished, unbounded.summary.submitted);
  }
}

// KV tiers (experiments/mooncake_tiers.toml): one H200 whose pool keeps a fraction of what the
// Mooncake conversation trace reuses. Host memory below it brings the hit rate towards the
// trace's ideal, all the way with 400 GiB, and lowers TTFT p50 (PCIe loads beat recomputing the
// prefix). A 5 GB/s NVMe disk below 25 GiB of host memory also reaches the ideal, but loading a
// block from it takes longer than an H200 takes to compute it: TTFT p50 rises above no tiers.
TEST(Lesson, AHostTierBringsMooncakePrefixHitsToTheIdealAndASlowDiskCostsTtft) {
  for (const int start_s : {0, 1200, 2400}) {
    auto runs =
        run_points("mooncake_tiers.toml", 1, {fmt::format("workload.replay.start_s={}", start_s)});
    const RunOutput& none = runs.at("kv_tiers.host_gib=0.0, kv_tiers.disk_gib=0.0");
    const RunOutput& host_100 = runs.at("kv_tiers.host_gib=100.0, kv_tiers.disk_gib=0.0");
    const RunOutput& host_400 = runs.at("kv_tiers.host_gib=400.0, kv_tiers.disk_gib=0.0");
    const RunOutput& disk = runs.at("kv_tiers.host_gib=25.0, kv_tiers.disk_gib=2048.0");
    ASSERT_TRUE(none.ideal_prefix_hit_rate.has_value());
    const double ideal = *none.ideal_prefix_hit_rate;
    const std::string window = fmt::format("window at {} s", start_s);
    EXPECT_LT(none.prefix_hit_rate, ideal / 3) << window;
    EXPECT_GT(host_100.prefix_hit_rate, none.prefix_hit_rate + 0.05) << window;
    EXPECT_GT(host_400.prefix_hit_rate, ideal - 0.015) << window;
    EXPECT_LE(host_400.prefix_hit_rate, ideal + 1e-9) << window;
    ASSERT_TRUE(host_400.kv_tiers.has_value());
    EXPECT_GT(host_400.kv_tiers->host_hit_rate, 0.15) << window;
    EXPECT_LT(host_400.summary.ttft_s.p50, 0.9 * none.summary.ttft_s.p50) << window;
    EXPECT_GT(disk.prefix_hit_rate, ideal - 0.005) << window;
    EXPECT_GT(disk.kv_tiers->disk_hit_rate, 0.1) << window;
    EXPECT_GT(disk.summary.ttft_s.p50, none.summary.ttft_s.p50) << window;
    for (const auto& [label, run] : runs)
      EXPECT_EQ(run.summary.finished, run.summary.submitted) << label << ", " << window;
  }
}

// DistServe's claim (experiments/disaggregation.toml: Llama-2-7B on four simulated A100s, long
// prompts, short answers). The figure of merit is DistServe's: the highest arrival rate per GPU
// at which 90% of requests meet the SLO. Under a tight TPOT SLO (25 ms) colocated replicas fail
// it early, since every prefill stalls the decodes batched with it; splitting the same GPUs into
// 2 prefill + 2 decode serves 1.4x the rate per GPU or more (1.8x and 1.5x on seeds 1 and 2, at
// this grid of rates), and 2:2 is the best split (1:3 starves
// prefill, 3:1 overloads decode). Under a loose TPOT SLO (200 ms) no split beats colocation.
TEST(Lesson, DisaggregationServesMorePerGpuOnlyUnderATightTpotSlo) {
  const double rates[] = {8, 10, 12, 14, 16, 18, 20, 22, 24, 28};
  for (const std::uint64_t seed : {1, 2}) {
    // best[slo][prefill replicas]: the highest rate per GPU with >= 90% attainment.
    double best[2][4] = {};
    for (const double rate : rates) {
      auto runs = run_points("disaggregation.toml", seed, {fmt::format("workload.rate={}", rate)});
      for (int p = 0; p < 4; ++p) {
        const RunOutput& out = runs.at(fmt::format("cluster.prefill_replicas={}", p));
        for (int slo = 0; slo < 2; ++slo) {
          const ServiceLevelObjectives objectives{2.0, slo == 0 ? 0.025 : 0.2, std::nullopt};
          const RunSummary s =
              summarize_run(out.engine.requests, out.engine.duration_s, objectives);
          if (static_cast<double>(s.slo_met) >= 0.9 * static_cast<double>(s.submitted))
            best[slo][p] = std::max(best[slo][p], rate / 4);
        }
      }
    }
    const std::string at = fmt::format("seed {}: colocated {} / 1:3 {} / 2:2 {} / 3:1 {} req/s/GPU",
                                       seed, best[0][0], best[0][1], best[0][2], best[0][3]);
    std::cout << "disaggregation lesson, tight TPOT: " << at << "; loose TPOT: colocated "
              << best[1][0] << " / 1:3 " << best[1][1] << " / 2:2 " << best[1][2] << " / 3:1 "
              << best[1][3] << "\n";
    EXPECT_GE(best[0][2], 1.4 * best[0][0]) << "tight TPOT, " << at;
    EXPECT_GT(best[0][2], best[0][1]) << "tight TPOT, " << at;
    EXPECT_GT(best[0][2], best[0][3]) << "tight TPOT, " << at;
    for (int p = 1; p < 4; ++p)
      EXPECT_GE(best[1][0], best[1][p])
          << "loose TPOT, seed " << seed << ": colocated " << best[1][0] << ", " << p << " prefill";
    EXPECT_GT(best[1][0], best[0][0]) << "seed " << seed;  // the loose SLO admits more
  }
}

// Speculative decoding against the batch (experiments/speculation_vs_batch.toml): a drafter
// right 75% of the time verifying 4 tokens per decode multiplies a simulated H200's throughput
// at batch 1, the gain shrinks as the batch grows (verification turns memory-bound decode into
// compute), breaks even by batch 256 and turns into a loss at 2048; an adaptive proposal length
// keeps within 3% of the better of the two at every batch, whether each length's step is priced
// by the profile or by the times of the steps already run (no profile: what a real model on a
// machine of its own gets). At 2048 both beat fixed (one proposal still breaks even there). A
// draft model priced by its size (Llama 3.2 1B: 4 draft decode steps before each verify, each
// paying its kernels' floors) gains less and turns into a loss at a smaller batch; an adaptive
// length recovers it too.
//
// The adaptive lengths are held to the mean over the seeds: at batch 1 one request's ~40
// verifies decide the run, and with the draft 2, 3 and 4 proposals are within a percent of each
// other in expectation (the draft's steps cost what the extra tokens gain), so one seed's fixed
// length lands up to 3% either side of its mean (fixed 4 on seeds 1-6: 268-287 tokens/s).
TEST(Lesson, SpeculationsGainShrinksWithTheBatchAndAnAdaptiveLengthKeepsTheBetter) {
  const char* plain = "speculation={ tokens = 0 }";
  const char* fixed = "speculation={ acceptance_rate = 0.75, proposer = 'simulated', tokens = 4 }";
  const char* adaptive =
      "speculation={ acceptance_rate = 0.75, adaptive = true, proposer = 'simulated', tokens = 4 }";
  const char* measured =
      "speculation={ acceptance_rate = 0.75, adaptive = 'measured', proposer = 'simulated', "
      "tokens = 4 }";
  const char* drafted =
      "speculation={ acceptance_rate = 0.75, draft_model = 'llama3.2-1b', proposer = 'simulated', "
      "tokens = 4 }";
  const char* drafted_adaptive =
      "speculation={ acceptance_rate = 0.75, adaptive = true, draft_model = 'llama3.2-1b', "
      "proposer = 'simulated', tokens = 4 }";
  const int batches[] = {1, 16, 64, 256, 2048};
  constexpr std::size_t kBatches = std::size(batches);
  // Per batch, summed over the seeds: fixed, adaptive, by times, draft, draft adaptive (/ plain).
  std::array<std::array<double, 5>, kBatches> sums{};
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("speculation_vs_batch.toml", seed);
    const auto throughput = [&](int batch, const char* speculation) {
      return runs.at(fmt::format("workload.requests={}, {}", batch, speculation))
          .summary.output_tokens_per_s;
    };
    double previous_gain = 1e9;
    std::string table;
    for (std::size_t i = 0; i < kBatches; ++i) {
      const int batch = batches[i];
      const double base = throughput(batch, plain);
      const std::array<double, 5> ratios = {
          throughput(batch, fixed) / base, throughput(batch, adaptive) / base,
          throughput(batch, measured) / base, throughput(batch, drafted) / base,
          throughput(batch, drafted_adaptive) / base};
      for (std::size_t r = 0; r < ratios.size(); ++r) sums[i][r] += ratios[r];
      const double gain = ratios[0], draft = ratios[3];
      table += fmt::format(
          " batch {}: 4 proposals {:.2f}x, adaptive {:.2f}x, by times {:.2f}x, 1B draft {:.2f}x, "
          "adaptive {:.2f}x;",
          batch, gain, ratios[1], ratios[2], draft, ratios[4]);
      EXPECT_LT(draft, gain) << "the draft's steps cost: seed " << seed << ", batch " << batch;
      EXPECT_LT(gain, previous_gain) << "seed " << seed << ", batch " << batch;
      previous_gain = gain;
    }
    // The measured trace replayed: its verifies accept 2.17 on average (2,320 in 1,067 verifies
    // in data/speculation/smollm2_grounded_edits_verifies.csv); the replay's, pooled over the
    // batches (95,806 verifies on seed 3: batch 1's 42 alone would be too few for an all-or-nothing
    // trace, whose verifies vary by about 1.9), within 5%.
    const char* traced =
        "speculation={ accept_trace = '../data/speculation/smollm2_grounded_edits_verifies.csv', "
        "proposer = 'simulated', tokens = 4 }";
    std::int64_t verifies = 0, accepted = 0;
    for (const int batch : batches)
      for (const StepRecord& step :
           runs.at(fmt::format("workload.requests={}, {}", batch, traced)).engine.steps) {
        verifies += step.verify_entries;
        accepted += step.accepted_tokens;
      }
    EXPECT_NEAR(static_cast<double>(accepted) / static_cast<double>(verifies), 2.17, 0.11)
        << "seed " << seed << ", " << verifies << " verifies";
    table += fmt::format(" measured trace at batch 1: {:.2f}x;",
                         throughput(1, traced) / throughput(1, plain));
    std::cout << "speculation lesson, seed " << seed << ":" << table << "\n";
    EXPECT_GE(throughput(1, fixed), 2.0 * throughput(1, plain)) << "seed " << seed << table;
    EXPECT_LT(throughput(2048, fixed), throughput(2048, plain)) << "seed " << seed << table;
    // The free drafter breaks even at 256 (within 3%), where the 1B draft's own steps (Llama 3.2
    // 1B for Llama 3.1 8B, the same 75%) already cost a tenth of the throughput; the draft still
    // gains 1.4x at batch 1.
    EXPECT_GT(throughput(256, fixed), 0.97 * throughput(256, plain)) << "seed " << seed << table;
    EXPECT_LT(throughput(256, drafted), 0.9 * throughput(256, fixed)) << "seed " << seed << table;
    EXPECT_GE(throughput(1, drafted), 1.4 * throughput(1, plain)) << "seed " << seed << table;
  }
  const double seeds = static_cast<double>(std::size(kSeeds));
  for (std::size_t i = 0; i < kBatches; ++i) {
    const auto mean = [&](std::size_t r) { return sums[i][r] / seeds; };
    const std::string at = fmt::format("batch {}, mean over the seeds", batches[i]);
    EXPECT_GE(mean(1), 0.97 * std::max(1.0, mean(0))) << at;  // priced adaptive vs fixed
    EXPECT_GE(mean(2), 0.97 * std::max(1.0, mean(0))) << at;  // by times
    EXPECT_GE(mean(4), 0.97 * std::max(1.0, mean(3))) << at;  // the draft's adaptive
  }
}

// The DistServe simulator's published example (experiments/distserve_opt13b.toml): OPT-13B on
// 4 x A100-80GB, 300 ShareGPT-like requests, P90 TTFT <= 200 ms and P90 TPOT <= 100 ms. Its
// figure: the highest arrival rate per GPU meeting both, by binary search to within 0.25
// req/s/GPU (its README's settings); DistServe's simulator reports 1.56, disaggregated (prefill
// TP 2, decode TP 1). kvlab searches every way to split the 4 GPUs (every replica one GPU:
// colocated, P:D 1:3, 2:2, 3:1; two: colocated, 1:1; and DistServe's own shape, one prefill
// replica of TP 2 beside two decode replicas of TP 1). Its roofline A100 is far faster than
// DistServe's profiled engine (docs/concepts/disaggregation.md), so its figure is far higher;
// and at a TPOT SLO this loose for its step times, colocation is not beaten, as in the lesson
// above.
struct GpuSplit {
  std::int64_t prefill_replicas, prefill_tp, decode_tp;  // a colocated split: prefill_replicas 0
  std::int64_t replicas() const {
    const std::int64_t decode_gpus = 4 - prefill_replicas * prefill_tp;
    return prefill_replicas + decode_gpus / decode_tp;
  }
};
double distserve_rate_per_gpu(ExperimentConfig c, const GpuSplit& split) {
  c.tensor_parallel = split.decode_tp;
  c.replicas = split.replicas();
  c.prefill_replicas = split.prefill_replicas;
  if (split.prefill_replicas > 0) {
    c.prefill_tensor_parallel = split.prefill_tp;
    c.decode_tensor_parallel = split.decode_tp;
  }
  EXPECT_EQ(c.gpus(), 4);
  auto meets = [&](double per_gpu) {
    c.workload.arrival.rate_per_s = per_gpu * 4;
    const RunOutput out = run_experiment(c, false, nullptr);
    return out.summary.rejected == 0 && out.summary.ttft_s.p90 <= 0.2 &&
           out.summary.tpot_s.p90 <= 0.1;
  };
  double lo = 0, hi = 64;
  while (hi - lo >= 0.25) (meets((lo + hi) / 2) ? lo : hi) = (lo + hi) / 2;
  return lo;
}

TEST(Lesson, DistServeOpt13bExampleReplayed) {
  auto runs =
      load_experiment(experiment_file("distserve_opt13b.toml"),
                      {std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]"});
  const ExperimentConfig base = runs.front().config;  // colocated
  const double colocated = distserve_rate_per_gpu(base, {0, 1, 1});
  std::string table = fmt::format("colocated tp1 {:.3f};", colocated);
  const GpuSplit splits[] = {{1, 1, 1}, {2, 1, 1}, {3, 1, 1}, {0, 2, 2}, {1, 2, 2}, {1, 2, 1}};
  for (const GpuSplit& split : splits) {
    const double rate = distserve_rate_per_gpu(base, split);
    table += fmt::format(" {} prefill x tp{}, {} x tp{}: {:.3f};", split.prefill_replicas,
                         split.prefill_tp, split.replicas() - split.prefill_replicas,
                         split.decode_tp, rate);
    EXPECT_GE(colocated, rate) << table;
  }
  std::cout << "DistServe example: kvlab " << table << " (DistServe's simulator: 1.56)\n";
  EXPECT_GT(colocated, 1.56 * 4) << table;
}

// Load-aware routing on the bursty Azure code trace: sending each request to the replica with
// the fewest prompt tokens waiting lowers p99 TTFT against round robin in each of three 20-minute
// windows, by a quarter or more in the burstiest (the first).
TEST(Lesson, LeastLoadedRoutingLowersTailTtftUnderBursts) {
  const double starts[] = {0, 1200, 2400};
  for (const double start : starts) {
    auto runs = run_points("cluster_load_balancing.toml", 1,
                           {fmt::format("workload.azure_trace.start_s={}", start)});
    const RunSummary& rr = runs.at("cluster.router=round_robin, cluster.params={}").summary;
    const RunSummary& least =
        runs.at("cluster.router=least_loaded, cluster.params={ by = 'prefill_tokens' }").summary;
    EXPECT_EQ(least.finished, rr.finished) << "window " << start;
    EXPECT_LT(least.ttft_s.p99, rr.ttft_s.p99) << "window " << start;
    if (start == 0) {
      EXPECT_LT(least.ttft_s.p99, 0.75 * rr.ttft_s.p99);
    }
  }
}

// The tenants of a run: {tenant: its TenantSummary}.
std::map<std::string, TenantSummary> by_tenant(const RunOutput& out) {
  std::map<std::string, TenantSummary> all;
  for (TenantSummary& t : summarize_tenants(out.engine.requests, out.engine.duration_s))
    all.emplace(t.tenant, std::move(t));
  return all;
}

// VTC (Sheng et al., OSDI 2024): a heavy tenant (70% of the requests) and a light one (30%)
// overload a simulated A100 about 2.5x (experiments/tenant_fairness.toml), so both keep
// requests waiting. fcfs serves them in arrival order, and the gap between their service grows
// with the overload: it more than doubles when the run doubles (x2.3 on seeds 1-3; 141k-162k
// tokens at 600 requests). vtc keeps it under a bound that does not grow with the run: one full
// batch's work, 2 x (max prompt + max_batch x max output) = 2 x (768 + 64 x 384) = 50,688
// tokens (3.9k-9.2k measured). The light tenant's median TTFT falls to under half of fcfs's
// (0.34-0.45x): the heavy one can no longer queue it out.
TEST(Lesson, VtcBoundsTheServiceGapThatFcfsLetsGrow) {
  constexpr double kBound = 2.0 * (768 + 64 * 384);
  for (const std::uint64_t seed : kSeeds) {
    double fcfs_gap[2] = {}, vtc_gap[2] = {};
    for (int doubled = 0; doubled < 2; ++doubled) {
      auto runs = run_points("tenant_fairness.toml", seed,
                             {fmt::format("workload.requests={}", doubled ? 1200 : 600)});
      const RunOutput& fcfs = runs.at("scheduler.name=fcfs");
      const RunOutput& vtc = runs.at("scheduler.name=vtc");
      fcfs_gap[doubled] = max_service_gap_tokens(fcfs.engine.requests);
      vtc_gap[doubled] = max_service_gap_tokens(vtc.engine.requests);
      EXPECT_LE(vtc_gap[doubled], kBound) << "seed " << seed << ", doubled " << doubled;
      EXPECT_LE(by_tenant(vtc).at("light").run.ttft_s.p50,
                0.5 * by_tenant(fcfs).at("light").run.ttft_s.p50)
          << "seed " << seed;
      EXPECT_EQ(vtc.summary.finished, fcfs.summary.finished);
    }
    EXPECT_GE(fcfs_gap[0], 2 * kBound) << "seed " << seed;
    EXPECT_GE(fcfs_gap[1], 1.8 * fcfs_gap[0]) << "seed " << seed;
  }
}

// EDF under deadlines (experiments/deadlines.toml): interactive requests (TTFT SLO 1 s) and
// batch ones (30 s), half each, in bursts at about 80% of what a simulated A100 serves. fcfs
// lets an interactive request that lands behind a burst miss; edf admits by deadline. At the
// same load more requests meet their SLO (+4.5 to +6.2 points on seeds 1-3: 91-93% -> 97-98%),
// the interactive tenant's attainment rises by 9-12 points (82-87% -> 95-96%), and the batch
// tenant still meets every deadline.
TEST(Lesson, EdfRaisesSloAttainmentOverFcfsAtTheSameLoad) {
  for (const std::uint64_t seed : kSeeds) {
    auto runs = run_points("deadlines.toml", seed);
    const RunOutput& fcfs = runs.at("scheduler.name=fcfs");
    const RunOutput& edf = runs.at("scheduler.name=edf");
    auto attainment = [](const RunSummary& s) {
      return static_cast<double>(s.slo_met) / static_cast<double>(s.submitted);
    };
    EXPECT_GE(attainment(edf.summary), attainment(fcfs.summary) + 0.03) << "seed " << seed;
    EXPECT_GE(attainment(by_tenant(edf).at("interactive").run),
              attainment(by_tenant(fcfs).at("interactive").run) + 0.06)
        << "seed " << seed;
    EXPECT_GE(attainment(by_tenant(edf).at("batch").run), 0.99) << "seed " << seed;
    EXPECT_EQ(edf.summary.finished, fcfs.summary.finished);
  }
}

// Per-group KV for a local:global model (experiments/hybrid_kv_groups.toml): Gemma 3 27B on an
// H200 at 32K-token sequences. One block table for every layer fits what the memory holds of
// whole sequences, floor(capacity / 32,256) = 4; one table per group of 10 layers keeps the 52
// local layers' KV to their 1,024-token window, and the same bytes run at least 4.5x the
// sequences at once (measured 20: 5x; the ceiling, every local group at its window plus a
// block, is 25; sequences in their prefill hold a 4,096-token chunk more in every local group).
// The same file on the cpu backend (gemma3-tiny: an 8-token window on 5 of 6 layers, 384-token
// prompts and 120 new tokens in 2,048 slots' bytes) runs at least 3x the sequences (measured 19
// against 5), through preemptions, every token the reference's.
TEST(Lesson, PerGroupKvRunsAboutFiveTimesTheGemma3SequencesAtLongContext) {
  auto runs = run_points("hybrid_kv_groups.toml", 7);
  const RunOutput& uniform = runs.at("kv_cache.groups=uniform");
  const RunOutput& grouped = runs.at("kv_cache.groups=per_kind");
  EXPECT_EQ(uniform.max_batch, uniform.kv_slots / (32000 + 256));
  EXPECT_GE(static_cast<double>(grouped.max_batch), 4.5 * static_cast<double>(uniform.max_batch));
  EXPECT_EQ(grouped.kv_slots, uniform.kv_slots);  // the same bytes
  EXPECT_EQ(grouped.summary.finished, 48);
  EXPECT_EQ(uniform.summary.finished, 48);

  auto cpu_runs =
      load_experiment(experiment_file("hybrid_kv_groups.toml"),
                      {std::string("experiment.plugin_paths=[\"") + KVLAB_PLUGIN_DIR + "\"]",
                       "model.name=\"gemma3-tiny\"", "backend.name=\"cpu\"",
                       "backend.profile=\"cpu\"", "backend.threads=1", "kv_cache.slots=2048",
                       "workload.prompt_tokens={dist=\"fixed\",value=384}",
                       "workload.output_tokens={dist=\"fixed\",value=120}", "workload.requests=32",
                       "scheduler.params.max_tokens_per_step=128"});
  std::map<std::string, RunOutput> cpu;
  for (auto& run : cpu_runs) {
    std::vector<std::string> mismatches;
    cpu[run.config.label] = run_experiment(run.config, true, &mismatches);
    EXPECT_TRUE(mismatches.empty()) << run.config.label << ": " << mismatches.front();
    EXPECT_EQ(cpu[run.config.label].summary.finished, 32) << run.config.label;
  }
  EXPECT_GE(static_cast<double>(cpu.at("kv_cache.groups=per_kind").max_batch),
            3.0 * static_cast<double>(cpu.at("kv_cache.groups=uniform").max_batch));
}

// MHA, GQA-8 and MLA at one model size (experiments/latent_attention.toml): Llama 2 7B's body on
// an H200, bf16. A token's KV: 2 x 32 layers x 32 heads x 128 x 2 B = 512 KiB (MHA), a quarter
// with GQA-8, and 32 x (512 + 64) x 2 B = 36 KiB with DeepSeek-V2's latent (1/14 of MHA, 1/3.6 of
// GQA-8). The planner fits 57, 230 and 819 requests of 4,000 tokens; the run of 1,024 such
// requests ran 75, 301 and 1,021 at once (>= 3.5x a step each) and made 1,488, 4,408 and 6,712
// tokens/s. Where MLA's extra compute shows: its absorbed decode does 2 x heads x (576 + 512)
// FLOPs a key against 4 x heads x 128 for MHA (4.25x) on 1/14 the bytes. With Llama 2's 32 heads
// that is 60 FLOPs a byte: decode attention stays memory-bound and takes less than half of
// GQA-8's time; with DeepSeek-V3's 128 heads on one GPU (data-parallel attention) it is 242 FLOPs a
// byte, past the H200's ridge: compute-bound, the step time then set by the FLOPs.
TEST(Lesson, LatentAttentionHoldsAboutThreeTimesGqa8sBatchAndPaysInFlops) {
  const HardwareProfile h200 = load_hardware_profile("h200");
  MemoryPlanQuery q;
  q.prompt_tokens = 3000;
  q.output_tokens = 1000;
  const ModelConfig mha = model_preset("llama2-7b"), mla = model_preset("llama2-7b-mla");
  ModelConfig gqa = mha;
  gqa.num_key_value_heads = 8;
  const MemoryPlan p_mha = plan_memory(mha, h200, q), p_gqa = plan_memory(gqa, h200, q),
                   p_mla = plan_memory(mla, h200, q);
  EXPECT_EQ(p_mha.kv_bytes_per_token, 512 * 1024);
  EXPECT_EQ(p_gqa.kv_bytes_per_token, 128 * 1024);
  EXPECT_EQ(p_mla.kv_bytes_per_token, 32 * 576 * 2);
  EXPECT_GE(p_mla.max_paged_requests, 3 * p_gqa.max_paged_requests);
  EXPECT_GE(p_gqa.max_paged_requests, 4 * p_mha.max_paged_requests - 4);

  auto runs = run_points("latent_attention.toml", 11);
  const RunOutput& r_mha =
      runs.at("model.name=llama2-7b, attention.variant=mha, attention.params={}");
  const RunOutput& r_gqa =
      runs.at("model.name=llama2-7b, attention.variant=gqa, attention.params={ group_size = 4 }");
  const RunOutput& r_mla =
      runs.at("model.name=llama2-7b-mla, attention.variant=mha, attention.params={}");
  for (const RunOutput* r : {&r_mha, &r_gqa, &r_mla}) EXPECT_EQ(r->summary.finished, 1024);
  EXPECT_GE(static_cast<double>(r_gqa.max_batch), 3.5 * static_cast<double>(r_mha.max_batch));
  EXPECT_GE(static_cast<double>(r_mla.max_batch), 3.0 * static_cast<double>(r_gqa.max_batch));
  EXPECT_GT(r_mla.summary.output_tokens_per_s, 1.3 * r_gqa.summary.output_tokens_per_s);
  EXPECT_GT(r_gqa.summary.output_tokens_per_s, 2.0 * r_mha.summary.output_tokens_per_s);

  // 256 decodes at 4,000 keys: the decode attention operator of each.
  const std::vector<EntryShape> decodes(256, EntryShape{1, 3999, 0, 1});
  const auto attention = [&](const ModelConfig& m) {
    const StepBreakdown b = CostModel(m, h200).breakdown(decodes);
    for (const OperatorCost& op : b.operators)
      if (op.name == "attention_decode") return op;
    return OperatorCost{};
  };
  const OperatorCost a_gqa = attention(gqa), a_mla = attention(mla);
  EXPECT_EQ(a_mla.bound, "memory");
  EXPECT_DOUBLE_EQ(a_mla.work.flops / a_gqa.work.flops, 4.25);  // GQA-8 does MHA's FLOPs
  EXPECT_LT(a_mla.seconds, 0.5 * a_gqa.seconds);
  const OperatorCost a_v3 = attention(model_preset("deepseek-v3"));
  EXPECT_EQ(a_v3.bound, "compute") << "128 heads over one latent: past the ridge";
  EXPECT_GT(a_v3.work.flops / a_v3.work.bytes, 200);  // 242 on the latent; its queries' bytes too
}

}  // namespace
}  // namespace kvlab
