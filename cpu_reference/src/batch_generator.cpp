#include "kvlab/cpu_reference/batch_generator.hpp"

#include <fmt/format.h>

#include "kvlab/engine/engine.hpp"
#include "kvlab/error.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab::cpu {
namespace {

PluginObject<AttentionVariant> make_attention(const PluginRegistry& registry,
                                              const BatchSetup& setup, const ModelConfig& model) {
  PluginContext context;
  context.model = &model;
  auto attention = registry.create<PluginKind::attention_variant>(setup.attention,
                                                                  setup.attention_params, context);
  if (const std::string problem = attention->check(model); !problem.empty())
    throw Error(
        fmt::format("attention \"{}\" cannot run {}: {}", setup.attention, model.name, problem));
  return attention;
}

KvPoolShape pool_shape(const ModelConfig& c, std::int64_t slots) {
  return {c.num_hidden_layers, c.cache_kv_heads(), c.cache_head_dim(), slots};
}

SequenceRules rules_for(const ModelConfig& model, const AttentionVariant& attention,
                        std::int64_t max_seq_len) {
  SequenceRules rules = sequence_rules(model, attention);
  if (max_seq_len > 0) rules.context = max_seq_len;
  return rules;
}

// No scheduling policy at all: a request is admitted the step it arrives (while the KV pool has
// room), and every running request computes its next prompt chunk (`chunk` tokens, 0 = all) or
// its next token.
class EveryoneRuns final : public Scheduler {
 public:
  explicit EveryoneRuns(std::int64_t chunk) : chunk_(chunk) {}
  StepPlan schedule(const SchedulerInput& input) override {
    StepPlan plan;
    plan_step_begin(*input.kv, input.running);
    for (const RequestState* r : input.running)
      if (plan_work(*input.kv, *r)) plan.work.push_back({r->id, tokens_for(*r)});
    for (const RequestState* r : input.waiting) {
      if (!plan_work(*input.kv, *r)) {  // the pool is full: the rest wait behind it
        plan.deferred.push_back({r->id, "kv_full"});
        break;
      }
      plan.work.push_back({r->id, tokens_for(*r)});
    }
    return plan;
  }

 private:
  std::int64_t tokens_for(const RequestState& r) const {
    return chunk_ > 0 ? std::min(chunk_, r.new_tokens()) : r.new_tokens();
  }
  std::int64_t chunk_;
};

}  // namespace

BatchGenerator::BatchGenerator(const LlamaWeights& checkpoint, const PluginRegistry& registry,
                               const BatchSetup& setup)
    : attention_(make_attention(registry, setup, checkpoint.config)),
      weights_(convert_kv_heads(checkpoint, attention_->kv_heads(checkpoint.config))),
      pool_(pool_shape(weights_.config, setup.pool_slots), KvStorage::none),
      rules_(rules_for(weights_.config, *attention_, setup.max_seq_len)) {
  const ModelWeightsView view = weights_view(weights_, setup.source.string());
  PluginContext context;
  context.pool = &pool_;
  context.model = &weights_.config;
  context.max_seq_len = rules_.context;
  context.weights = &view;
  context.window = rules_.window.value_or(0);
  backend_ = registry.create<PluginKind::backend>(
      "cpu", {{"weights", setup.weights}, {"activations", setup.activations}}, context);
  allocator_ =
      registry.create<PluginKind::kv_allocator>(setup.allocator, setup.allocator_params, context);
}

// The engine, with the everyone-runs scheduler and a clock whose steps last one second, so
// a request's arrival_step is its arrival time.
std::vector<BatchResult> BatchGenerator::run(const std::vector<BatchRequest>& requests,
                                             const BatchOptions& options) {
  std::vector<WorkloadRequest> workload(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    validate_sampling_params(requests[i].sampling);
    if (requests[i].arrival_step < 0)
      throw Error(fmt::format("request {}: arrival_step must be >= 0", i));
    workload[i].id = static_cast<std::int64_t>(i);
    workload[i].arrival_s = static_cast<double>(requests[i].arrival_step);
    workload[i].prompt = requests[i].prompt;
    workload[i].output_tokens = requests[i].sampling.max_tokens;
    workload[i].sampling = requests[i].sampling;
  }
  std::vector<BatchResult> results(requests.size());
  EngineOptions engine_options;
  engine_options.clock = EngineClock::steps;  // arrival_s counts steps
  engine_options.rules = rules_;
  if (options.record_logits)
    engine_options.observers.on_logits = [&](RequestId id, std::span<const float> row) {
      results[static_cast<std::size_t>(id)].logits.emplace_back(row.begin(), row.end());
    };
  if (options.on_token)
    engine_options.observers.on_token = [&](RequestId id, std::int32_t token,
                                            const GeneratedLogprobs*) {
      options.on_token(static_cast<std::size_t>(id), token);
    };
  EveryoneRuns scheduler(options.prefill_chunk);
  Engine engine(*backend_, *allocator_, scheduler, engine_options);
  const EngineResult run = engine.run(workload);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const RequestTimeline& timeline = run.requests[i];
    if (timeline.rejected) throw Error(fmt::format("request {}: {}", i, timeline.reject_reason));
    results[i].tokens = run.tokens[i];
    results[i].logprobs = run.logprobs[i];
    results[i].cached_prompt_tokens = timeline.prefix_hit_tokens;
    results[i].finish_reason = timeline.finish_reason == "eos" ? FinishReason::eos
                               : timeline.finish_reason == "context_full"
                                   ? FinishReason::context_full
                                   : FinishReason::max_tokens;
  }
  return results;
}

}  // namespace kvlab::cpu
