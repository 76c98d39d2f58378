// kvlab calibrate: measure a real backend over a grid of batch shapes and fit a hardware
// profile (efficiencies and overheads) so the simulated backend predicts it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>

#include "cli_common.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/machine_peak.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/calibration.hpp"

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
};

// One grid point: sequences of `new_tokens` each after `context` cached tokens.
struct Shape {
  std::string label;
  std::vector<EntryShape> entries;
};

std::vector<Shape> calibration_grid(std::int64_t max_context) {
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
  return grid;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// This machine's measured peaks (FMA, DRAM read, memcpy for swaps) to fit the CPU backend against.
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
  const cpu::HostCopyLink link = cpu::measured_host_copy_link();  // a swap is a host memcpy
  start.swap_gb_per_s = link.gb_per_s;
  start.swap_latency_s = link.latency_s;
  return start;
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
std::vector<double> median_forward_seconds(Backend& backend,
                                           const std::vector<std::vector<BatchEntry>>& batches,
                                           int repeats) {
  std::vector<std::vector<double>> times(batches.size());
  for (int round = 0; round < repeats; ++round)
    for (std::size_t s = 0; s < batches.size(); ++s) {
      (void)backend.forward(batches[s]);
      const auto t0 = std::chrono::steady_clock::now();
      (void)backend.forward(batches[s]);
      times[s].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  std::vector<double> medians;
  for (auto& t : times) medians.push_back(median(std::move(t)));
  return medians;
}

void print_fit(const std::vector<Shape>& grid, const std::vector<CalibrationSample>& samples,
               const CalibrationFit& fit, const HardwareProfile& start, const ModelConfig& model) {
  const HardwareProfile& profile = fit.profile;
  fmt::print("{:<40} {:>12} {:>12} {:>8}\n", "shape", "measured ms", "predicted ms", "error");
  const CostModel fitted(model, profile);
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const double predicted = fitted.cost(samples[i].work).total();
    fmt::print("{:<40} {:>12.3f} {:>12.3f} {:>7.1f}%\n", grid[i].label, samples[i].measured_s * 1e3,
               predicted * 1e3, 100 * (predicted - samples[i].measured_s) / samples[i].measured_s);
  }
  fmt::print("\nfit: mean |error| {:.1f}%, max {:.1f}% over {} shapes ({} iterations)\n",
             100 * fit.mean_abs_rel_error, 100 * fit.max_abs_rel_error, samples.size(),
             fit.iterations);
  const Efficiency& e = profile.efficiency;
  fmt::print(
      "peaks: {:.1f} GFLOP/s, {:.1f} GB/s (started from {:.1f} and {:.1f}); efficiencies: gemm "
      "{:.2f}/{:.2f}, attention {:.2f}/{:.2f}, elementwise {:.2f}; overhead {:.3f} ms/step + "
      "{:.4f} ms/sequence; swap link {:.2f} GB/s + {:.2f} us per copy\n",
      profile.peak_tflops * 1e3, profile.memory_gb_per_s, start.peak_tflops * 1e3,
      start.memory_gb_per_s, e.gemm_compute, e.gemm_memory, e.attention_compute, e.attention_memory,
      e.elementwise_memory, profile.step_overhead_s * 1e3, profile.sequence_overhead_s * 1e3,
      profile.swap_gb_per_s, profile.swap_latency_s * 1e6);
}

void write_profile(const std::string& out, const HardwareProfile& profile,
                   const CalibrationFit& fit, std::size_t shapes) {
  if (const auto folder = std::filesystem::path(out).parent_path(); !folder.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) throw Error(fmt::format("cannot create {}: {}", folder.string(), ec.message()));
  }
  std::ofstream file(out, std::ios::trunc);
  if (!file) throw Error(fmt::format("cannot write {}", out));
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  file << fmt::format(
      "# Written by kvlab calibrate on {}: {}.\n# Fit over {} "
      "batch shapes: mean |error| {:.1f}%, max {:.1f}%.\n",
      date, profile.description, shapes, 100 * fit.mean_abs_rel_error, 100 * fit.max_abs_rel_error);
  file << hardware_profile_to_toml(profile);
  if (!file) throw Error(fmt::format("cannot write {}", out));
  fmt::print("wrote {}\n", out);
}

void run_calibrate(const CalibrateOptions& o) {
  check_options(o);
  const bool cuda = o.backend == "cuda";
  cpu::set_num_threads(o.threads);
  const ModelSource source = resolve_model(o.model);
  const cpu::LlamaWeights weights = source.is_preset() ? cpu::random_llama_weights(source.config, 0)
                                                       : cpu::load_llama_weights(source.directory);
  const ModelConfig& model = weights.config;
  const auto grid = calibration_grid(model.max_position_embeddings);
  std::int64_t slots = 0;
  for (const auto& shape : grid) {
    std::int64_t total = 0;
    for (const auto& e : shape.entries) total += e.start_position + e.new_tokens;
    slots = std::max(slots, total);
  }
  // The backend measured: the CPU backend, or the cuda plugin with its K/V in device memory.
  KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, slots},
              cuda ? KvStorage::none : KvStorage::host);
  const PluginRegistry registry(PluginRegistry::default_search_path());
  std::unique_ptr<cpu::CpuBackend> cpu_backend;
  PluginObject<Backend> cuda_backend;  // after pool: destroyed (detaching) first
  HardwareProfile start;
  if (cuda) {
    PluginContext context;
    context.model = &model;
    context.max_seq_len = model.max_position_embeddings;
    context.pool = &pool;
    context.weights = &weights;
    cuda_backend = registry.create<PluginKind::backend>("cuda", {{"dtype", o.dtype}}, context);
    start = load_hardware_profile(o.profile);  // datasheet peaks
    start.name = o.name.empty() ? fmt::format("{}-calibrated-{}", start.name, model.name) : o.name;
    start.compute_dtype = start.kv_dtype = o.dtype == "f32" ? DType::dtype_f32 : DType::dtype_bf16;
  } else {
    cpu_backend = std::make_unique<cpu::CpuBackend>(weights, pool, std::nullopt);
    start = cpu_start_profile(o, model);
  }
  Backend& backend = cuda ? *cuda_backend : static_cast<Backend&>(*cpu_backend);
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
  CalibrationFit fit = fit_hardware_profile(start, samples);
  fit.profile.description =
      fmt::format("kvlab {} backend, {} threads, {} ({}), fitted over {} batch shapes", o.backend,
                  o.threads, model.name, cuda ? o.dtype : "fp32", samples.size());
  print_fit(grid, samples, fit, start, model);
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
  sub->callback([o]() { run_calibrate(*o); });
}

}  // namespace kvlab::cli
