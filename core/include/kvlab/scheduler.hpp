#pragma once
// Scheduler: the iteration-level policy. A plugin kind. Each engine step it reads the queues
// and a read-only allocator and returns a plan; it never touches memory (the engine applies).
#include <boost/config.hpp>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/kv_allocator.hpp"

namespace kvlab {

using RequestId = std::int64_t;  // also the request's SequenceId in the allocator

// What a scheduler sees of one request.
struct ScheduledRequest {
  RequestId id = 0;
  double arrival_s = 0;
  int priority = 0;                  // higher = more important
  std::int64_t tokens = 0;           // prompt + generated so far: the KV a running request needs
  std::int64_t computed_tokens = 0;  // tokens whose KV is in the pool (0 while waiting)
  std::int64_t generated = 0;
  std::int64_t max_new_tokens = 0;
  std::int64_t oracle_remaining =
      -1;  // tokens it will still generate, when the workload knows (sjf_oracle)
  std::int64_t admitted_step = -1;          // step it (last) entered the running queue
  std::span<const std::int32_t> token_ids;  // prompt + generated (prefix-cache lookups)
  // Decoding: its newest token is the only one without KV. Prefilling: anything else unfinished
  // (a prompt, or a preempted request recomputing its sequence).
  bool decoding() const { return generated > 0 && tokens - computed_tokens == 1; }
  bool prefilling() const { return computed_tokens < tokens && !decoding(); }
  bool swapped = false;  // waiting with its KV in the host swap pool (no recompute on admission)
};

struct SchedulerInput {
  std::span<const ScheduledRequest> waiting;  // never-admitted and preempted requests, by arrival
  std::span<const ScheduledRequest> running;  // by admission
  const KvAllocator* kv = nullptr;            // read-only: can_*, slots_* queries
  std::int64_t step = 0;
};

struct PrefillChunk {
  RequestId id = 0;
  std::int64_t tokens = 0;  // prompt tokens to compute this step
};

struct Deferral {
  RequestId id = 0;
  std::string reason;  // e.g. "kv_full", "max_batch", "token_budget", "static_batch_running"
};

struct StepPlan {
  std::vector<RequestId> preempt;  // running -> waiting; KV freed (recomputed later)
  std::vector<RequestId>
      admit;  // waiting -> running; prompt allocated (their prefill is in `prefill`)
  std::vector<PrefillChunk> prefill;  // prompt chunks computed this step
  std::vector<RequestId> decode;      // one new token each
  std::vector<Deferral> deferred;     // waiting requests left waiting, and why (event log)
  bool swap_preempted = false;        // preempt by swapping KV out (else: free and recompute later)
};

class BOOST_SYMBOL_VISIBLE Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual StepPlan schedule(const SchedulerInput& input) = 0;
};

// The shared iteration-level algorithm behind fcfs, priority, chunked and sjf_oracle:
// (1) running requests keep going — decodes first, then unfinished prefills (chunked within
// the token budget) — preempting victims when the KV cannot grow; (2) waiting requests are
// admitted in `order` while batch slots, tokens and KV last. Head-of-line: admission stops at
// the first waiting request that does not fit.
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
  bool swap = false;  // preempt by swapping KV to the host swap pool (else recompute later)
};
// "last_admitted" | "lowest_priority" | "most_kv"; nullopt for anything else.
std::optional<ContinuousPolicy::Victim> victim_policy_from_name(std::string_view name);

// The continuous schedulers' shared parameters (max_batch, max_tokens_per_step, preemption,
// victim) read into `base`. Throws std::invalid_argument for a bad preemption or victim name
// (plugins call it from their constructor; the message reaches the user).
ContinuousPolicy continuous_policy_from_params(const class PluginParams& params,
                                               ContinuousPolicy base);
StepPlan schedule_continuous(const SchedulerInput& input, const ContinuousPolicy& policy);

// static: a batch is formed only when nothing runs (up to max_batch, while the KV fits) and
// runs to completion; nobody joins a running batch (the seed's static batching baseline).
StepPlan schedule_static(const SchedulerInput& input, std::int64_t max_batch);

}  // namespace kvlab
