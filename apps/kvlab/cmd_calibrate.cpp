// kvlab calibrate: measure a real backend over a grid of batch shapes and fit a hardware
// profile (efficiencies and overheads) so the simulated backend predicts it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>

#include "cli_common.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/machine_peak.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/calibration.hpp"
#include "kvlab/sim/swap_link.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab::cli {
namespace {

struct CalibrateOptions {
  std::string backend = "cpu";
  std::string model = "stories15m";
  std::string out;
  std::string name;
  int threads = 2;
  int repeats = 7;
  std::string profile;         // cuda: the datasheet peaks to start from (h200, a100-80gb, ...)
  std::string dtype = "bf16";  // cuda: weights, activations and KV
  // cpu: requests of the engine replay whose measured steps join the fit (0: the grid only);
  // unset: 192 on the cpu backend, 0 on cuda (the replay runs the cpu backend only).
  std::optional<std::int64_t> engine_requests;
  std::int64_t replay_requests() const {
    return engine_requests.value_or(backend == "cpu" ? 192 : 0);
  }
};

// One grid point: sequences of `new_tokens` each after `context` cached tokens.
struct Shape {
  std::string label;
  std::vector<EntryShape> entries;
};

// The GPU-sized shapes (calibration_grid): `add(label, entries)`, `repeat(count, entry)`.
template <typename Add, typename Repeat>
void add_gpu_shapes(std::int64_t max_context, Add& add, Repeat& repeat) {
  for (std::int64_t n : {1024, 2048}) add(fmt::format("prefill 1 x {}", n), {{n, 0, 0}});
  add("prefill 4 x 512", repeat(4, {512, 0, 0}));
  std::vector<std::int64_t> contexts{128, 511, std::min<std::int64_t>(max_context - 1, 1023)};
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  for (std::int64_t context : contexts)
    for (std::int64_t batch : {64, 128, 256})
      add(fmt::format("decode {} x ctx {}", batch, context), repeat(batch, {1, context, 0}));
  for (std::int64_t batch : {128, 240}) {
    auto entries = repeat(batch, {1, 511, 0});
    entries.push_back({512, 0, 0});
    add(fmt::format("mixed {} decodes ctx 511 + prefill 512", batch), entries);
  }
}

// `gpu`: also the batches a GPU serves (decodes of 64-256 sequences, prefills of 1-2k tokens,
// 128-240 decodes beside a prompt), too slow to time on a CPU.
std::vector<Shape> calibration_grid(std::int64_t max_context, bool gpu) {
  std::vector<Shape> grid;
  auto add = [&](std::string label, std::vector<EntryShape> entries) {
    for (const auto& e : entries)
      if (e.start_position + e.new_tokens > max_context) return;
    grid.push_back({std::move(label), std::move(entries)});
  };
  auto repeat = [](std::int64_t count, EntryShape e) {
    return std::vector<EntryShape>(static_cast<std::size_t>(count), e);
  };
  for (std::int64_t n : {8, 16, 32, 64, 128, 256, 512})
    add(fmt::format("prefill 1 x {}", n), {{n, 0, 0}});
  for (std::int64_t n : {16, 64}) add(fmt::format("prefill 4 x {}", n), repeat(4, {n, 0, 0}));
  const std::int64_t long_context = std::min<std::int64_t>(max_context - 1, 1023);
  for (std::int64_t context : {std::int64_t{32}, std::int64_t{128}, long_context})
    for (std::int64_t batch : {1, 2, 4, 8, 16, 32})
      add(fmt::format("decode {} x ctx {}", batch, context), repeat(batch, {1, context, 0}));
  for (std::int64_t batch : {4, 16})
    for (std::int64_t n : {32, 96}) {
      auto entries = repeat(batch, {1, 128, 0});
      entries.push_back({n, 0, 0});
      add(fmt::format("mixed {} decodes ctx 128 + prefill {}", batch, n), entries);
    }
  for (std::int64_t n : {32, 64})  // chunked prefill: a later chunk of a long prompt
    add(fmt::format("prefill chunk {} after 128", n), {{n, 128, 0}});
  if (gpu) add_gpu_shapes(max_context, add, repeat);
  return grid;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// This machine's measured peaks (FMA, DRAM read) to fit the CPU backend against.
HardwareProfile cpu_start_profile(const CalibrateOptions& o, const ModelConfig& model) {
  fmt::print(stderr, "measuring this machine's peaks ({} threads)...\n", o.threads);
  HardwareProfile start;
  start.name = o.name.empty() ? fmt::format("cpu-{}-{}t", model.name, o.threads) : o.name;
  start.peak_tflops = cpu::measured_fp32_peak_gflops(o.threads) / 1e3;
  start.memory_gb_per_s = cpu::measured_read_bandwidth_gbs(o.threads);
  start.memory_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                     static_cast<double>(sysconf(_SC_PAGE_SIZE)) / (1024.0 * 1024.0 * 1024.0);
  start.compute_dtype = DType::dtype_f32;
  start.kv_dtype = DType::dtype_f32;
  start.memory_utilization = 1.0;
  start.activation_reserve_gib = 0;
  // One pair of efficiencies per kernel the backend switches to (calibrate runs f32 weights).
  const Efficiency& e = start.efficiency;
  for (const std::int64_t rows : cpu::gemm_kernel_switch_rows(cpu::WeightFormat::f32))
    start.gemm_regimes.push_back({rows, e.gemm_compute, e.gemm_memory});
  start.decode_attention_regimes.push_back(
      {cpu::CpuBackend::whole_entry_attention_sequences(o.threads), e.attention_compute,
       e.attention_memory});
  return start;
}

// The fit keeps the FMA peak as a ceiling, so a probe that ran while a shared VM's vCPU was
// taken (it read 113 GFLOP/s once, 200-215 around it) would cap every product at half speed:
// probe again after the measurements, a few seconds later, and keep the larger.
void recheck_fma_peak(int threads, HardwareProfile& start) {
  const double before = start.peak_tflops * 1e3, after = cpu::probe_fp32_peak_gflops(threads);
  fmt::print(stderr, "FMA probe: {:.1f} GFLOP/s before the measurements, {:.1f} after\n", before,
             after);
  start.peak_tflops = std::max(before, after) / 1e3;
}

// The [link]: the engine's own swap copy timed on `pool` (its host rows on the cpu backend, the
// device's download and upload with a GPU backend attached), so the virtual clock prices a swap
// as the measured clock times one; up to a whole context, the largest swap the engine makes
// (copies beyond the caches run slower: stories15m's 1,024-token copies, 14 MB, took 5-6x the
// line fitted to 1-256 tokens).
void measure_link(KvPool& pool, std::int64_t context, int repeats, HardwareProfile& start) {
  const std::int64_t tokens = std::min<std::int64_t>(context, 1024);
  fmt::print(stderr, "timing the engine's swap copy (out and in, 1-{} tokens)...\n", tokens);
  const SwapLink link = measure_swap_link(pool, tokens, std::max(repeats, 3));
  start.swap_gb_per_s = link.gb_per_s;
  start.swap_latency_s = link.latency_s;
  fmt::print("{:<24} {:>12} {:>12} {:>12}\n", "swap copy", "bytes", "measured us", "fitted us");
  for (const LinkSample& s : link.samples)
    fmt::print("{:<24} {:>12.0f} {:>12.1f} {:>12.1f}\n",
               fmt::format("{} {} tokens", s.to_host ? "out" : "in", s.tokens), s.bytes,
               s.seconds * 1e6, (link.latency_s + s.bytes / (link.gb_per_s * 1e9)) * 1e6);
  fmt::print("\n");
}

void check_options(const CalibrateOptions& o) {
  const bool cuda = o.backend == "cuda";
  if (o.backend != "cpu" && !cuda)
    throw Error(fmt::format("--backend \"{}\": choose cpu or cuda", o.backend));
  if (cuda && o.profile.empty())
    throw Error(
        "--backend cuda: give --profile with the GPU's datasheet peaks to fit against (h200, "
        "h100-sxm, a100-80gb, l4 or a .toml)");
  if (cuda && o.dtype != "f32" && o.dtype != "bf16")
    throw Error(fmt::format("--dtype \"{}\": choose f32 or bf16", o.dtype));
  if (o.threads < 1) throw Error("--threads must be >= 1");
  if (o.repeats < 1) throw Error("--repeats must be >= 1");
  if (o.replay_requests() < 0) throw Error("--engine-requests must be >= 0");
  if (cuda && o.replay_requests() > 0)
    throw Error(
        "--engine-requests: the engine replay runs on the cpu backend only; give "
        "--engine-requests 0 with --backend cuda");
}

struct EngineSteps {
  std::vector<CalibrationSample> samples;
  std::vector<std::string> kinds;  // per sample: decode by batch size, prefill, or mixed
};

// A replay step's kind: decode only, prefill only or both, and which of the start profile's
// gemm regimes its tokens fall in ("prefill + decodes, 5-64 tokens"): each kind weighs the same
// in the fit, so that a kernel seen in few steps is not drowned by the common ones.
std::string step_kind(const StepRecord& step, std::span<const KernelRegime> regimes) {
  const std::string what = step.prefill_tokens == 0  ? "decode only"
                           : step.decode_tokens == 0 ? "prefill only"
                                                     : "prefill + decodes";
  const std::int64_t tokens = step.prefill_tokens + step.decode_tokens;
  std::int64_t low = 1, high = -1;  // the regime's token range; high -1: no upper end
  for (const KernelRegime& r : regimes) {
    if (tokens >= r.min_rows)
      low = r.min_rows;
    else {
      high = r.min_rows - 1;
      break;
    }
  }
  return high < 0 ? fmt::format("{}, {}+ tokens", what, low)
                  : fmt::format("{}, {}-{} tokens", what, low, high);
}

// The replay's heavy arrival rate: half of what the fastest decode batch of the grid could
// serve (decode tokens per second / mean output length): batches of every size, queues at times.
double replay_rate(const std::vector<Shape>& grid, const std::vector<double>& seconds,
                   double mean_output) {
  double tokens_per_s = 0;
  for (std::size_t s = 0; s < grid.size(); ++s) {
    bool decode = true;
    for (const EntryShape& e : grid[s].entries) decode = decode && e.new_tokens == 1;
    if (decode)
      tokens_per_s =
          std::max(tokens_per_s, static_cast<double>(grid[s].entries.size()) / seconds[s]);
  }
  return tokens_per_s > 0 ? 0.5 * tokens_per_s / mean_output : 1.0;
}

// The engine's own steps as samples: a serving workload of its own (its seed, rates and lengths
// are none of experiments/calibration.toml's) on the measured clock, each step's work and
// measured forward time. Consecutive engine steps differ in batch, context and where the KV
// lies, so they do not run like the grid's repeated shapes: fitting both keeps the profile true
// to the steps it will price. Two loads, half the requests each: light (prefills alone or
// beside a few decodes) and heavy (large decode batches with prompts joining).
EngineSteps engine_step_samples(const CalibrateOptions& o, const ModelConfig& model,
                                const HardwareProfile& start, const std::vector<Shape>& grid,
                                const std::vector<double>& seconds) {
  ExperimentConfig c;
  c.name = "calibrate-engine-replay";
  c.clock = EngineClock::measured;
  c.model = o.model;
  c.profile = kDefaultCpuProfile;  // any cpu profile: StepWork depends on the model and dtypes only
  c.threads = o.threads;
  c.cpu_weights = cpu::WeightFormat::f32;  // as the grid's backend multiplies
  c.allocator = "paged";
  c.allocator_params = {{"block_size", ParamValue{std::int64_t{16}}}};
  c.scheduler = "fcfs";
  c.scheduler_params = {{"max_batch", ParamValue{std::int64_t{32}}}};
  // Prompts up to 5/8 of the context, outputs up to a quarter (512 and 128 at most).
  const std::int64_t context = model.max_position_embeddings;
  const std::int64_t max_output = std::clamp<std::int64_t>(context / 4, 1, 128);
  c.workload.prompt_tokens = {.kind = LengthKind::uniform,
                              .min = 1,
                              .max = std::clamp<std::int64_t>(context * 5 / 8, 1, 512)};
  c.workload.output_tokens = {.kind = LengthKind::uniform, .min = 1, .max = max_output};
  c.workload.ignore_eos = true;
  const double heavy = replay_rate(grid, seconds, 0.5 * static_cast<double>(1 + max_output));
  EngineSteps steps;
  for (const double rate : {0.15 * heavy, heavy}) {
    c.seed = rate < heavy ? 7919 : 7920;
    c.workload.requests = std::max<std::int64_t>(1, o.replay_requests() / 2);
    c.workload.arrival = {ArrivalKind::poisson, rate};
    fmt::print(stderr,
               "replaying {} requests on the engine (measured clock, Poisson {:.1f}/s)...\n",
               c.workload.requests, rate);
    const RunOutput run = run_experiment(c, false, nullptr);
    for (const StepRecord& step : run.engine.steps)
      if (step.work.tokens > 0 && step.measured_forward_s > 0) {
        steps.samples.push_back({step.work, step.measured_forward_s});
        steps.kinds.push_back(step_kind(step, start.gemm_regimes));
      }
  }
  return steps;
}

// Every kind of sample weighs the same in the fit, however many of it there are: the grid's
// shapes as one kind, the replay's steps by kind (a light load makes thousands of small decodes
// and a few prefills; both matter to the latencies predicted).
void weigh_by_kind(std::size_t grid_shapes, const EngineSteps& engine,
                   std::vector<CalibrationSample>& samples) {
  std::map<std::string, std::size_t> counts;
  for (const std::string& kind : engine.kinds) ++counts[kind];
  const double kinds = static_cast<double>(counts.size() + 1);
  const double total = static_cast<double>(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const std::size_t count = i < grid_shapes ? grid_shapes : counts[engine.kinds[i - grid_shapes]];
    samples[i].weight = total / (kinds * static_cast<double>(count));
  }
}

// Every grid shape's batch with random tokens, each sequence in its own run of slots; `tokens`
// owns what the batches' spans point at.
std::vector<std::vector<BatchEntry>> grid_batches(
    const std::vector<Shape>& grid, std::int64_t vocab,
    std::vector<std::vector<std::vector<std::int32_t>>>& tokens) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(vocab - 1));
  tokens.assign(grid.size(), {});
  std::vector<std::vector<BatchEntry>> batches(grid.size());
  for (std::size_t s = 0; s < grid.size(); ++s) {
    std::int64_t next_slot = 0;
    for (const auto& e : grid[s].entries) {
      tokens[s].emplace_back(static_cast<std::size_t>(e.new_tokens));
      for (auto& t : tokens[s].back()) t = token(rng);
    }
    for (std::size_t i = 0; i < grid[s].entries.size(); ++i) {
      const EntryShape& e = grid[s].entries[i];
      BatchEntry b;
      b.tokens = tokens[s][i];
      b.start_position = e.start_position;
      b.view.extents = {{next_slot, e.start_position + e.new_tokens}};
      next_slot += e.start_position + e.new_tokens;
      batches[s].push_back(b);
    }
  }
  return batches;
}

