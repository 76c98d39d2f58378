// Scheduler iteration tables (the shape of TensorRT-LLM's capacity-scheduler tests): a mock KV
// allocator with one slot per token, a driver that applies each plan with the engine's apply,
// and for every step the expected set of requests that run, wait, and are preempted.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

#include "kvlab/engine/apply.hpp"
#include "kvlab/scheduler.hpp"
#include "kvlab/workload/workload.hpp"
#include "plugin_registry.hpp"

namespace kvlab {
namespace {

// One slot per token, no fragmentation: free = capacity - held.
class MockAllocator final : public KvAllocator {
 public:
  explicit MockAllocator(std::int64_t capacity) : capacity_(capacity) {}
  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (held_.count(r.sequence) || slots_to_allocate(r) > free()) return std::nullopt;
    held_[r.sequence] = static_cast<std::int64_t>(r.prompt.size());
    return AllocateResult{0};
  }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    if (!held_.count(id) || static_cast<std::int64_t>(tokens.size()) > free()) return false;
    held_[id] += static_cast<std::int64_t>(tokens.size());
    return true;
  }
  void plan_reset() const override {
    plan_free_ = free();
    plan_freed_.clear();
  }
  void plan_free(SequenceId id) const override {
    if (held_.count(id) && plan_freed_.insert(id).second) plan_free_ += held_.at(id);
  }
  bool plan_allocate(const AllocateRequest& r) const override {
    return plan_take(slots_to_allocate(r));
  }
  bool plan_append(SequenceId id, std::int64_t tokens) const override {
    return held_.count(id) && !plan_freed_.count(id) && plan_take(tokens);
  }
  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return static_cast<std::int64_t>(r.prompt.size());
  }
  void free(SequenceId id) override { held_.erase(id); }
  KvView view(SequenceId) const override { return {}; }
  KvAllocatorStats stats() const override {
    KvAllocatorStats s;
    s.capacity = capacity_;
    s.free = free();
    s.used = capacity_ - s.free;
    return s;
  }

 private:
  std::int64_t free() const {
    std::int64_t used = 0;
    for (const auto& [id, n] : held_) used += n;
    return capacity_ - used;
  }
  bool plan_take(std::int64_t slots) const {
    if (slots > plan_free_) return false;
    plan_free_ -= slots;
    return true;
  }
  std::int64_t capacity_;
  std::map<SequenceId, std::int64_t> held_;
  mutable std::int64_t plan_free_ = 0;
  mutable std::set<SequenceId> plan_freed_;
};

struct Spec {
  std::int64_t prompt, output;
  int priority = 0;
  std::int64_t arrival_step = 0;
  std::string tenant = "";
  std::optional<double> ttft_slo_s =
      std::nullopt;  // its deadline: arrival + this, on a clock of 1 s per step
};

