// A scheduler's plan is input: plan_problem refuses what apply_plan could not commit, naming
// the entry, and the engine turns a hostile scheduler plugin's plan or throw into one error
// that names the plugin and the step, instead of a crash.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kvlab/engine/engine.hpp"
#include "kvlab/engine/plan_check.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/workload/workload.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

WorkloadRequest request(std::int64_t id, double arrival_s, std::size_t prompt,
                        std::int64_t output) {
  WorkloadRequest r;
  r.id = id;
  r.arrival_s = arrival_s;
  r.prompt.assign(prompt, 7);
  r.output_tokens = output;
  return r;
}

// Requests 0-2 arrive at 0, request 3 at t = 100; the first three have arrived.
struct ArrivedTable {
  std::vector<WorkloadRequest> requests;
  std::unique_ptr<RequestTable> table;
  ArrivedTable() {
    for (int i = 0; i < 4; ++i) requests.push_back(request(i, i == 3 ? 100.0 : 0.0, 8, 4));
    table = std::make_unique<RequestTable>(requests, false);
    for (int i = 0; i < 3; ++i) table->arrive();
  }
};

TEST(PlanCheck, AGoodPlanPasses) {
  ArrivedTable t;
  StepPlan plan;
  plan.work = {{0, 8}, {1, 3}};
  plan.deferred = {{2, "kv_full"}};
  EXPECT_EQ(plan_problem(plan, *t.table), "");
}

TEST(PlanCheck, EveryBrokenEntryIsNamed) {
  ArrivedTable t;
  const std::vector<std::pair<StepPlan, std::string>> cases = {
      {{{}, {{7, 1}}, {}, false}, "gives work to request 7 does not exist (ids are 0 .. 3)"},
      {{{}, {{-1, 1}}, {}, false}, "gives work to request -1 does not exist"},
      {{{}, {{3, 1}}, {}, false}, "gives work to request 3 has not arrived yet"},
      {{{}, {{0, 0}}, {}, false}, "gives request 0 0 new tokens; it has 8 without KV"},
      {{{}, {{0, 9}}, {}, false}, "gives request 0 9 new tokens"},
      {{{}, {{0, 1}, {0, 1}}, {}, false}, "lists request 0 twice in work"},
      {{{{0, PreemptMode::recompute}}, {}, {}, false},
       "preempts request 0, which is waiting, not running"},
      {{{{99, PreemptMode::swap}}, {}, {}, false}, "preempts request 99 does not exist"},
      {{{}, {}, {{5, "kv_full"}}, false}, "defers request 5 does not exist"},
      {{{}, {{1, 1}}, {{1, "kv_full"}}, false},
       "defers request 1 and gives it work in the same plan"},
      {{{}, {}, {{1, std::string_view("x", 300)}}, false},
       "defers request 1 with a reason of 300 bytes (at most 256)"},
  };
  for (const auto& [plan, expected] : cases)
    EXPECT_NE(plan_problem(plan, *t.table).find(expected), std::string::npos)
        << "expected \"" << expected << "\", got \"" << plan_problem(plan, *t.table) << "\"";
}

const PluginRegistry& hostile_registry() {
  static const PluginRegistry registry = [] {
    PluginRegistry r({KVLAB_PLUGIN_DIR});
    r.load_file(std::filesystem::path(KVLAB_TEST_PLUGIN_DIR) /
                "kvlab_plugin_test_hostile_scheduler.so");
    return r;
  }();
  return registry;
}

// Runs 12 requests (more than the pool holds at once) and one arriving much later, request 12,
// with the hostile scheduler doing `defect` at step 2; the engine's error message.
std::string hostile_run_error(const std::string& defect) {
  const ModelConfig model = model_preset("llama2-7b");
  const CostModel cost(model, load_hardware_profile("h200"));
  KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, 256},
              KvStorage::none);
  PluginContext context{&pool, &model, model.max_position_embeddings};
  auto allocator = hostile_registry().create<PluginKind::kv_allocator>(
      "paged", {{"block_size", std::int64_t{16}}}, context);
  auto scheduler = hostile_registry().create<PluginKind::scheduler>(
      "hostile", {{"defect", defect}, {"id", std::int64_t{12}}}, context);
  SimulatedBackend backend(model.vocab_size, model.eos_token_ids);
  EngineOptions options;
  options.rules.context = model.max_position_embeddings;
  options.pool = &pool;
  options.cost_model = &cost;
  options.names.scheduler = "scheduler plugin \"hostile\"";
  std::vector<WorkloadRequest> requests;
  for (int i = 0; i < 13; ++i) requests.push_back(request(i, i == 12 ? 1e6 : 0.0, 40, 8));
  Engine engine(backend, *allocator, *scheduler, options);
  try {
    engine.run(requests);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(PlanCheck, AHostileSchedulerPluginIsAnErrorNamingItNeverACrash) {
  EXPECT_EQ(hostile_run_error("none"), "no error");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"throw_int",
       "step 2: scheduler plugin \"hostile\" threw something that is not a "
       "std::exception"},
      {"throw_std",
       "step 2: scheduler plugin \"hostile\" threw an exception: the plugin's own "
       "failure"},
      {"unknown_id", "returned a plan that gives work to request 1000000 does not exist"},
      {"negative_id", "returned a plan that gives work to request -3 does not exist"},
      {"not_arrived", "returned a plan that gives work to request 12 has not arrived yet"},
      {"zero_tokens", "new tokens; it has 1 without KV"},
      {"duplicate_work", "twice in work"},
      {"preempt_unknown", "preempts request 77777 does not exist"},
      {"preempt_waiting", "which is waiting, not running"},
      {"bad_mode", "with mode 9, neither recompute (0) nor swap (1)"},
      {"defer_unknown", "defers request -1 does not exist"},
  };
  for (const auto& [defect, expected] : cases) {
    const std::string message = hostile_run_error(defect);
    EXPECT_NE(message.find(expected), std::string::npos) << defect << ": " << message;
    EXPECT_NE(message.find("step 2: scheduler plugin \"hostile\""), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace kvlab