// The median forward time of each batch over `repeats` rounds across all batches, so that the
// machine's drift (frequency, other load) spreads over every shape instead of biasing a few.
// Each timed run follows an untimed run of the same shape: an engine's consecutive steps are
// alike, so its caches are as warm as that (timing cold shapes overestimated steps by ~15%).
// Greedy choices are offered before each forward, as the engine offers them: a GPU picks the
// tokens on the device and downloads one id per sequence, not a (sequences x vocab) row of
// logits per step (32 MB at 256 x 32k, ~1 ms over PCIe: most of a decode step's roofline).
std::vector<double> median_forward_seconds(Backend& backend,
                                           const std::vector<std::vector<BatchEntry>>& batches,
                                           int repeats) {
  std::vector<std::vector<double>> times(batches.size());
  std::size_t largest = 0;
  for (const auto& batch : batches) largest = std::max(largest, batch.size());
  const std::vector<TokenChoice> greedy(largest);  // made once, outside the timed forwards
  const auto forward = [&](const std::vector<BatchEntry>& batch) {
    (void)backend.forward(batch, std::span(greedy).first(batch.size()));
  };
  for (int round = 0; round < repeats; ++round)
    for (std::size_t s = 0; s < batches.size(); ++s) {
      forward(batches[s]);
      const auto t0 = std::chrono::steady_clock::now();
      forward(batches[s]);
      times[s].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<double> medians;
  for (auto& t : times) medians.push_back(median(std::move(t)));
  return medians;
}

// Mean and p90 of |relative error| over samples [first, last).
std::pair<double, double> error_summary(const HardwareProfile& profile,
                                        std::span<const CalibrationSample> samples) {
  std::vector<double> errors;
  for (const auto& s : samples) errors.push_back(relative_error(profile, s));
  if (errors.empty()) return {0, 0};
  std::sort(errors.begin(), errors.end());
  double sum = 0;
  for (const double e : errors) sum += e;
  const auto p90 = static_cast<std::size_t>(0.9 * static_cast<double>(errors.size() - 1));
  return {sum / static_cast<double>(errors.size()), errors[p90]};
}

// The grid's shapes one per line: measured, the fit's prediction and its error, and the
// measured time over the shape's roofline on the start profile's peaks (roofline_step_cost).
void print_grid_fit(const std::vector<Shape>& grid, std::span<const CalibrationSample> samples,
                    const HardwareProfile& profile, const HardwareProfile& start) {
  fmt::print("{:<40} {:>12} {:>12} {:>8} {:>12} {:>10}\n", "shape", "measured ms", "predicted ms",
             "error", "roofline ms", "x roofline");
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const double measured = samples[i].measured_s;
    const double predicted = step_cost(samples[i].work, profile).total();
    const double roofline = roofline_step_cost(samples[i].work, start).total();
    fmt::print("{:<40} {:>12.3f} {:>12.3f} {:>7.1f}% {:>12.4f} {:>9.2f}x\n", grid[i].label,
               measured * 1e3, predicted * 1e3, 100 * (predicted - measured) / measured,
               roofline * 1e3, measured / roofline);
  }
}

