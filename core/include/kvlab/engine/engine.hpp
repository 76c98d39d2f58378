#pragma once
// The engine: the step loop of a serving system. Engine::step() is a fixed pipeline:
//   0. arrive = arrivals join the waiting queue (or are rejected), cancellations take effect
//   1. plan   = Scheduler::schedule(read-only request table, read-only allocator)
//   2. apply  = apply_plan(): preemptions, admissions, decode slots (the only mutator)
//   3. run    = Backend::forward over the mixed batch, priced for the clock (StepPricer)
//   4. sample = each request with its own seeded sampler (pick_tokens)
//   5. update = apply_tokens(): tokens appended, stop rules, finished KV freed; step record
// Features that need a say in the step (speculative decoding, a KV policy, a static batch's
// padding, kvlab view's frames, your own) are step extensions, called at documented points of
// it (kvlab/engine/step_extension.hpp): the engine names none of them.
// Requests that can never fit (prompt + max tokens beyond the context or the KV capacity) are
// rejected with a reason at arrival: submitted = finished + rejected, always.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/admission.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/engine_result.hpp"
#include "kvlab/engine/events.hpp"
#include "kvlab/engine/frames.hpp"
#include "kvlab/engine/pick_tokens.hpp"
#include "kvlab/engine/plan_check.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/engine/step_pricing.hpp"
#include "kvlab/engine/submission.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_policy.hpp"
#include "kvlab/proposer.hpp"
#include "kvlab/router.hpp"
#include "kvlab/scheduler.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/speculation/speculation.hpp"

namespace kvlab {

struct EngineOptions {
  EngineClock clock = EngineClock::virtual_clock;
  // Prices every step: the virtual and offline clocks need one (a hardware profile's roofline,
  // kvlab/sim/cost_model.hpp); with the measured clock its prediction is recorded next to the
  // measured time (predicted_s) to validate a calibration.
  const CostModel* cost_model = nullptr;
  SequenceRules rules;                 // from sequence_rules(model, attention)
  std::int64_t max_idle_steps = 1000;  // steps without progress before giving up (a scheduler bug)
  // Swap preemption: KV moves to a host swap pool of `swap_slots` tokens; the copies' time is
  // added to the step (the cost model's link on virtual clocks, as measured otherwise).
  KvPool* pool = nullptr;
  std::int64_t swap_slots = 0;
  // The allocator keeps KV tiers (PluginContext::tiers): each step's tier copies, read from its
  // stats, are priced like the swap copies. Off: no stats read for them (static and dynamic
  // allocators' stats walk their sequences).
  bool kv_tiers = false;
  // on_logits: each sampled row of logits, for tests and tools that keep logits
  // (cpu::BatchGenerator); with it set the backend is asked for logits (no token choices), and
  // a backend without logits (the simulated one) never calls it. on_token: each token as soon
  // as it is chosen (streaming).
  TokenObservers observers;
  // Which cached positions each sequence keeps (kvlab/kv_policy.hpp), or none: every position.
  // It needs an allocator that drops positions (paged, without prefix caching).
  KvPolicy* kv_policy = nullptr;
  // Speculative decoding (kvlab/speculation/speculation.hpp): off unless speculation.tokens > 0.
  // Not with a KV policy (a rollback cannot restore dropped positions).
  SpeculationOptions speculation;
  // The proposer plugin's object (kvlab/proposer.hpp), or null: the engine makes the built-in
  // one speculation.proposer names (prompt_lookup or simulated).
  Proposer* proposer = nullptr;
  // A draft model's price per step (the cost model of the draft's config on the same hardware),
  // or null: proposals cost nothing on virtual clocks. The proposals of a step then cost as many
  // sequential draft decode steps of the decodes as the longest proposal.
  const CostModel* draft_cost_model = nullptr;
  // Step frames for kvlab view (kvlab/engine/frames.hpp): each step's batch and the pool slot by
  // slot, about this many entries at most (the frames thinned to every 2nd, 4th, ... step past
  // it); 0: none (EngineResult::frames stays empty).
  std::int64_t frame_budget = 0;
  FrameObserver* frame_observer = nullptr;  // frames on demand, beside those (not owned)
  // More step extensions (kvlab/engine/step_extension.hpp), called after the engine's own, in
  // this order; not owned, each used by one engine's runs at a time.
  std::vector<StepExtension*> extensions;
  // Who the engine calls, as its errors name them: e.g. `scheduler plugin "fcfs" (FILE)`.
  struct PluginNames {
    std::string scheduler = "the scheduler", allocator = "the KV allocator",
                backend = "the backend", kv_policy = "the KV policy", proposer = "the proposer";
  } names;
};

// At most about how many steps a run of these requests takes (a token for one request a step,
// and a step to prefill each): the room Engine::reserve_steps makes, not a limit.
std::int64_t expected_steps(std::span<const Submission> requests);

class Engine {
 public:
  Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler, EngineOptions options);
  ~Engine();
  // Runs every request to the end. Throws kvlab::Error only for engine-level faults (a
  // scheduler that stalls, a backend returning NaN); bad requests are rejected and reported.
  EngineResult run(const std::vector<Submission>& requests);

