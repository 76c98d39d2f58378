// kvlab calibrate --vidur: a profile's kernel terms fitted to Vidur's measured operators
// (kvlab/sim/vidur_fit.hpp).
#include "kvlab/sim/vidur_fit.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <unsupported/Eigen/NonLinearOptimization>
#include <unsupported/Eigen/NumericalDiff>

#include "kvlab/error.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/suggest.hpp"
#include "least_squares.hpp"

namespace kvlab {
namespace {

// The operators of one step as the cost model prices them, by name (a run's work and seconds).
std::map<std::string, OperatorCost> step_operators(const ModelConfig& model,
                                                   const HardwareProfile& profile,
                                                   std::int64_t tensor_parallel,
                                                   std::span<const EntryShape> batch) {
  const CostModel cost(model, profile, tensor_parallel);
  std::map<std::string, OperatorCost> ops;
  for (OperatorCost& op : cost.breakdown(batch).operators) ops.emplace(op.name, std::move(op));
  return ops;
}

// The step an mlp.csv row or an attention row measures: `tokens` new tokens after `cached`
// keys in one sequence, or `batch` decodes after `cached` keys each.
std::vector<EntryShape> prefill_shape(std::int64_t tokens, std::int64_t cached = 0) {
  return {EntryShape{tokens, cached, 0, 1}};
}
std::vector<EntryShape> attention_shape(const VidurAttentionRow& row) {
  if (row.prefill) return prefill_shape(row.chunk, row.kv_cache);
  return std::vector<EntryShape>(static_cast<std::size_t>(row.batch),
                                 EntryShape{1, row.kv_cache, 0, 1});
}

// ---- The kernel fit --------------------------------------------------------------------------

struct KernelSample {
  FlopsAndBytes work;  // one kernel's
  double rows = 0;     // an element-wise kernel's (its wave)
  double measured_s = 0;
  int kernel = 0;  // which kernel class's floor and knee price it
};

struct KernelFit {
  double compute = 1, memory = 1;  // shared by the classes
  std::vector<KernelTerms> kernels;
  double mean_error = 0, max_error = 0;
};

// The fitted parameters as a vector: logit e_compute (when fitted), logit e_memory, then each
// class's floor in microseconds (|.|: a floor is not negative) and knee - 1 as a log (a knee is
// at least 1, where the two times add).
struct KernelModel {
  int classes = 1;
  bool compute = true, knee = true;
  double peak = 0, bandwidth = 0;
  double wave_rows = 0;  // element-wise: fewer rows take as long as this many