// The decodes of the grid's largest batch against their roofline (issue 15 aims at 1.5x for
// 256 sequences on a GPU).
void print_decode_rooflines(const std::vector<Shape>& grid,
                            std::span<const CalibrationSample> samples,
                            const HardwareProfile& start) {
  std::size_t largest = 0;
  const auto decode = [](const Shape& shape) {
    return std::all_of(shape.entries.begin(), shape.entries.end(),
                       [](const EntryShape& e) { return e.new_tokens == 1; });
  };
  for (const Shape& shape : grid)
    if (decode(shape)) largest = std::max(largest, shape.entries.size());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    if (!decode(grid[i]) || grid[i].entries.size() != largest) continue;
    const double roofline = roofline_step_cost(samples[i].work, start).total();
    fmt::print(
        "roofline: {} took {:.3f} ms = {:.2f}x its roofline ({:.3f} ms at {:.4g} TFLOP/s "
        "and {:.4g} GB/s, kernels one after another)\n",
        grid[i].label, samples[i].measured_s * 1e3, samples[i].measured_s / roofline,
        roofline * 1e3, start.peak_tflops, start.memory_gb_per_s);
  }
}

// The engine replay's steps by kind: how many, their median time, the signed and absolute error.
void print_engine_fit(const EngineSteps& steps, const HardwareProfile& profile) {
  std::map<std::string, std::vector<std::size_t>> by_kind;
  for (std::size_t i = 0; i < steps.kinds.size(); ++i) by_kind[steps.kinds[i]].push_back(i);
  fmt::print("\n{:<36} {:>6} {:>18} {:>12} {:>12}\n", "engine steps", "count", "median measured ms",
             "mean error", "mean |error|");
  for (const auto& [kind, indices] : by_kind) {
    std::vector<double> measured;
    double signed_sum = 0, abs_sum = 0;
    for (const std::size_t i : indices) {
      const CalibrationSample& s = steps.samples[i];
      const double error = step_cost(s.work, profile).total() / s.measured_s - 1;
      measured.push_back(s.measured_s);
      signed_sum += error;
      abs_sum += std::abs(error);
    }
    const auto n = static_cast<double>(indices.size());
    fmt::print("{:<36} {:>6} {:>18.3f} {:>11.1f}% {:>11.1f}%\n", kind, indices.size(),
               median(measured) * 1e3, 100 * signed_sum / n, 100 * abs_sum / n);
  }
}