// One row per step: which requests computed tokens ("run"), and which were preempted.
struct Row {
  std::set<RequestId> run;
  std::set<RequestId> preempted;
  bool operator==(const Row&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Row& row) {
  os << "run {";
  for (auto id : row.run) os << id << " ";
  os << "} preempted {";
  for (auto id : row.preempted) os << id << " ";
  return os << "}";
}

// Drives the requests with the engine's own apply_plan / apply_tokens (no backend: every
// sampled token is 7, EOS never comes); a request finishes after `output` tokens.
std::vector<Row> drive(const std::vector<Spec>& specs, std::int64_t capacity,
                       const std::function<StepPlan(const SchedulerInput&)>& schedule,
                       int max_steps = 40) {
  MockAllocator kv(capacity);
  std::vector<WorkloadRequest> requests(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    requests[i].arrival_s = static_cast<double>(specs[i].arrival_step);
    requests[i].priority = specs[i].priority;
    requests[i].prompt.assign(static_cast<std::size_t>(specs[i].prompt), 7);
    requests[i].output_tokens = specs[i].output;
    requests[i].tenant = specs[i].tenant;
    requests[i].slo.ttft_s = specs[i].ttft_slo_s;
  }
  RequestTable table(requests, false);
  ApplyOptions options;
  options.rules.context = 1 << 20;
  EventLog log;
  std::vector<Row> table_rows;
  for (int step = 0; step < max_steps && !table.all_done(); ++step) {
    while (table.next_arrival() && table.at(*table.next_arrival()).arrival_s <= step)
      table.arrive();
    const StepPlan plan =
        schedule({table.waiting(), table.running(), &kv, step, static_cast<double>(step)});
    const AppliedPlan applied = apply_plan(plan, step, table, kv, options, log);
    Row row;
    for (const Preemption& p : plan.preempt) row.preempted.insert(p.id);
    for (const ScheduledWork& w : applied.batch) row.run.insert(w.id);
    const std::vector<std::int32_t> sampled(applied.batch.size(), 7);
    apply_tokens(applied, sampled, step, table, kv, options, log);
    table_rows.push_back(row);
  }
  return table_rows;  // apply_plan throws if a plan ever overcommits the allocator
}

auto continuous(ContinuousPolicy policy) {
  return [policy](const SchedulerInput& input) { return schedule_continuous(input, policy); };
}

void expect_table(const std::vector<Row>& actual, const std::vector<Row>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t step = 0; step < expected.size(); ++step)
    EXPECT_EQ(actual[step], expected[step]) << "step " << step;
}

TEST(SchedulerTables, StaticRunsABatchToCompletion) {
  // 0 and 1 form the batch; 2 arrives at step 1 and waits until both are done.
  const std::vector<Spec> specs{{4, 2}, {4, 4}, {4, 1, 0, 1}};
  const auto table =
      drive(specs, 100, [](const SchedulerInput& in) { return schedule_static(in, 2, false); });
  expect_table(table, {{{0, 1}, {}}, {{0, 1}, {}}, {{1}, {}}, {{1}, {}}, {{2}, {}}});
}

TEST(SchedulerTables, FcfsJoinsAtEveryIteration) {
  // 2 joins as soon as it arrives; 3 takes 0's batch slot the step after 0 finishes.
  ContinuousPolicy policy;
  policy.max_batch = 3;
  const std::vector<Spec> specs{{4, 2}, {4, 4}, {4, 3, 0, 1}, {4, 2, 0, 1}};
  const auto table = drive(specs, 100, continuous(policy));
  expect_table(table, {{{0, 1}, {}}, {{0, 1, 2}, {}}, {{1, 2, 3}, {}}, {{1, 2, 3}, {}}});
}

TEST(SchedulerTables, FcfsPreemptsTheLatestWhenKvRunsOut) {
  // 16 slots: both 6-token prompts fit; the decodes then need slots, and 1 (admitted last) is
  // preempted (recompute) to let 0 finish; it comes back when 0 has freed its slots.
  ContinuousPolicy policy;
  const std::vector<Spec> specs{{6, 5}, {6, 5}};
  const auto table = drive(specs, 14, continuous(policy));
  ASSERT_GE(table.size(), 4u);
  expect_table(std::vector<Row>(table.begin(), table.begin() + 4),
               {{{0, 1}, {}}, {{0, 1}, {}}, {{0}, {1}}, {{0}, {}}});
  std::set<RequestId> finished_running;
  for (const auto& row : table) finished_running.insert(row.run.begin(), row.run.end());
  EXPECT_EQ(finished_running, (std::set<RequestId>{0, 1}));
}

TEST(SchedulerTables, PriorityPreemptsLowerPriorityForAHigherOne) {
  // 0 (priority 0) holds the KV; 1 (priority 5) arrives at step 1 and does not fit: 0 is
  // preempted so 1 runs, and 0 resumes when 1 is done.
  ContinuousPolicy policy;
  policy.order = ContinuousPolicy::Order::priority;
  policy.preempt_for_priority = true;
  const std::vector<Spec> specs{{8, 4, 0}, {8, 2, 5, 1}};
  const auto table = drive(specs, 12, continuous(policy));
  expect_table(std::vector<Row>(table.begin(), table.begin() + 4),
               {{{0}, {}}, {{1}, {0}}, {{1}, {}}, {{0}, {}}});
}

