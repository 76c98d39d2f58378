// kvlab serve's stack: stage 2 (serving_stack.cpp) builds the replica as for kvlab run; its
// engine's parts then run under a LiveEngine; stage 3's summaries make the served run's record.
#include "kvlab/experiment/served_experiment.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "stages.hpp"

namespace kvlab {

struct ServedExperiment::Parts {
  ExperimentConfig config;
  ServedModel served;
  std::vector<ReplicaSizing> sizings;
  std::vector<std::unique_ptr<ReplicaStack>> stacks;
  PluginObject<Router> router;         // [cluster] replicas > 1
  PluginObject<Router> decode_router;  // [cluster] prefill_replicas > 0
  std::unique_ptr<LiveCluster> live;   // last: it stops before the stacks it runs go
  std::chrono::steady_clock::time_point start;
  double load_at_start = -1;
};

namespace {

void add_stop_tokens(ModelConfig& model, const std::vector<std::int32_t>& stop_tokens) {
  for (const std::int32_t token : stop_tokens)
    if (std::find(model.eos_token_ids.begin(), model.eos_token_ids.end(), token) ==
        model.eos_token_ids.end())
      model.eos_token_ids.push_back(token);
}

// A disaggregated cluster served live. The simulated backend's steps are paced to its profile,
// and so is the link: a handoff reaches its decode replica when the profile says the transfer
// ends. On the cpu backend the copy out has really happened by the handoff: nothing to wait for.
LiveDisaggregation served_split(const ExperimentConfig& c, std::span<const ReplicaSizing> sizings,
                                Router& decode_router, bool simulated) {
  LiveDisaggregation split;
  split.prefill_replicas = static_cast<std::size_t>(c.prefill_replicas);
  split.decode_router = &decode_router;
  split.transfer_seconds = [](std::int64_t, double) { return 0.0; };
  split.links_contend = simulated;
  if (simulated) {
    ExperimentConfig priced = c;
    priced.clock = EngineClock::paced;
    split.transfer_seconds = transfer_price(priced, sizings);
  }
  return split;
}

}  // namespace

ServedExperiment::ServedExperiment(const ExperimentConfig& c, LiveOptions live,
                                   const std::vector<std::int32_t>& stop_tokens)
    : parts_(std::make_unique<Parts>()) {
  Parts& p = *parts_;
  p.config = c;
  if (c.threads > 0) cpu::set_num_threads(static_cast<int>(c.threads));
  const PluginRegistry registry(plugin_search_path(c));
  const bool simulated = c.backend_kind == BackendKind::simulated;
  check_backend_rules(c, false);
  p.served = load_served_model(c, registry, simulated);
  add_stop_tokens(p.served.config, stop_tokens);
  p.sizings = replica_sizings(c, p.served, simulated);
  const SequenceRules rules = sequence_rules(p.served.config, *p.served.attention);
  p.stacks = make_replicas(c, registry, p.served, p.sizings, rules, nullptr);
  if (c.replicas > 1)
    p.router = registry.create<PluginKind::router>(c.router, c.router_params, PluginContext{});
  std::optional<LiveDisaggregation> split;
  if (c.disaggregated()) {
    p.decode_router =
        registry.create<PluginKind::router>(c.decode_router, c.decode_router_params, {});
    split = served_split(c, p.sizings, *p.decode_router, simulated);
  }
  live.paced = simulated;
  p.load_at_start = machine_load_1m();
  p.start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<LiveEngine>> engines;
  for (const auto& stack : p.stacks) {
    stack->engine.reset();  // the LiveEngine runs its parts
    engines.push_back(std::make_unique<LiveEngine>(*stack->backend, stack->kv(), *stack->scheduler,
                                                   stack->options, live));
  }
  p.live = std::make_unique<LiveCluster>(std::move(engines), p.router.get(), std::move(split));
}

ServedExperiment::~ServedExperiment() = default;

LiveCluster& ServedExperiment::engine() {
  return *parts_->live;
}

const ModelConfig& ServedExperiment::model() const {
  return parts_->served.config;
}

const std::filesystem::path& ServedExperiment::source() const {
  return parts_->served.source;
}

std::int64_t ServedExperiment::kv_slots() const {
  return parts_->sizings.front().slots;
}

RunOutput ServedExperiment::finish() {
  Parts& p = *parts_;
  RunOutput out;
  ClusterResult cluster = p.live->take_result();
  if (cluster.replicas.size() == 1)
    out.engine = std::move(cluster.replicas.front());
  else
    record_cluster(p.config, p.sizings, std::move(cluster), out);
  out.model_name = p.served.config.name;
  out.kv_slots = kv_slots();
  out.workload_description = "served live (kvlab serve)";
  out.weights_description = p.stacks.front()->backend->description();
  const std::optional<CostModel>& cost_model = p.sizings.front().cost_model;
  out.kv_dtype = stored_kv_dtype(p.config, cost_model);
  out.machine_load_1m = p.load_at_start;
  out.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.start).count();
  out.engine_wall_s = out.wall_s;
  summarize_output(p.config, p.stacks, cost_model.has_value(), out);
  return out;
}

}  // namespace kvlab