void print_fit(const std::vector<Shape>& grid, const EngineSteps& engine,
               std::span<const CalibrationSample> samples, const CalibrationFit& fit,
               const HardwareProfile& start) {
  const HardwareProfile& profile = fit.profile;
  print_grid_fit(grid, samples, profile, start);
  if (!engine.samples.empty()) print_engine_fit(engine, profile);
  const auto [grid_mean, grid_p90] = error_summary(profile, samples.first(grid.size()));
  fmt::print("\nfit ({} iterations): grid shapes mean |error| {:.1f}%, p90 {:.1f}%", fit.iterations,
             100 * grid_mean, 100 * grid_p90);
  if (!engine.samples.empty()) {
    const auto [mean, p90] = error_summary(profile, engine.samples);
    fmt::print("; {} engine steps mean |error| {:.1f}%, p90 {:.1f}%", engine.samples.size(),
               100 * mean, 100 * p90);
  }
  fmt::print("; max {:.1f}% over all {}\n", 100 * fit.max_abs_rel_error, samples.size());
  const Efficiency& e = profile.efficiency;
  fmt::print(
      "peaks: {:.1f} GFLOP/s, {:.1f} GB/s (started from {:.1f} and {:.1f}); efficiencies: gemm "
      "{:.2f}/{:.2f}, attention {:.2f}/{:.2f}, elementwise {:.2f}; overhead {:.3f} ms/step + "
      "{:.4f} ms/sequence; swap link {:.2f} GB/s + {:.2f} us per copy\n",
      profile.peak_tflops * 1e3, profile.memory_gb_per_s, start.peak_tflops * 1e3,
      start.memory_gb_per_s, e.gemm_compute, e.gemm_memory, e.attention_compute, e.attention_memory,
      e.elementwise_memory, profile.step_overhead_s * 1e3, profile.sequence_overhead_s * 1e3,
      profile.swap_gb_per_s, profile.swap_latency_s * 1e6);
  if (profile.ungraphed_step_s > 0)
    fmt::print("steps that replay no CUDA graph (prefill tokens): {:.3f} ms more\n",
               profile.ungraphed_step_s * 1e3);
  for (const KernelRegime& r : profile.gemm_regimes)
    fmt::print("gemm from {} rows: {:.2f}/{:.2f}\n", r.min_rows, r.compute, r.memory);
  for (const KernelRegime& r : profile.decode_attention_regimes)
    fmt::print("decode attention from {} sequences: {:.2f}/{:.2f}\n", r.min_rows, r.compute,
               r.memory);
  print_decode_rooflines(grid, samples, start);
}