TEST(SchedulerTables, ChunkedPrefillSplitsPromptsAroundDecodes) {
  // Budget 4 tokens per step: 0 decodes (1 token) while 1's 9-token prompt goes 3 + 3 + 3.
  ContinuousPolicy policy;
  policy.chunked_prefill = true;
  policy.max_tokens_per_step = 4;
  const std::vector<Spec> specs{{2, 5}, {9, 1, 0, 1}};
  const auto table = drive(specs, 100, continuous(policy));
  expect_table(table, {{{0}, {}}, {{0, 1}, {}}, {{0, 1}, {}}, {{0, 1}, {}}, {{0}, {}}});
}

TEST(SchedulerTables, SjfOracleAdmitsTheShortestFirst) {
  ContinuousPolicy policy;
  policy.order = ContinuousPolicy::Order::shortest_remaining;
  policy.max_batch = 1;
  const std::vector<Spec> specs{{2, 3}, {2, 1}, {2, 2}};
  const auto table = drive(specs, 100, continuous(policy));
  expect_table(table, {{{1}, {}}, {{2}, {}}, {{2}, {}}, {{0}, {}}, {{0}, {}}, {{0}, {}}});
}

TEST(SchedulerTables, TokenBudgetHoldsAndDeferralsHaveReasons) {
  ContinuousPolicy policy;
  policy.max_tokens_per_step = 10;
  MockAllocator kv(1000);
  std::vector<RequestState> states(3);
  std::vector<const RequestState*> waiting;
  for (int i = 0; i < 3; ++i) {
    RequestState& r = states[static_cast<std::size_t>(i)];
    r.id = i;
    r.prompt_tokens = 6;
    r.tokens.assign(6, 1);
    r.max_new_tokens = 4;
    waiting.push_back(&r);
  }
  const StepPlan plan = schedule_continuous({waiting, {}, &kv, 0}, policy);
  ASSERT_EQ(plan.work.size(), 1u);  // 6 + 6 > 10
  EXPECT_EQ(plan.work[0].id, 0);
  EXPECT_EQ(plan.work[0].new_tokens, 6);
  // Request 1 is refused for the budget; 2 waits behind it without being listed.
  ASSERT_EQ(plan.deferred.size(), 1u);
  EXPECT_EQ(plan.deferred[0].id, 1);
  EXPECT_EQ(plan.deferred[0].reason, "token_budget");
}

// Speculative decoding: a decode with proposals is granted its newest token and as many of them
// as the token budget leaves (decodes first, in running order), and its KV operation is planned
// with a slot for each: with too few free slots it does not fit and the decode is preempted.
TEST(SchedulerTables, ADecodeVerifiesTheProposalsTheTokenBudgetLeaves) {
  const auto running_decodes = [](std::vector<RequestState>& states, MockAllocator& kv) {
    std::vector<const RequestState*> running;
    for (std::size_t i = 0; i < states.size(); ++i) {
      RequestState& r = states[i];
      r.id = static_cast<RequestId>(i);
      r.prompt_tokens = 8;
      r.tokens.assign(10, 1);  // 8 prompt tokens, 2 generated: the newest has no KV
      r.computed = r.allocated = 9;
      r.max_new_tokens = 20;
      r.status = RequestStatus::running;
      r.admitted_step = static_cast<std::int64_t>(i);
      EXPECT_TRUE(kv.allocate({r.id, std::span(r.tokens).first(9), 30, nullptr}));
      running.push_back(&r);
    }
    return running;
  };
  ContinuousPolicy policy;
  policy.max_tokens_per_step = 6;
  MockAllocator kv(100);
  std::vector<RequestState> states(2);
  const auto running = running_decodes(states, kv);
  states[0].proposed = {1, 2, 3, 4};
  states[1].proposed = {5, 6};
  ASSERT_EQ(states[0].schedulable_tokens(), 5);
  const StepPlan plan = schedule_continuous({{}, running, &kv, 0}, policy);
  ASSERT_EQ(plan.work.size(), 2u);
  EXPECT_EQ(plan.work[0].new_tokens, 5);  // its newest and its 4 proposals
  EXPECT_EQ(plan.work[1].new_tokens, 1);  // the budget's last token: its newest only
  EXPECT_TRUE(plan.preempt.empty());

  // 18 slots held, 3 free: the first decode's 5 slots do not fit, so the last admitted gives
  // way; then they do.
  MockAllocator tight(21);
  std::vector<RequestState> more(2);
  const auto both = running_decodes(more, tight);
  more[0].proposed = {1, 2, 3, 4};
  policy.max_tokens_per_step = 100;
  const StepPlan squeezed = schedule_continuous({{}, both, &tight, 0}, policy);
  ASSERT_EQ(squeezed.preempt.size(), 1u);
  EXPECT_EQ(squeezed.preempt[0].id, 1);
  ASSERT_EQ(squeezed.work.size(), 1u);
  EXPECT_EQ(squeezed.work[0].new_tokens, 5);
}

