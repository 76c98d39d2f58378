#pragma once
// Plan, then apply: the only code that changes the KV allocator and the request table.
//   apply_plan    before the forward: preemptions (free or swap out), admissions (allocate,
//                 prefix-cache hits, swap in), a slot for each decode's newest token
//   apply_tokens  after the forward: KV marked computed, sampled tokens appended, stop rules,
//                 finished sequences freed, KV outside the window released
// The engine and the scheduler tests both drive requests through these two functions.
#include <cstdint>
#include <span>
#include <vector>

#include "kvlab/engine/events.hpp"
#include "kvlab/engine/request_table.hpp"
#include "kvlab/engine/sequence_rules.hpp"
#include "kvlab/kv/kv_rows.hpp"  // copy_kv_rows: the swap copies
#include "kvlab/kv_allocator.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

struct ApplyOptions {
  SequenceRules rules;
  KvPool* pool = nullptr;       // where swapped KV is copied from and back to
  std::int64_t swap_slots = 0;  // host swap pool capacity in tokens (0: swap falls back)
};

// One batch entry: `tokens` new tokens of request `id`, starting at its computed count. A
// speculative verify: its newest token and `proposals` of RequestState::proposed (the last
// `proposals` of `tokens`); the target's tokens then accept the first `accepted` of them.
struct ScheduledWork {
  RequestId id = 0;
  std::int64_t tokens = 0;
  bool samples = false;  // the entry ends the sequence: its last logits give the next token
  bool decode = false;   // a decoding request's newest token (else prefill or recompute)
  std::int64_t proposals = 0;
  std::int64_t accepted = 0;  // set after the forward (pick_tokens), before apply_tokens
};

struct AppliedPlan {
  std::vector<ScheduledWork> batch;  // in running order
  std::int64_t preempted = 0;
  std::int64_t swap_bytes = 0;      // KV copied to and from the host swap pool, in its dtype
  std::int64_t swap_transfers = 0;  // copies (one per swap-out or swap-in of a request)
  double swap_copy_s = 0;           // what those copies really took here
  std::int64_t prefill_tokens = 0, decode_tokens = 0;
  bool pad_finished = false;  // StepPlan::pad_finished
};

AppliedPlan apply_plan(const StepPlan& plan, std::int64_t step, RequestTable& table,
                       KvAllocator& kv, const ApplyOptions& options, EventLog& log);

// `sampled[e]` is the token batch entry e produced (read only when it samples); a verify entry
// appends its first `accepted` proposals before it, its rejected proposals' slots are rolled
// back (KvRollback::truncate) and its proposals cleared. Returns how
// many requests finished. A finished request's KV is freed, unless the plan pads finished
// requests (applied.pad_finished) and `held` is given: then it stays allocated and its id is
// appended to `held` (the caller frees it when the static batch ends). A request submitted for
// prefill only (RequestTable::hands_off) that is not done with its first token finishes as
// "handoff", its KV copied out and appended to `handoffs` (when given) before it is freed.
std::int64_t apply_tokens(const AppliedPlan& applied, std::span<const std::int32_t> sampled,
                          double now, RequestTable& table, KvAllocator& kv,
                          const ApplyOptions& options, EventLog& log,
                          std::vector<RequestId>* held = nullptr,
                          std::vector<KvHandoff>* handoffs = nullptr);

}  // namespace kvlab