void write_profile(const std::string& out, const HardwareProfile& profile,
                   const CalibrationFit& fit, std::size_t samples) {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  write_profile_file(out,
                     fmt::format("# Written by kvlab calibrate on {}: {}.\n# Fit over {} "
                                 "samples: mean |error| {:.1f}%, max {:.1f}%.\n",
                                 date, profile.description, samples, 100 * fit.mean_abs_rel_error,
                                 100 * fit.max_abs_rel_error),
                     profile);
}

// --vidur's options need --vidur, and --carry-from fits nothing: each refused where it would be
// ignored.
void check_vidur_options(const CLI::App& sub, const VidurCalibration& v) {
  const bool vidur = !v.folder.empty(), carry = !v.carry_from.empty();
  if (vidur && carry) throw Error("--vidur and --carry-from: give one (fit, or carry terms)");
  for (const char* option :
       {"--gpu", "--fit-models", "--attention-model", "--attention-from", "--report"})
    if (!vidur && sub.count(option) > 0)
      throw Error(fmt::format("{} is an option of --vidur", option));
  if (vidur || carry)
    for (const char* option :
         {"--backend", "--model", "--threads", "--dtype", "--repeats", "--engine-requests"})
      if (sub.count(option) > 0)
        throw Error(fmt::format("{} measures a backend; --{} measures nothing", option,
                                vidur ? "vidur" : "carry-from"));
}