// A plugin's own admission order on top of the shared algorithm: longest prompt first.
TEST(SchedulerTables, PolicyHooksBringTheirOwnAdmissionOrder) {
  ContinuousPolicy policy;
  policy.max_batch = 1;
  PolicyHooks hooks;
  hooks.admission_order = [](const RequestState& a, const RequestState& b) {
    return a.prompt_tokens > b.prompt_tokens;
  };
  const std::vector<Spec> specs{{2, 1}, {6, 1}, {4, 1}};
  const auto table = drive(
      specs, 100, [&](const SchedulerInput& in) { return schedule_continuous(in, policy, hooks); });
  expect_table(table, {{{1}, {}}, {{2}, {}}, {{0}, {}}});
  // Without the hook: arrival order.
  expect_table(drive(specs, 100, continuous(policy)), {{{0}, {}}, {{1}, {}}, {{2}, {}}});
}

// ... and its own victim: the request with the highest id gives way first, whoever came last.
TEST(SchedulerTables, PolicyHooksBringTheirOwnVictimChoice) {
  ContinuousPolicy policy;
  PolicyHooks hooks;
  hooks.victim_order = [](const RequestState& a, const RequestState& b) { return a.id < b.id; };
  // 14 slots: three 4-token prompts fit (12); at step 1 each decode needs one more slot and
  // only two are free, so when 2 asks someone else must give way: the hook picks 0 (lowest id),
  // the default the latest admitted other than 2 itself, 1.
  const std::vector<Spec> specs{{4, 4}, {4, 4}, {4, 4}};
  const auto with_hook = drive(
      specs, 14, [&](const SchedulerInput& in) { return schedule_continuous(in, policy, hooks); });
  const auto without = drive(specs, 14, continuous(policy));
  ASSERT_GE(with_hook.size(), 2u);
  ASSERT_GE(without.size(), 2u);
  EXPECT_EQ(with_hook[1].preempted, (std::set<RequestId>{0}));
  EXPECT_EQ(with_hook[1].run, (std::set<RequestId>{1, 2}));
  EXPECT_EQ(without[1].preempted, (std::set<RequestId>{1}));
  EXPECT_EQ(without[1].run, (std::set<RequestId>{0, 2}));
}

// A scheduler plugin of this build, driven like the tables above.
auto plugin(const std::string& name, std::map<std::string, ParamValue, std::less<>> params) {
  auto scheduler = std::make_shared<PluginObject<Scheduler>>(
      test::plugin_registry().create<PluginKind::scheduler>(name, params, PluginContext{}));
  return [scheduler](const SchedulerInput& in) { return (*scheduler)->schedule(in); };
}

