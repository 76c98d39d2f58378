#pragma once
// The engine: the step loop of a serving system. Engine::step() is, in order,
//   1. plan   = Scheduler::schedule(read-only request table, read-only allocator)
//   2. apply  = apply_plan(): preemptions, admissions, decode slots (the only mutator)
//   3. run    = Backend::forward over the mixed batch
//   4. sample = each request with its own seeded sampler
//   5. update = apply_tokens(): tokens appended, stop rules, finished KV freed; step record
// Requests that can never fit (prompt + max tokens beyond the context or the KV capacity) are
// rejected with a reason at arrival: submitted = finished + rejected, always.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvlab/backend.hpp"
#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/clock.hpp"
#include "kvlab/engine/events.hpp"
#include "kvlab/engine/frames.hpp"
#include "kvlab/engine/kv_policy_runner.hpp"
#include "kvlab/engine/metrics.hpp"
#include "kvlab/engine/pick_tokens.hpp"
#include "kvlab/engine/plan_check.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/engine/static_padding.hpp"
#include "kvlab/engine/workload.hpp"
#include "kvlab/kv_allocator.hpp"
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
  // Who the engine calls, as its errors name them: e.g. `scheduler plugin "fcfs" (FILE)`.
  struct PluginNames {
    std::string scheduler = "the scheduler", allocator = "the KV allocator",
                backend = "the backend", kv_policy = "the KV policy", proposer = "the proposer";
  } names;
};

struct StepRecord {
  std::int64_t step = 0;
  std::int64_t replica = 0;  // in a cluster: the replica that ran it
  double start_s = 0, duration_s = 0, measured_forward_s = 0;
  double measured_step_s = 0;  // plan + apply + forward, as it really took
  double predicted_s = 0;      // the cost model's prediction (0 without one)
  StepWork work;               // what the cost model priced: FLOPs and bytes (zeros without one)
  std::int64_t batch = 0, prefill_tokens = 0, decode_tokens = 0, preempted = 0;
  // Speculative decoding: the entries that verified proposals, the proposed tokens they held,
  // how many the target accepted, and the proposer's time before the step (measured; the
  // measured clock adds it to the step), and the draft model's steps' price (draft_cost_model;
  // the virtual clocks add it).
  std::int64_t verify_entries = 0, proposed_tokens = 0, accepted_tokens = 0;
  double propose_s = 0, predicted_propose_s = 0;
  std::int64_t waiting = 0, running = 0;
  // Finished requests a static batch still carries (StepPlan::pad_finished): rows priced this
  // step, and the KV slots their views hold after it (a shared prefix block in each view).
  std::int64_t padding = 0, padding_slots = 0;
  std::int64_t swap_bytes = 0, swap_transfers = 0;  // KV copied to and from the host swap pool
  // The step's time spent on KV tier copies: what the clock charged beyond the compute (virtual:
  // the copies' price, or its excess over the compute when they overlap; measured: their time).
  double tier_s = 0;
  // External fragmentation that cost something: kv.unusable_free on a step where a request was
  // refused for memory although the free slots in all would have held it (0 on every other
  // step: holes that block nobody are not waste).
  std::int64_t blocking_unusable_free = 0;
  // A KIVI pool's open groups after the step: fp16 K/V beside the pool's slots, up to 32 tokens
  // per running sequence (KvPool::open_group_bytes); 0 for the other dtypes.
  std::int64_t kv_residual_bytes = 0;
  KvAllocatorStats kv;
};

// One speculative verify: which step, which request, how many proposals it checked, how many of
// them the target accepted (verifies.csv; a simulated drafter can replay them: accept_trace).
struct VerifyRecord {
  std::int64_t step = 0;
  RequestId request = 0;
  std::int64_t proposed = 0, accepted = 0;
};

struct EngineResult {
  std::vector<RequestTimeline> requests;          // in submission order
  std::vector<std::vector<std::int32_t>> tokens;  // generated tokens per request
  // Per request, one entry per generated token when its sampling asked for log-probabilities
  // (SamplingParams::logprobs >= 0), computed by the backend where it picks the tokens (only
  // they cross to the host), else from the logits on the host; empty for the other requests.
  std::vector<std::vector<GeneratedLogprobs>> logprobs;
  std::vector<StepRecord> steps;
  std::vector<EngineEvent> events;     // admit / defer / preempt / swap / finish / reject / evict
  std::vector<VerifyRecord> verifies;  // speculative decoding's, in step order (a replica's ids)
  std::vector<StepFrame> frames;       // EngineOptions::frame_budget's, in step order
  std::int64_t frame_stride = 1;       // a frame every this many steps
  double duration_s = 0;
};

// At most about how many steps a run of these requests takes (a token for one request a step,
// and a step to prefill each): the room Engine::reserve_steps makes, not a limit.
std::int64_t expected_steps(std::span<const WorkloadRequest> requests);