void run_calibrate(const CalibrateOptions& o) {
  check_options(o);
  const bool cuda = o.backend == "cuda";
  cpu::set_num_threads(o.threads);
  const ModelSource source = resolve_model(o.model);
  const cpu::LlamaWeights weights = source.is_preset() ? cpu::random_llama_weights(source.config, 0)
                                                       : cpu::load_llama_weights(source.directory);
  const ModelConfig& model = weights.config;
  const auto grid = calibration_grid(model.max_position_embeddings, cuda);
  std::int64_t slots = 0;
  for (const auto& shape : grid) {
    std::int64_t total = 0;
    for (const auto& e : shape.entries) total += e.start_position + e.new_tokens;
    slots = std::max(slots, total);
  }
  // The backend measured, a plugin like every backend: cpu (fp32 products, K/V in this pool's
  // host storage) or cuda (K/V in device memory).
  KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, slots},
              KvStorage::none);
  const PluginRegistry registry(PluginRegistry::default_search_path());
  const ModelWeightsView view = cpu::weights_view(weights);
  PluginContext context;
  context.model = &model;
  context.max_seq_len = model.max_position_embeddings;
  context.pool = &pool;
  context.weights = &view;
  const PluginObject<Backend> backend_object = registry.create<PluginKind::backend>(
      o.backend, cuda ? ParamMap{{"dtype", o.dtype}} : ParamMap{{"weights", std::string("f32")}},
      context);  // after pool: destroyed (detaching) first
  Backend& backend = *backend_object;
  HardwareProfile start;
  if (cuda) {
    start = load_hardware_profile(o.profile);  // datasheet peaks
    start.name = o.name.empty() ? fmt::format("{}-calibrated-{}", start.name, model.name) : o.name;
    start.compute_dtype = start.kv_dtype = o.dtype == "f32" ? DType::dtype_f32 : DType::dtype_bf16;
  } else {
    start = cpu_start_profile(o, model);
  }
  measure_link(pool, model.max_position_embeddings, o.repeats, start);
  start.step_overhead_s = 1e-4;
  start.sequence_overhead_s = 1e-5;
  const CostModel shapes_model(model, start);

  fmt::print(stderr, "measuring {} batch shapes x {} rounds on the {} backend ({})...\n",
             grid.size(), o.repeats, o.backend, model.name);
  std::vector<std::vector<std::vector<std::int32_t>>> tokens;
  const auto batches = grid_batches(grid, model.vocab_size, tokens);
  const std::vector<double> seconds = median_forward_seconds(backend, batches, o.repeats);
  std::vector<CalibrationSample> samples;
  for (std::size_t s = 0; s < grid.size(); ++s)
    samples.push_back({shapes_model.work(grid[s].entries), seconds[s]});
  const EngineSteps engine =
      o.replay_requests() > 0 ? engine_step_samples(o, model, start, grid, seconds) : EngineSteps{};
  samples.insert(samples.end(), engine.samples.begin(), engine.samples.end());
  weigh_by_kind(grid.size(), engine, samples);
  if (!cuda) recheck_fma_peak(o.threads, start);
  // The cuda backend replays a CUDA graph for decode batches only: steps with prefill tokens
  // launch every kernel and pay more (the H200 run, docs/gpu.md); the fit gives them their term.
  CalibrationFit fit = fit_hardware_profile(start, samples, cuda);
  fit.profile.description = fmt::format(
      "kvlab {} backend, {} threads, {} ({}), fitted over {} batch shapes and {} engine steps",
      o.backend, o.threads, model.name, cuda ? o.dtype : "fp32", grid.size(),
      engine.samples.size());
  print_fit(grid, engine, samples, fit, start);
  write_profile(o.out, fit.profile, fit, samples.size());
}

}  // namespace

