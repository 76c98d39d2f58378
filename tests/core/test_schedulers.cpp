// Scheduler iteration tables (the shape of TensorRT-LLM's capacity-scheduler tests): a mock KV
// allocator with one slot per token, a driver that applies each plan like the engine does,
// and for every step the expected set of requests that run, wait, and are preempted.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

#include "kvlab/scheduler.hpp"

namespace kvlab {
namespace {

// One slot per token, no fragmentation: free = capacity - held.
class MockAllocator final : public KvAllocator {
 public:
  explicit MockAllocator(std::int64_t capacity) : capacity_(capacity) {}
  bool can_allocate(const AllocateRequest& r) const override {
    return slots_to_allocate(r) <= free();
  }
  std::optional<AllocateResult> allocate(const AllocateRequest& r) override {
    if (!can_allocate(r)) return std::nullopt;
    held_[r.sequence] = static_cast<std::int64_t>(r.prompt.size());
    return AllocateResult{0};
  }
  std::int64_t slots_to_allocate(const AllocateRequest& r) const override {
    return static_cast<std::int64_t>(r.prompt.size());
  }
  std::int64_t slots_to_append(SequenceId, std::int64_t tokens) const override { return tokens; }
  std::int64_t slots_held(SequenceId id) const override {
    return held_.count(id) ? held_.at(id) : 0;
  }
  bool can_append(SequenceId, std::int64_t tokens) const override { return tokens <= free(); }
  bool append(SequenceId id, std::span<const std::int32_t> tokens) override {
    if (!can_append(id, static_cast<std::int64_t>(tokens.size()))) return false;
    held_[id] += static_cast<std::int64_t>(tokens.size());
    return true;
  }
  void mark_computed(SequenceId, std::int64_t) override {}
  void release_before(SequenceId, std::int64_t) override {}
  bool fork(SequenceId, SequenceId) override { return false; }
  void free(SequenceId id) override { held_.erase(id); }
  bool contains(SequenceId id) const override { return held_.count(id) > 0; }
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
  std::int64_t capacity_;
  std::map<SequenceId, std::int64_t> held_;
};

struct Spec {
  std::int64_t prompt, output;
  int priority = 0;
  std::int64_t arrival_step = 0;
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

// Applies plans like the engine: admission allocates the whole sequence so far, a decode
// appends one slot, a request finishes after `output` tokens and frees its slots.
std::vector<Row> drive(const std::vector<Spec>& specs, std::int64_t capacity,
                       const std::function<StepPlan(const SchedulerInput&)>& schedule,
                       int max_steps = 40) {
  MockAllocator kv(capacity);
  struct State {
    ScheduledRequest view;
    bool running = false, done = false;
  };
  std::vector<State> states(specs.size());
  std::vector<std::vector<std::int32_t>> ids(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    states[i].view.id = static_cast<RequestId>(i);
    states[i].view.arrival_s = static_cast<double>(specs[i].arrival_step);
    states[i].view.priority = specs[i].priority;
    states[i].view.tokens = specs[i].prompt;
    states[i].view.max_new_tokens = specs[i].output;
    states[i].view.oracle_remaining = specs[i].output;
  }
  std::vector<Row> table;
  for (int step = 0; step < max_steps; ++step) {
    std::vector<ScheduledRequest> waiting, running;
    bool all_done = true;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      auto& s = states[i];
      all_done &= s.done;
      ids[i].assign(static_cast<std::size_t>(s.view.tokens), 7);
      s.view.token_ids = ids[i];
      s.view.oracle_remaining = specs[i].output - s.view.generated;
      if (s.done || specs[i].arrival_step > step) continue;
      (s.running ? running : waiting).push_back(s.view);
    }
    if (all_done) break;
    const StepPlan plan = schedule({waiting, running, &kv, step});
    Row row;
    for (RequestId id : plan.preempt) {
      auto& s = states[static_cast<std::size_t>(id)];
      kv.free(id);
      s.running = false;
      s.view.computed_tokens = 0;
      row.preempted.insert(id);
    }
    for (RequestId id : plan.admit) {
      auto& s = states[static_cast<std::size_t>(id)];
      std::vector<std::int32_t> prompt(static_cast<std::size_t>(s.view.tokens), 7);
      EXPECT_TRUE(kv.allocate({id, prompt, 0}).has_value())
          << "step " << step << " admits " << id << " beyond capacity";
      s.running = true;
      s.view.admitted_step = step;
    }
    auto compute = [&](RequestId id, std::int64_t tokens) {
      auto& s = states[static_cast<std::size_t>(id)];
      row.run.insert(id);
      s.view.computed_tokens += tokens;
      if (s.view.computed_tokens == s.view.tokens) {  // sample one token
        ++s.view.generated;
        if (s.view.generated == specs[static_cast<std::size_t>(id)].output) {
          kv.free(id);
          s.done = true;
          s.running = false;
        } else {
          ++s.view.tokens;
        }
      }
    };
    for (RequestId id : plan.decode) {
      const std::int32_t token = 7;
      EXPECT_TRUE(kv.append(id, std::span<const std::int32_t>(&token, 1)))
          << "step " << step << " decode " << id;
      compute(id, 1);
    }
    for (const auto& chunk : plan.prefill) compute(chunk.id, chunk.tokens);
    table.push_back(row);
  }
  return table;
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
      drive(specs, 100, [](const SchedulerInput& in) { return schedule_static(in, 2); });
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
  std::vector<ScheduledRequest> waiting(3);
  std::vector<std::vector<std::int32_t>> ids(3, std::vector<std::int32_t>(6, 1));
  for (int i = 0; i < 3; ++i) {
    waiting[static_cast<std::size_t>(i)].id = i;
    waiting[static_cast<std::size_t>(i)].tokens = 6;
    waiting[static_cast<std::size_t>(i)].max_new_tokens = 4;
    waiting[static_cast<std::size_t>(i)].token_ids = ids[static_cast<std::size_t>(i)];
  }
  const StepPlan plan = schedule_continuous({waiting, {}, &kv, 0}, policy);
  EXPECT_EQ(plan.admit, (std::vector<RequestId>{0}));  // 6 + 6 > 10
  ASSERT_EQ(plan.deferred.size(), 2u);
  EXPECT_EQ(plan.deferred[0].reason, "token_budget");
  EXPECT_EQ(plan.deferred[1].reason, "behind_blocked_request");
}

}  // namespace
}  // namespace kvlab
