#pragma once
// Scheduler: the iteration-level policy. A plugin kind. Each engine step it reads the request
// table (read-only) and the allocator (read-only) and returns a plan; it never touches memory:
// apply_plan (kvlab/engine/apply.hpp) is the only code that does.
#include <boost/config.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/kv_allocator.hpp"
#include "kvlab/request.hpp"

namespace kvlab {

struct SchedulerInput {
  // Waiting and swapped requests by (arrival, id); running requests by admission.
  std::span<const RequestState* const> waiting;
  std::span<const RequestState* const> running;
  const KvAllocator* kv = nullptr;  // read-only: free_slots, slots_* queries
  std::int64_t step = 0;
  // The engine's clock at the step's start (seconds; the clock arrivals and deadlines are on:
  // virtual, measured or wall). Offline runs start everyone at 0.
  double now_s = 0;
};

enum class PreemptMode : std::uint8_t {
  recompute,  // free its KV; the whole sequence is recomputed on readmission
  swap,       // copy its KV to the host swap pool (recompute if the swap pool is full)
};

struct Preemption {
  RequestId id = 0;
  PreemptMode mode = PreemptMode::recompute;
};

// Compute `new_tokens` of this request's tokens this step. On a waiting request this admits it
// (its sequence so far is allocated); on a running one it is a decode (1) or a prompt chunk.
struct Work {
  RequestId id = 0;
  std::int64_t new_tokens = 0;  // 1 .. RequestState::new_tokens()
};

struct Deferral {
  RequestId id = 0;
  // e.g. "kv_full", "max_batch", "token_budget", "static_batch_running": a string literal or
  // text the scheduler keeps alive until its next schedule() call (no allocation per request).
  std::string_view reason;
};

// vLLM v1's plan shape: running requests to preempt, then work for running and waiting requests
// alike, and why waiting requests were refused (the event log). Requests queued behind a refused
// one need not be listed: they wait behind it.
struct StepPlan {
  std::vector<Preemption> preempt;  // running -> waiting / swapped
  std::vector<Work> work;
  std::vector<Deferral> deferred;
  // Static batching as Hugging Face generate() and FasterTransformer run it: a request that
  // finishes this step stays in the batch as padding — its KV held, and each later step priced
  // as if it decoded one more (discarded) token — until no request of the batch is running.
  bool pad_finished = false;
};

// A scheduler plans exactly: every work item it returns must have been tried on the allocator's
// planner (plan_work below) in plan order, after plan_step_begin and a plan_free for each
// preemption. apply_plan then commits the same operations in the same order and never fails
// (an allocator that breaks its promise stops the run with an error).
class BOOST_SYMBOL_VISIBLE Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual StepPlan schedule(const SchedulerInput& input) = 0;
};

// The KV operation a request's work commits in apply_plan, written once for both sides:
//   waiting                         allocate its sequence so far (room for the rest of its output)
//   decoding, no-cache variant      allocate its whole sequence again (freed at the step's start)
//   decoding without a slot         append a slot for its newest token (and for each proposal the
//                                   step verifies with it: RequestState::proposed)
//   otherwise (a prompt chunk)      nothing: its slots were allocated at admission
enum class KvOperation : std::uint8_t { kv_none, kv_allocate, kv_reallocate, kv_append };
KvOperation kv_operation(const RequestState& r);
// Starts a step's plan: plan_reset, then the no-cache variant's decoding requests freed (apply
// frees them first too, scheduled or not).
void plan_step_begin(const KvAllocator& kv, std::span<const RequestState* const> running);
// Tries r's work's KV operation on the planner; true is the allocator's promise. `new_tokens`:
// the tokens its work computes (a decode's 1 + the proposals it verifies; else unused).
bool plan_work(const KvAllocator& kv, const RequestState& r, std::int64_t new_tokens = 1);

// "a comes before b": an admission order, or the order in which running requests give way.
using RequestOrder = std::function<bool(const RequestState& a, const RequestState& b)>;

// The shared iteration-level algorithm behind fcfs, priority, chunked and sjf_oracle:
// (1) running requests keep going — decodes first, then unfinished prefills (chunked within
// the token budget) — preempting victims when the KV cache cannot grow; (2) waiting requests are
// admitted in `order` while batch slots, tokens and KV last. Head-of-line: admission stops at
// the first waiting request that does not fit. A scheduler plugin brings its own policy through
// PolicyHooks (docs/writing-a-plugin.md).
struct ContinuousPolicy {
  enum class Order { arrival, priority, shortest_remaining };
  Order order = Order::arrival;
  std::int64_t max_batch = 256;             // running requests at most
  std::int64_t max_tokens_per_step = 8192;  // prefill + decode tokens per step
  bool chunked_prefill = false;             // split prompts over steps to fit the token budget
  bool preempt_for_priority = false;  // admit a higher-priority request by preempting lower ones
  // Which running request gives way when the KV cache cannot grow.
  enum class Victim { last_admitted, lowest_priority, most_kv };
  Victim victim = Victim::last_admitted;
  PreemptMode preemption = PreemptMode::recompute;
};

// A plugin's own policy on top of the shared algorithm: each order, when set, replaces the
// policy's `order` / `victim` (stable: ties keep arrival order / latest admitted first). They
// are called only inside schedule_continuous, within the plugin's own schedule() call.
struct PolicyHooks {
  RequestOrder admission_order;  // which waiting request is admitted first
  RequestOrder victim_order;     // which running request gives way first
};
// "last_admitted" | "lowest_priority" | "most_kv"; nullopt for anything else.
std::optional<ContinuousPolicy::Victim> victim_policy_from_name(std::string_view name);

// The continuous schedulers' shared parameters (max_batch, max_tokens_per_step, preemption,
// victim) read into `base`. Throws std::invalid_argument for a bad preemption or victim name
// (plugins call it from their constructor; the message reaches the user).
ContinuousPolicy continuous_policy_from_params(const class PluginParams& params,
                                               ContinuousPolicy base);
StepPlan schedule_continuous(const SchedulerInput& input, const ContinuousPolicy& policy,
                             const PolicyHooks& hooks = {});

// static: a batch is formed only when nothing runs (up to max_batch, while the KV fits) and
// runs to completion; nobody joins a running batch (the seed's static batching baseline).
// `padding`: finished requests stay in the batch as padding until it ends (StepPlan::pad_finished).
StepPlan schedule_static(const SchedulerInput& input, std::int64_t max_batch, bool padding);

}  // namespace kvlab
