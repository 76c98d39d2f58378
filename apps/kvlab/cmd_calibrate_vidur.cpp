// kvlab calibrate --vidur: a GPU profile fitted to Vidur's measured operators, and the cost
// model's error on every measurement, the held-out models' apart (kvlab/sim/vidur_fit.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/sim/vidur_fit.hpp"

namespace kvlab::cli {
namespace {

struct ErrorStats {
  std::size_t points = 0;
  double sum = 0, max = 0;
  void add(double error) {
    ++points;
    sum += std::abs(error);
    max = std::max(max, std::abs(error));
  }
  double mean() const { return points == 0 ? 0.0 : sum / static_cast<double>(points); }
};

const char* role(bool held_out) {
  return held_out ? "held out" : "fit";
}

// Per model and tensor parallelism: the operators' mean |error|, the worst operator's mean, the
// layers' mean and worst.
void print_layer_table(std::span<const VidurPoint> points) {
  std::map<std::pair<std::string, std::int64_t>, std::map<std::string, ErrorStats>> by;
  std::map<std::string, bool> held_out;
  for (const VidurPoint& p : points) {
    if (p.kind != "operator" && p.kind != "layer") continue;
    auto& stats = by[{p.model, p.tensor_parallel}];
    stats[p.kind == "layer" ? "~layer" : p.name].add(p.error());
    if (p.kind == "operator") stats["~all"].add(p.error());
    held_out[p.model] = p.held_out;
  }
  fmt::print("{:<28} {:<9} {:>3} {:>9} {:>26} {:>9} {:>9}\n", "model", "role", "TP", "ops mean",
             "worst operator (its mean)", "layer", "layer max");
  for (const auto& [key, stats] : by) {
    std::string worst;
    double worst_mean = -1;
    for (const auto& [name, s] : stats)
      if (!name.starts_with("~") && s.mean() > worst_mean) {
        worst = name;
        worst_mean = s.mean();
      }
    const ErrorStats& layer = stats.at("~layer");
    fmt::print("{:<28} {:<9} {:>3} {:>8.1f}% {:>19} {:>5.1f}% {:>8.1f}% {:>8.1f}%\n", key.first,
               role(held_out[key.first]), key.second, 100 * stats.at("~all").mean(), worst,
               100 * worst_mean, 100 * layer.mean(), 100 * layer.max);
  }
}

// Attention alone and with its layer, and the all-reduces: mean and worst |error| by group.
void print_other_tables(std::span<const VidurPoint> points) {
  std::map<std::string, ErrorStats> by;
  for (const VidurPoint& p : points) {
    if (p.kind == "operator" || p.kind == "layer") continue;
    const std::string key =
        p.kind == "all_reduce"
            ? fmt::format("all_reduce, {} GPUs", p.tensor_parallel)
            : fmt::format("{}: {} ({})",
                          p.kind == "layer_with_attention" ? "layer + " + p.name : p.kind, p.model,
                          role(p.held_out));
    by[key].add(p.error());
  }
  fmt::print("\n{:<62} {:>6} {:>8} {:>8}\n", "measurements", "points", "mean", "max");
  for (const auto& [key, s] : by)
    fmt::print("{:<62} {:>6} {:>7.1f}% {:>7.1f}%\n", key, s.points, 100 * s.mean(), 100 * s.max);
}

void write_report(const std::string& file, const std::string& gpu,
                  std::span<const VidurPoint> points) {
  std::ofstream out = open_output_file(file);
  out << "gpu,model,role,kind,name,tp,tokens,kv_cache,bytes,measured_s,predicted_s\n";
  for (const VidurPoint& p : points)
    out << fmt::format("{},{},{},{},{},{},{},{},{},{:.9g},{:.9g}\n", gpu, p.model,
                       p.held_out ? "held_out" : "fit", p.kind, p.name, p.tensor_parallel, p.tokens,
                       p.kv_cache, p.bytes, p.measured_s, p.predicted_s);
  if (!out) throw Error(fmt::format("cannot write {}", file));
  fmt::print("wrote {} ({} measurements)\n", file, points.size());
}

// The attention terms of another profile (an H100 has no attention measurements in Vidur's data:
// the A100's fractions of the peaks are carried over).
void carry_attention(HardwareProfile& p, const std::string& from) {
  const HardwareProfile other = load_hardware_profile(from);
  p.efficiency.attention_compute = other.efficiency.attention_compute;
  p.efficiency.attention_memory = other.efficiency.attention_memory;
  p.prefill_attention_kernel = other.prefill_attention_kernel;
  p.decode_attention_kernel = other.decode_attention_kernel;
  p.decode_attention_regimes = other.decode_attention_regimes;
  p.provenance["attention"] = fmt::format(
      "not measured on this GPU in Vidur's data: {}'s fractions of its peaks carried over ({})",
      other.name, other.provenance.count("attention") ? other.provenance.at("attention") : "");
}

void write_fitted_profile(const std::string& out, const HardwareProfile& profile,
                          const std::string& how) {
  write_profile_file(
      out, fmt::format("# {}: {}. Where each term comes from: [provenance].\n", profile.name, how),
      profile);
}

}  // namespace

void run_calibrate_carry(const VidurCalibration& o) {
  if (o.profile.empty())
    throw Error("--carry-from: give --profile with the GPU's datasheet peaks (h200, ...)");
  const HardwareProfile from = load_hardware_profile(o.carry_from);
  HardwareProfile p = load_hardware_profile(o.profile);
  const std::string source = fmt::format(
      "carried from {} by kvlab calibrate --carry-from (the same kernels on this GPU: its "
      "fractions of this GPU's own peaks, floors, knees and waves; all-reduces as measured there)",
      from.name);
  p.efficiency = from.efficiency;
  p.gemm_regimes = from.gemm_regimes;
  p.decode_attention_regimes = from.decode_attention_regimes;
  p.gemm_kernel = from.gemm_kernel;
  p.prefill_attention_kernel = from.prefill_attention_kernel;
  p.decode_attention_kernel = from.decode_attention_kernel;
  p.elementwise = from.elementwise;
  p.elementwise_wave_rows = from.elementwise_wave_rows;
  p.allreduce = from.allreduce;
  p.allreduce_gb_per_s = from.allreduce_gb_per_s;
  p.allreduce_latency_s = from.allreduce_latency_s;
  // The host's share (launches, scheduling, sync) comes with the kernels' fit: the same serving
  // stack, and a floor fitted beside an overhead is only right with that overhead.
  p.step_overhead_s = from.step_overhead_s;
  p.sequence_overhead_s = from.sequence_overhead_s;
  p.ungraphed_step_s = from.ungraphed_step_s;
  for (const auto& [term, text] : from.provenance)
    if (term != "device" && term != "memory" && term != "link" && term != "network")
      p.provenance[term] = fmt::format("{} ({}: {})", source, from.name, text);
  if (!o.name.empty()) p.name = o.name;
  p.description = fmt::format("{} (kernel terms carried from {})",
                              p.description.substr(0, p.description.find(" (")), from.name);
  write_fitted_profile(o.out, p,
                       fmt::format("written by kvlab calibrate --carry-from {}", from.name));
}

void run_calibrate_vidur(const VidurCalibration& o) {
  if (o.profile.empty())
    throw Error("--vidur: give --profile with the GPU's datasheet peaks (a100-80gb, h100-sxm)");
  const VidurData data = load_vidur_data(o.folder, o.gpu);
  VidurFitOptions options{o.fit_models, o.attention_model};
  if (options.attention_model.empty() && o.attention_from.empty())
    for (const VidurModel& m : data.models)
      if (!m.attention.empty()) options.attention_model = m.name;
  HardwareProfile start = load_hardware_profile(o.profile);
  if (!o.attention_from.empty()) carry_attention(start, o.attention_from);
  HardwareProfile fitted = fit_vidur_profile(data, start, options);
  if (!o.name.empty()) fitted.name = o.name;
  fitted.description =
      fmt::format("{} (kernel terms fitted to Vidur's measured {} operators)",
                  start.description.substr(0, start.description.find(" (")), data.gpu);
  const auto points = vidur_validation(data, fitted, options);
  fmt::print("Vidur {}: layer terms fitted on {}; attention on {}\n\n", data.gpu,
             fmt::join(options.fit_models, ", "),
             options.attention_model.empty() ? o.attention_from : options.attention_model);
  print_layer_table(points);
  print_other_tables(points);
  if (!o.report.empty()) write_report(o.report, data.gpu, points);
  write_fitted_profile(o.out, fitted,
                       "written by kvlab calibrate --vidur from Vidur's profiling data (MLSys'24, "
                       "MIT licence; ../shared/data/vidur-profiling)");
}

}  // namespace kvlab::cli