  Eigen::Index size() const { return (compute ? 2 : 1) + classes * (knee ? 2 : 1); }
  static double logistic(double v) { return 1 / (1 + std::exp(-v)); }
  KernelFit unpack(const Eigen::VectorXd& x) const {
    KernelFit f;
    Eigen::Index i = 0;
    if (compute) f.compute = logistic(x[i++]);
    f.memory = logistic(x[i++]);
    for (int c = 0; c < classes; ++c) {
      KernelTerms t;
      t.floor_s = std::abs(x[i++]) * 1e-6;
      if (knee) t.knee = 1 + std::exp(x[i++]);
      f.kernels.push_back(t);
    }
    return f;
  }
  Eigen::VectorXd start(double floor_us, double knee_start) const {
    Eigen::VectorXd x(size());
    Eigen::Index i = 0;
    if (compute) x[i++] = 0.4;  // logistic: 0.6
    x[i++] = 0.85;              // 0.7
    for (int c = 0; c < classes; ++c) {
      x[i++] = floor_us;
      if (knee) x[i++] = std::log(knee_start - 1);
    }
    return x;
  }
  double predict(const KernelFit& f, const KernelSample& s) const {
    const KernelTerms& k = f.kernels[static_cast<std::size_t>(s.kernel)];
    FlopsAndBytes work = s.work;
    if (s.rows > 0 && s.rows < wave_rows) work.bytes *= wave_rows / s.rows;
    return k.floor_s + kernel_seconds(work, peak, bandwidth, {f.compute, f.memory}, k.knee);
  }
};

struct KernelResiduals : sim_detail::DynamicResiduals {
  const KernelModel* model;
  std::span<const KernelSample> samples;
  int inputs() const { return static_cast<int>(model->size()); }
  int values() const { return static_cast<int>(samples.size()); }
  int operator()(const Eigen::VectorXd& x, Eigen::VectorXd& residual) const {
    const KernelFit f = model->unpack(x);
    for (std::size_t i = 0; i < samples.size(); ++i)
      residual[static_cast<Eigen::Index>(i)] =
          model->predict(f, samples[i]) / samples[i].measured_s - 1;
    return 0;
  }
};

// Levenberg-Marquardt from a few knees (the error surface has a valley along it), the best kept.
KernelFit fit_kernels(const KernelModel& model, std::span<const KernelSample> samples) {
  if (samples.size() < static_cast<std::size_t>(model.size()) * 4)
    throw Error(fmt::format("the Vidur fit has {} samples for {} parameters", samples.size(),
                            model.size()));
  double smallest = samples.front().measured_s;
  for (const KernelSample& s : samples) smallest = std::min(smallest, s.measured_s);
  KernelFit best;
  double best_squares = -1;
  for (const double knee : {1.5, 3.0}) {
    Eigen::VectorXd x = model.start(0.5 * smallest * 1e6, knee);
    KernelResiduals residuals{{}, &model, samples};
    Eigen::NumericalDiff<KernelResiduals> numerical(residuals);
    Eigen::LevenbergMarquardt<Eigen::NumericalDiff<KernelResiduals>> solver(numerical);
    solver.parameters.maxfev = 4000;
    solver.minimize(x);
    Eigen::VectorXd r(samples.size());
    residuals(x, r);
    if (best_squares < 0 || r.squaredNorm() < best_squares) {
      best_squares = r.squaredNorm();
      best = model.unpack(x);
      best.mean_error = r.cwiseAbs().mean();
      best.max_error = r.cwiseAbs().maxCoeff();
    }
    if (!model.knee) break;
  }
  // A floor under a nanosecond is no floor (the data's resolution is a microsecond): written as
  // 0, so that the last digits of a vanishing parameter do not differ between compilers.
  for (KernelTerms& k : best.kernels)
    if (k.floor_s < 1e-9) k.floor_s = 0;
  return best;
}

// ---- Samples ---------------------------------------------------------------------------------

const std::size_t kGemms[] = {0, 1, 2, 3};  // VidurOperator::qkv_proj .. down_proj

std::string join(std::span<const std::string> names) {
  return join_names(names, ", ");
}

// `visit(model, row, operators)` for every mlp.csv row of the models in `names`.
template <typename Visit>
void for_each_layer_row(const VidurData& data, std::span<const std::string> names,
                        const HardwareProfile& profile, Visit&& visit) {
  for (const std::string& name : names) {
    const VidurModel& model = data.model(name);
    for (const VidurLayerRow& row : model.layers)
      visit(model, row,
            step_operators(model.config, profile, row.tensor_parallel, prefill_shape(row.tokens)));
  }
}

std::vector<KernelSample> operator_samples(const VidurData& data, const VidurFitOptions& options,
                                           const HardwareProfile& profile,
                                           std::span<const std::size_t> columns) {
  std::vector<KernelSample> samples;
  for_each_layer_row(data, options.fit_models, profile,
                     [&](const VidurModel&, const VidurLayerRow& row, const auto& ops) {
                       for (const std::size_t op : columns)
                         samples.push_back({ops.at(kVidurOperatorNames[op].kvlab).work,
                                            static_cast<double>(row.tokens), row.seconds[op], 0});
                     });
  return samples;
}

std::string fit_summary(const KernelFit& f, std::size_t samples) {
  return fmt::format("{} kernels, mean |error| {:.1f}%, worst {:.0f}%", samples, 100 * f.mean_error,
                     100 * f.max_error);
}

std::string layer_source(const VidurData& data, const VidurFitOptions& options) {
  std::vector<std::string> held_out;
  std::set<std::int64_t> tps;
  std::int64_t most_tokens = 0;
  for (const VidurModel& m : data.models) {
    if (std::find(options.fit_models.begin(), options.fit_models.end(), m.name) ==
        options.fit_models.end()) {
      held_out.push_back(m.name);
      continue;
    }
    for (const VidurLayerRow& row : m.layers) {
      tps.insert(row.tensor_parallel);
      most_tokens = std::max(most_tokens, row.tokens);
    }
  }
  return fmt::format("Vidur's {} mlp.csv (MLSys'24) of {}, 1 to {} tokens, TP {}; held out: {}",
                     data.gpu, join(options.fit_models), most_tokens, fmt::join(tps, "/"),
                     join(held_out));
}

void fit_gemms(const VidurData& data, const VidurFitOptions& options, HardwareProfile& p) {
  const auto samples = operator_samples(data, options, p, kGemms);
  const KernelModel model{1, true, true, p.peak_tflops * 1e12, p.memory_gb_per_s * 1e9};
  const KernelFit f = fit_kernels(model, samples);
  p.efficiency.gemm_compute = f.compute;
  p.efficiency.gemm_memory = f.memory;
  p.gemm_kernel = f.kernels[0];
  p.gemm_regimes.clear();
  p.provenance["gemm"] = fmt::format(
      "gemm_compute, gemm_memory, gemm_floor_s, gemm_knee fitted by kvlab calibrate --vidur to "
      "attn_pre_proj, attn_post_proj, mlp_up_proj, mlp_down_proj of {}: {}",
      layer_source(data, options), fit_summary(f, samples.size()));
  p.provenance["lm_head"] = "not measured by Vidur: priced by the gemm terms";
}

// The element-wise kinds and the mlp.csv columns each is fitted to.
struct ElementwiseColumns {
  ElementwiseKind kind;
  std::vector<VidurOperator> columns;
};
const ElementwiseColumns kElementwiseColumns[] = {
    {ElementwiseKind::rms_norm, {VidurOperator::input_norm, VidurOperator::post_attention_norm}},
    {ElementwiseKind::residual_add, {VidurOperator::residual_add}},
    {ElementwiseKind::rope, {VidurOperator::rope}},
    {ElementwiseKind::activation, {VidurOperator::activation}},
    {ElementwiseKind::embedding, {VidurOperator::embedding}}};

struct ElementwiseFit {
  double wave_rows = 0;
  std::vector<KernelFit> fits;  // by kElementwiseColumns
  std::vector<std::size_t> samples;
  double mean_error = 0;  // over every kind's samples
};

// Each kind's samples (their work does not depend on the wave), fitted under one wave.
ElementwiseFit fit_elementwise_kinds(std::span<const std::vector<KernelSample>> samples,
                                     const HardwareProfile& p, double wave_rows) {
  ElementwiseFit out{wave_rows, {}, {}, 0};
  KernelModel model{1, false, false, p.peak_tflops * 1e12, p.memory_gb_per_s * 1e9, wave_rows};
  std::size_t total = 0;
  for (const std::vector<KernelSample>& kind : samples) {
    out.fits.push_back(fit_kernels(model, kind));
    out.samples.push_back(kind.size());
    out.mean_error += out.fits.back().mean_error * static_cast<double>(kind.size());
    total += kind.size();
  }
  out.mean_error /= static_cast<double>(total);
  return out;
}

// Each kind's e_memory and floor, with the wave (one for all kinds: it is the GPU's) that fits
// best among a few sizes around the SM counts (A100: 108, H100: 132).
void fit_elementwise(const VidurData& data, const VidurFitOptions& options, HardwareProfile& p) {
  std::vector<std::vector<KernelSample>> samples;
  for (const ElementwiseColumns& k : kElementwiseColumns) {
    std::vector<std::size_t> columns;
    for (const VidurOperator op : k.columns) columns.push_back(static_cast<std::size_t>(op));
    samples.push_back(operator_samples(data, options, p, columns));
  }
  ElementwiseFit best;
  for (const double wave : {0.0, 32.0, 64.0, 96.0, 128.0, 160.0, 192.0, 256.0}) {
    ElementwiseFit f = fit_elementwise_kinds(samples, p, wave);
    if (best.fits.empty() || f.mean_error < best.mean_error) best = std::move(f);
  }
  p.elementwise_wave_rows = best.wave_rows;
  for (std::size_t i = 0; i < best.fits.size(); ++i) {
    const ElementwiseColumns& k = kElementwiseColumns[i];
    std::vector<std::string> names;
    for (const VidurOperator op : k.columns)
      names.emplace_back(kVidurOperatorNames[static_cast<std::size_t>(op)].column);
    const std::size_t kind = static_cast<std::size_t>(k.kind);
    p.elementwise[kind] = {best.fits[i].memory, best.fits[i].kernels[0].floor_s};
    p.provenance[fmt::format("elementwise.{}", kElementwiseNames[kind])] =
        fmt::format("fitted by kvlab calibrate --vidur to {} of {}: {}", join(names),
                    layer_source(data, options), fit_summary(best.fits[i], best.samples[i]));
  }
  p.provenance["elementwise_wave_rows"] = fmt::format(
      "the wave (of 0, 32, ..., 256 rows) the element-wise fits above share best: {:.1f}% mean "
      "|error| over their kernels",
      100 * best.mean_error);
  const std::size_t add = static_cast<std::size_t>(ElementwiseKind::residual_add);
  p.elementwise[static_cast<std::size_t>(ElementwiseKind::kv_write)] = p.elementwise[add];
  p.efficiency.elementwise_memory = p.elementwise[add].memory;
  p.provenance["elementwise.kv_write"] =
      "not in Vidur's mlp.csv: the residual add's terms (both are plain copies)";
}

void fit_attention(const VidurData& data, const VidurFitOptions& options, HardwareProfile& p) {
  if (options.attention_model.empty()) return;
  const VidurModel& model = data.model(options.attention_model);
  if (model.attention.empty())
    throw Error(fmt::format("Vidur's {} {} has no attention_excerpt.csv", data.gpu, model.name));
  std::vector<KernelSample> samples;
  std::size_t prefills = 0;
  for (const VidurAttentionRow& row : model.attention) {
    const auto ops = step_operators(model.config, p, 1, attention_shape(row));
    samples.push_back({ops.at(row.prefill ? "attention_prefill" : "attention_decode").work, 0,
                       row.seconds, row.prefill ? 0 : 1});
    prefills += row.prefill ? 1 : 0;
  }
  const KernelModel kernel{2, true, true, p.peak_tflops * 1e12, p.memory_gb_per_s * 1e9};
  const KernelFit f = fit_kernels(kernel, samples);
  p.efficiency.attention_compute = f.compute;
  p.efficiency.attention_memory = f.memory;
  p.prefill_attention_kernel = f.kernels[0];
  p.decode_attention_kernel = f.kernels[1];
  p.decode_attention_regimes.clear();
  p.provenance["attention"] = fmt::format(
      "attention_compute, attention_memory and the prefill_attention and decode_attention floors "
      "and knees fitted by kvlab calibrate --vidur to Vidur's {} attention_excerpt.csv of {} ({}; "
      "{} prefill chunks, {} decode batches, TP 1): {}",
      data.gpu, model.name, model.attention_backend, prefills, samples.size() - prefills,
      fit_summary(f, samples.size()));
}

// Least squares on relative errors, per group size: latency + traffic / bandwidth, where the
// traffic is the ring's 2 (g - 1) / g of the message.
void fit_allreduce(const VidurData& data, HardwareProfile& p) {
  std::map<std::int64_t, std::vector<VidurAllReduceRow>> by_gpus;
  for (const VidurAllReduceRow& row : data.allreduce) by_gpus[row.gpus].push_back(row);
  p.allreduce.clear();
  std::vector<std::string> fits;
  for (const auto& [gpus, rows] : by_gpus) {
    const double g = static_cast<double>(gpus);
    Eigen::MatrixXd a(static_cast<Eigen::Index>(rows.size()), 2);
    for (std::size_t i = 0; i < rows.size(); ++i)
      a.row(static_cast<Eigen::Index>(i)) << 1 / rows[i].seconds,
          2 * (g - 1) / g * rows[i].bytes / rows[i].seconds;
    const Eigen::VectorXd x = a.colPivHouseholderQr().solve(Eigen::VectorXd::Ones(a.rows()));
    if (!(x[0] >= 0) || !(x[1] > 0))
      throw Error(fmt::format("the {}-GPU all-reduce fit is not physical: latency {} s, {} s/B",
                              gpus, x[0], x[1]));
    const double error = (a * x - Eigen::VectorXd::Ones(a.rows())).cwiseAbs().mean();
    p.allreduce.push_back({gpus, x[0], 1e-9 / x[1]});
    fits.push_back(
        fmt::format("{} GPUs: {} sizes, mean |error| {:.1f}%", gpus, rows.size(), 100 * error));
  }
  if (p.allreduce.empty()) return;
  p.allreduce_latency_s = p.allreduce.back().latency_s;  // the largest group: other sizes, CP
  p.allreduce_gb_per_s = p.allreduce.back().gb_per_s;
  p.provenance["allreduce"] = fmt::format(
      "fitted by kvlab calibrate --vidur to Vidur's network/{}_dgx/all_reduce.csv (NCCL inside "
      "one node, 2 KB to 128 MB); [interconnect] is the largest group's: {}",
      data.gpu, join(fits));
}

// ---- Validation ------------------------------------------------------------------------------

struct PointSink {
  std::vector<VidurPoint>& points;
  std::string model;
  bool held_out;
  void add(const std::string& kind, const std::string& name, std::int64_t tp, std::int64_t tokens,
           std::int64_t kv_cache, double measured, double predicted) {
    points.push_back({model, held_out, kind, name, tp, tokens, kv_cache, 0, measured, predicted});
  }
};

// A layer as Vidur sums it: the nine operators of mlp.csv but the embedding, measured and priced.
std::pair<double, double> layer_times(const VidurLayerRow& row,
                                      const std::map<std::string, OperatorCost>& ops) {
  double measured = 0, predicted = 0;
  for (std::size_t op = 0; op < kVidurOperators; ++op) {
    if (op == static_cast<std::size_t>(VidurOperator::embedding)) continue;
    measured += row.seconds[op];
    predicted += ops.at(kVidurOperatorNames[op].kvlab).seconds;
  }
  return {measured, predicted};
}

void validate_layers(const VidurModel& model, const HardwareProfile& p, PointSink& sink) {
  for (const VidurLayerRow& row : model.layers) {
    const auto ops =
        step_operators(model.config, p, row.tensor_parallel, prefill_shape(row.tokens));
    for (std::size_t op = 0; op < kVidurOperators; ++op)
      sink.add("operator", kVidurOperatorNames[op].column, row.tensor_parallel, row.tokens, 0,
               row.seconds[op], ops.at(kVidurOperatorNames[op].kvlab).seconds);
    const auto [measured, predicted] = layer_times(row, ops);
    sink.add("layer", "layer", row.tensor_parallel, row.tokens, 0, measured, predicted);
  }
}

// Each attention row alone, and with the layer of as many tokens (tensor parallelism 1).
void validate_attention(const VidurModel& model, const HardwareProfile& p, PointSink& sink) {
  for (const VidurAttentionRow& row : model.attention) {
    const auto ops = step_operators(model.config, p, 1, attention_shape(row));
    const std::string kind = row.prefill ? "attention_prefill" : "attention_decode";
    const std::int64_t tokens = row.prefill ? row.chunk : row.batch;
    const double attention = ops.at(kind).seconds;
    sink.add(kind, kind, 1, tokens, row.kv_cache, row.seconds, attention);
    const auto layer = std::find_if(model.layers.begin(), model.layers.end(), [&](const auto& l) {
      return l.tensor_parallel == 1 && l.tokens == tokens;
    });
    if (layer == model.layers.end()) continue;
    const auto [measured, predicted] = layer_times(*layer, ops);
    sink.add("layer_with_attention", kind, 1, tokens, row.kv_cache, measured + row.seconds,
             predicted + attention);
  }
}

}  // namespace

std::vector<VidurPoint> vidur_validation(const VidurData& data, const HardwareProfile& profile,
                                         const VidurFitOptions& options) {
  std::vector<VidurPoint> points;
  for (const VidurModel& model : data.models) {
    const bool fitted = std::find(options.fit_models.begin(), options.fit_models.end(),
                                  model.name) != options.fit_models.end();
    PointSink sink{points, model.name, !fitted};
    validate_layers(model, profile, sink);
    sink.held_out = model.name != options.attention_model;
    validate_attention(model, profile, sink);
  }
  for (const VidurAllReduceRow& row : data.allreduce) {
    const auto [latency, gb_per_s] = allreduce_latency_and_bandwidth(profile, row.gpus);
    const double g = static_cast<double>(row.gpus);
    VidurPoint point{"",
                     false,
                     "all_reduce",
                     "all_reduce",
                     row.gpus,
                     0,
                     0,
                     row.bytes,
                     row.seconds,
                     latency + 2 * (g - 1) / g * row.bytes / (gb_per_s * 1e9)};
    points.push_back(point);
  }
  return points;
}

HardwareProfile fit_vidur_profile(const VidurData& data, const HardwareProfile& start,
                                  const VidurFitOptions& options) {
  if (options.fit_models.empty()) throw Error("the Vidur fit needs at least one model to fit on");
  HardwareProfile p = start;
  fit_gemms(data, options, p);
  fit_elementwise(data, options, p);
  fit_attention(data, options, p);
  fit_allreduce(data, p);
  return p;
}

}  // namespace kvlab