  // The same, step by step: start(), step() until it returns false, take_result().
  // `requests` must outlive the run.
  void start(const std::vector<Submission>& requests);
  // Room for `steps` step records, made before a long run: the records still grow past it, but
  // a run of a million steps no longer copies (and first-touches) its records each time they
  // double. Untouched room costs address space only. start() reserves for its own requests.
  void reserve_steps(std::int64_t steps);
  bool step();  // receive arrivals, then idle or plan, apply, run, sample, update
  EngineResult take_result();

  // While a run goes on (after start()): one more request, arriving at its arrival_s (a
  // cluster's router hands it over); its id in this engine. `request` must outlive the run.
  RequestId submit(const Submission& request);
  // Disaggregated prefill and decode (RequestTable::submit_for_prefill / submit_with_kv): a
  // request this engine only prefills, handing its KV off with its first token; and one that
  // arrives with handed-off KV to decode. take_handoffs() returns the handoffs since the last
  // call, each stamped with this engine's clock at the end of the step that made it.
  RequestId submit_for_prefill(const Submission& request);
  RequestId submit_with_kv(const Submission& request, KvHandoff handoff);
  std::vector<KvHandoff> take_handoffs() { return std::move(handoffs_); }
  double now() const;
  // While a run goes on: the request's client went away. At the start of the next step it
  // finishes with reason "cancelled" (an event and its timeline say so) and its KV, in the pool
  // or swapped out, is freed; one not arrived yet is cancelled as it arrives. False for an id
  // this run does not know or one already finished or rejected (nothing to do).
  bool cancel(RequestId id);

  bool has_work() const;  // a request waits, runs or is still to arrive
  // The run's events so far (admit, finish, reject, ...), in order.
  const std::vector<EngineEvent>& events() const { return log_.events(); }
  ReplicaLoad load() const;  // what a router sees of this engine now
  // The run's step records so far (the last: the allocator's numbers after the latest step).
  const std::vector<StepRecord>& steps() const { return result_.steps; }

 private:
  std::optional<bool> begin_step(StepState& state);
  void receive_arrivals();
  void apply_cancels(StepState& state);
  AppliedPlan plan_and_apply(bool& fragmentation_blocked);
  bool retry_or_idle(StepState& state);
  void idle_step();
  std::vector<BatchEntry> batch_entries(const AppliedPlan& applied) const;
  std::vector<std::int32_t> run_batch(StepState& state, AppliedPlan& applied);
  StepTiming price(StepState& state, std::span<const BatchEntry> requests);
  void update(StepState& state, std::span<const std::int32_t> sampled);
  bool reads_kv_slots() const;
  std::int64_t kivi_residual_bytes() const;
  void record_step(StepRecord record, bool fragmentation_blocked);

  Backend& backend_;
  KvAllocator& allocator_;
  Scheduler& scheduler_;
  EngineOptions options_;
  ApplyOptions apply_options_;
  StepPricer pricer_;
  AdmissionCheck admission_;  // rejects at arrival the requests that could never run
  std::unique_ptr<RequestTable> table_;
  PlanChecker plan_checker_;  // every plan the scheduler returns, before apply_plan
  std::unique_ptr<Clock> clock_;
  EventLog log_;
  EngineResult result_;
  std::int64_t step_ = 0, idle_steps_ = 0, evictions_seen_ = 0;
  std::chrono::steady_clock::time_point step_start_;
  std::vector<KvHandoff> handoffs_;         // not yet taken
  std::vector<RequestId> pending_cancels_;  // cancel()ed, applied at the next step
  // The run's step extensions: the engine's own (engine_extensions.cpp), then the options'.
  std::vector<std::unique_ptr<StepExtension>> own_extensions_;
  std::vector<StepExtension*> extensions_;
  std::vector<EntryShape> priced_rows_;  // this step's rows the extensions priced (kept: reused)
};

}  // namespace kvlab