class Engine {
 public:
  Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler, EngineOptions options);
  ~Engine();
  // Runs every request to the end. Throws kvlab::Error only for engine-level faults (a
  // scheduler that stalls, a backend returning NaN); bad requests are rejected and reported.
  EngineResult run(const std::vector<WorkloadRequest>& requests);

  // The same, step by step: start(), step() until it returns false, take_result().
  // `requests` must outlive the run.
  void start(const std::vector<WorkloadRequest>& requests);
  // Room for `steps` step records, made before a long run: the records still grow past it, but
  // a run of a million steps no longer copies (and first-touches) its records each time they
  // double. Untouched room costs address space only. start() reserves for its own requests.
  void reserve_steps(std::int64_t steps);
  bool step();  // receive arrivals, then idle or plan, apply, run, sample, update
  EngineResult take_result();

  // While a run goes on (after start()): one more request, arriving at its arrival_s (a
  // cluster's router hands it over); its id in this engine. `request` must outlive the run.
  RequestId submit(const WorkloadRequest& request);
  // Disaggregated prefill and decode (RequestTable::submit_for_prefill / submit_with_kv): a
  // request this engine only prefills, handing its KV off with its first token; and one that
  // arrives with handed-off KV to decode. take_handoffs() returns the handoffs since the last
  // call, each stamped with this engine's clock at the end of the step that made it.
  RequestId submit_for_prefill(const WorkloadRequest& request);
  RequestId submit_with_kv(const WorkloadRequest& request, KvHandoff handoff);
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
  void receive_arrivals();
  void apply_cancels();
  std::string never_fits(const RequestState& r) const;
  void idle_step();
  double propose();  // returns the seconds it took
  void check_proposals(std::span<const ProposeAsk> asks) const;
  double price_draft(std::span<const ProposeAsk> asks) const;
  void forget_proposals(RequestId id);
  std::vector<std::int64_t> proposal_lengths(std::span<const RequestState* const> decodes,
                                             std::span<const std::int64_t> rooms) const;
  std::optional<double> uniform_verify_seconds(std::span<const RequestState* const> decodes,
                                               std::int64_t k) const;
  // A priced draft's step at each depth: for one decode proposing, and for all of them (empty:
  // no draft priced); at(): linear between, 0 with none proposing.
  struct DraftPrices {
    std::vector<double> one, all;
    double at(std::size_t depth, std::int64_t proposing, std::int64_t decodes) const;
  };
  DraftPrices draft_prices(std::span<const RequestState* const> decodes) const;
  void count_acceptance(const AppliedPlan& applied);
  std::vector<std::int32_t> run_batch(AppliedPlan& applied, StepRecord& record);
  bool computes_padding() const;
  bool reads_kv_slots() const;
  void record_step(StepRecord record, bool fragmentation_blocked);
  StepTiming price_step(const AppliedPlan& applied, std::span<const BatchEntry> batch,
                        StepRecord& record);
  void price_tier_copies(StepTiming& timing, StepRecord& record);
  bool admission_blocked_by_fragmentation(const StepPlan& plan) const;

  Backend& backend_;
  KvAllocator& allocator_;
  Scheduler& scheduler_;
  EngineOptions options_;
  ApplyOptions apply_options_;
  std::unique_ptr<RequestTable> table_;
  PlanChecker plan_checker_;  // every plan the scheduler returns, before apply_plan
  std::unique_ptr<Clock> clock_;
  EventLog log_;
  FrameRecorder frames_;
  EngineResult result_;
  std::int64_t step_ = 0, idle_steps_ = 0, evictions_seen_ = 0;
  KvAllocatorStats tiers_seen_;  // the allocator's tier counters as the last priced step left them
  std::chrono::steady_clock::time_point step_start_;
  StaticPadding padding_;                    // the finished requests of the running static batch
  std::vector<KvHandoff> handoffs_;          // not yet taken
  std::vector<RequestId> pending_cancels_;   // cancel()ed, applied at the next step
  std::optional<KvPolicyRunner> kv_policy_;  // options_.kv_policy's
  // Speculative decoding: the proposer, and the proposals accepted so far out of the positions
  // tried (each verify tries its accepted ones and, unless all were, the first rejected one).
  std::unique_ptr<Proposer> owned_proposer_;  // the built-in one, without options_.proposer
  Proposer* proposer_ = nullptr;
  double draft_price_s_ = 0;  // this step's proposals' price (draft_cost_model)
  double spec_accepted_ = 0, spec_tried_ = 0;
  std::unordered_map<RequestId, std::pair<double, double>> spec_by_request_;  // accepted, tried
  StepTimes step_times_;  // AdaptiveLength::measured: the steps' times by their tokens
  // never_fits's prompt of tokens no prefix matches (-1), kept: long prompts arrive by the
  // thousand in a trace replay.
  mutable std::vector<std::int32_t> unmatched_tokens_;
};

}  // namespace kvlab
