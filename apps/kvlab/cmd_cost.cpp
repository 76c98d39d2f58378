// kvlab cost: what the simulated backend charges for given steps, operator by operator (each
// GEMM, attention, the elementwise operators, collectives, the LM head, host overheads), per
// layer and per step, for a model on a hardware profile: CostModel::breakdown as a table or JSON.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/step_spec.hpp"

namespace kvlab::cli {
namespace {

struct CostOptions {
  std::string model;
  std::string gpu;
  std::int64_t tp = 1, cp = 1;
  std::vector<std::string> steps;
  bool json = false;
};

nlohmann::json step_json(const std::string& label, const StepBreakdown& b) {
  nlohmann::json operators = nlohmann::json::array();
  for (const OperatorCost& op : b.operators)
    operators.push_back({{"name", op.name},
                         {"group", op.group},
                         {"runs", op.runs},
                         {"flops_per_run", op.work.flops},
                         {"bytes_per_run", op.work.bytes},
                         {"seconds_per_run", op.seconds},
                         {"seconds", op.seconds * static_cast<double>(op.runs)},
                         {"bound", op.bound},
                         {"per_layer", op.per_layer}});
  return {{"step", label},
          {"sequences", b.work.sequences},
          {"tokens", b.work.tokens},
          {"seconds", b.cost.total()},
          {"operators", operators}};
}

void print_step(const std::string& label, const StepBreakdown& b, std::int64_t layers) {
  const double total = b.cost.total();
  fmt::print("step {}: sequences {}, new tokens {}: {:.4f} ms\n", label, b.work.sequences,
             b.work.tokens, total * 1e3);
  fmt::print("  {:<20} {:<18} {:>12} {:>6} {:>12} {:>7}  {}\n", "operator", "group", "ms per run",
             "runs", "ms per step", "share", "bound");
  double per_layer = 0;
  for (const OperatorCost& op : b.operators) {
    const double step_s = op.seconds * static_cast<double>(op.runs);
    if (op.per_layer) per_layer += step_s / static_cast<double>(layers);
    fmt::print("  {:<20} {:<18} {:>12.5f} {:>6} {:>12.5f} {:>6.1f}%  {}\n", op.name, op.group,
               op.seconds * 1e3, op.runs, step_s * 1e3, total > 0 ? 100 * step_s / total : 0.0,
               op.bound);
  }
  fmt::print("  one layer: {:.5f} ms (x {} layers); the rest once a step\n\n", per_layer * 1e3,
             layers);
}

void run_cost(const CostOptions& o) {
  if (o.steps.empty())
    throw Error("give at least one --step (e.g. --step prefill=2048 --step decode=32x1024)");
  std::vector<std::vector<EntryShape>> batches;  // every step read before anything is printed
  for (const std::string& text : o.steps) batches.push_back(parse_step_spec(text));
  const ModelSource source = resolve_model(o.model);
  const CostModel model(source.config, load_hardware_profile(o.gpu), o.tp, o.cp);
  nlohmann::json steps = nlohmann::json::array();
  if (!o.json)
    fmt::print("{} on {} (tensor parallel {}, context parallel {}): one GPU's time\n\n",
               source.config.name, model.profile().name, o.tp, o.cp);
  for (std::size_t i = 0; i < batches.size(); ++i) {
    const std::string& text = o.steps[i];
    const StepBreakdown b = model.breakdown(batches[i]);
    if (o.json)
      steps.push_back(step_json(text, b));
    else
      print_step(text, b, source.config.num_hidden_layers);
  }
  if (o.json)
    fmt::print("{}\n", nlohmann::json{{"model", source.config.name},
                                      {"gpu", model.profile().name},
                                      {"tensor_parallel", o.tp},
                                      {"context_parallel", o.cp},
                                      {"steps", steps}}
                           .dump(2));
}

}  // namespace

void register_cost(CLI::App& app) {
  auto o = std::make_shared<CostOptions>();
  auto* sub = app.add_subcommand(
      "cost",
      "What the simulated backend charges for given steps, operator by operator, per layer and "
      "per step");
  sub->add_option("--model", o->model, "Preset name (e.g. llama-2-7b) or model folder")->required();
  sub->add_option("--gpu", o->gpu, "Hardware profile: a name (a100-80gb, h100, ...) or a file")
      ->required();
  sub->add_option("--tp", o->tp, "Tensor parallelism: GPUs sharing each layer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--cp", o->cp, "Context parallelism: groups sharing each sequence's KV")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--step", o->steps,
                  "A step to price: prefill=[Kx]N[@cached], decode=BxL (B sequences after L "
                  "cached tokens), or several joined by commas; repeat for more steps")
      ->required();
  sub->add_flag("--json", o->json, "Print JSON");
  sub->callback([o] { run_cost(*o); });
}

}  // namespace kvlab::cli