void register_calibrate(CLI::App& app) {
  auto o = std::make_shared<CalibrateOptions>();
  auto* sub = app.add_subcommand(
      "calibrate", "Measure a backend over batch shapes and fit a hardware profile for simulation");
  sub->add_option("--backend", o->backend, "Backend to measure: cpu or cuda")
      ->capture_default_str();
  sub->add_option("--model", o->model, "Preset or model folder to run")->capture_default_str();
  sub->add_option("--out", o->out, "Profile file to write (TOML)")->required();
  sub->add_option("--name", o->name, "Profile name (default: cpu-<model>-<threads>t)");
  sub->add_option("--threads", o->threads, "CPU threads")->capture_default_str();
  sub->add_option("--profile", o->profile,
                  "cuda: the hardware profile whose datasheet peaks the fit starts from");
  sub->add_option("--dtype", o->dtype, "cuda: f32 or bf16")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "Timed runs per shape (the median is kept)")
      ->capture_default_str();
  sub->add_option("--engine-requests", o->engine_requests,
                  "cpu: requests of an engine replay whose measured steps join the fit (0: the "
                  "shape grid only; default 192 on cpu, 0 on cuda)");
  auto v = std::make_shared<VidurCalibration>();
  sub->add_option("--vidur", v->folder,
                  "Fit a GPU profile's kernel terms to Vidur's measured operators in this folder "
                  "(../shared/data/vidur-profiling) instead of measuring a backend");
  sub->add_option("--gpu", v->gpu, "--vidur: a100 or h100");
  sub->add_option("--fit-models", v->fit_models,
                  "--vidur: the models the layer terms are fitted on (the rest are held out)")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--attention-model", v->attention_model,
                  "--vidur: the model whose attention excerpt attention is fitted on (default: "
                  "the one with an excerpt)");
  sub->add_option("--attention-from", v->attention_from,
                  "--vidur: carry the attention terms of this profile (a GPU without attention "
                  "measurements)");
  sub->add_option("--report", v->report, "--vidur: every measurement against its price (CSV)");
  sub->add_option("--carry-from", v->carry_from,
                  "Measure nothing: give --profile the kernel terms of this profile (a GPU of the "
                  "same silicon, such as h100-sxm for h200)");
  sub->callback([o, v, sub]() {
    v->profile = o->profile;
    v->out = o->out;
    v->name = o->name;
    check_vidur_options(*sub, *v);
    if (!v->carry_from.empty()) return run_calibrate_carry(*v);
    if (v->folder.empty()) return run_calibrate(*o);
    if (v->gpu.empty()) throw Error("--vidur needs --gpu a100 or h100");
    run_calibrate_vidur(*v);
  });
}

}  // namespace kvlab::cli
