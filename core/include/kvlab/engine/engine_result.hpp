#pragma once
// What an engine run leaves: a record per step, the verifies of speculative decoding, the frames
// of kvlab view, and per request its timeline, tokens and log-probabilities (EngineResult).
#include <cstdint>
#include <vector>

#include "kvlab/engine/events.hpp"
#include "kvlab/engine/frames.hpp"
#include "kvlab/engine/metrics.hpp"
#include "kvlab/engine/sampling.hpp"
#include "kvlab/kv/kv_keep.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/sim/cost_model.hpp"

namespace kvlab {

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
  // A KIVI pool's open groups after the step: fp16 K/V beside the pool's slots, residual + 32
  // tokens per running sequence at most (KvPool::open_group_bytes; a pool without storage: what
  // the running sequences would hold, kivi_open_groups); 0 for the other dtypes.
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
  // A KV policy's selections that dropped something: the positions each sequence's slots held
  // after them (the union over layers and K/V heads) and those a head saw (the rest masked).
  KvKeepStats kv_policy;
};

}  // namespace kvlab