// edf admits by deadline (arrival + TTFT SLO). 0 runs steps 0-3 alone (max_batch 1) while 1
// (due at 1 s) and 2 (due at 6 s) wait; at step 4, 1 is late: "last" serves 2 first, which can
// still make it, "keep" (plain EDF) serves 1.
TEST(SchedulerTables, EdfAdmitsTheEarliestDeadlineAndTheLateLast) {
  const std::vector<Spec> specs{
      {2, 4, 0, 0, "", 0.5}, {2, 2, 0, 0, "", 1.0}, {2, 2, 0, 0, "", 6.0}};
  const auto late_last = drive(specs, 100, plugin("edf", {{"max_batch", std::int64_t{1}}}));
  expect_table(late_last, {{{0}, {}},
                           {{0}, {}},
                           {{0}, {}},
                           {{0}, {}},  // 0 first: due at 0.5 s
                           {{2}, {}},
                           {{2}, {}},
                           {{1}, {}},
                           {{1}, {}}});
  const auto keep = drive(
      specs, 100, plugin("edf", {{"max_batch", std::int64_t{1}}, {"late", std::string("keep")}}));
  expect_table(
      keep,
      {{{0}, {}}, {{0}, {}}, {{0}, {}}, {{0}, {}}, {{1}, {}}, {{1}, {}}, {{2}, {}}, {{2}, {}}});
  // Without deadlines it is fcfs.
  const std::vector<Spec> none{{2, 1}, {2, 1}, {2, 1}};
  expect_table(drive(none, 100, plugin("edf", {{"max_batch", std::int64_t{1}}})),
               {{{0}, {}}, {{1}, {}}, {{2}, {}}});
}

// vtc admits from the tenant with the least service so far (prompt tokens x 1 + output tokens
// x 2; ties: the earliest request): a's three requests came first, yet b's two alternate with
// them. Each request is 2 prompt tokens and 1 output token (4 units of service).
TEST(SchedulerTables, VtcAlternatesBetweenTenantsWhereFcfsServesArrivalOrder) {
  const std::vector<Spec> specs{{2, 1, 0, 0, "a"},
                                {2, 1, 0, 0, "a"},
                                {2, 1, 0, 0, "a"},
                                {2, 1, 0, 0, "b"},
                                {2, 1, 0, 0, "b"}};
  const auto table = drive(specs, 100, plugin("vtc", {{"max_batch", std::int64_t{1}}}));
  expect_table(table, {{{0}, {}}, {{3}, {}}, {{1}, {}}, {{4}, {}}, {{2}, {}}});
  expect_table(drive(specs, 100, plugin("fcfs", {{"max_batch", std::int64_t{1}}})),
               {{{0}, {}}, {{1}, {}}, {{2}, {}}, {{3}, {}}, {{4}, {}}});
}

// The counter lift: b was served once (4) and went idle while a reached 12; when b's next three
// requests arrive at step 4 its counter is lifted to a's, so the two alternate instead of b
// catching up on the service it did not ask for.
TEST(SchedulerTables, VtcLiftsATenantThatComesBackToTheBackloggedMinimum) {
  std::vector<Spec> specs;
  for (int i = 0; i < 6; ++i) specs.push_back({2, 1, 0, 0, "a"});  // ids 0-5
  specs.push_back({2, 1, 0, 0, "b"});                              // 6
  for (int i = 0; i < 3; ++i) specs.push_back({2, 1, 0, 4, "b"});  // ids 7-9, at step 4
  const auto table = drive(specs, 100, plugin("vtc", {{"max_batch", std::int64_t{1}}}));
  const std::vector<RequestId> order{0, 6, 1, 2, 3, 7, 4, 8, 5, 9};
  ASSERT_EQ(table.size(), order.size());
  for (std::size_t step = 0; step < order.size(); ++step)
    EXPECT_EQ(table[step].run, (std::set<RequestId>{order[step]})) << "step " << step;
}

}  // namespace
}  // namespace kvlab
