#pragma once
// One request as the engine tracks it, and as schedulers see it (read-only). The engine's
// RequestTable (kvlab/engine/request_table.hpp) owns one of these per submitted request for the
// whole run; nothing copies them per step.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvlab/kv/prefix_hash.hpp"

namespace kvlab {

using RequestId = std::int64_t;  // the submission index; also the request's SequenceId

enum class RequestStatus : std::uint8_t {
  waiting,   // never admitted, or preempted with its KV freed (recomputed on admission)
  running,   // admitted: its KV is in the pool
  swapped,   // preempted with its KV in the host swap pool (copied back on admission)
  finished,  // EOS, max tokens or context full; KV freed
  rejected,  // can never run (too long for the context or the pool); reported with a reason
};

// KV of positions [first, computed) of a swapped request, in host memory:
// (layers, K then V, positions, swap_row_bytes) bytes (kvlab/kv/kv_rows.hpp).
// A buffer `transferred` from another replica (disaggregated prefill and decode) was never in
// this engine's swap pool: copying it in costs no swap-pool room and no swap-link bytes (the
// cluster priced its transfer).
struct SwapBuffer {
  std::int64_t first = 0;
  std::vector<std::byte> data;
  bool transferred = false;
};

struct RequestState {
  RequestId id = 0;
  double arrival_s = 0;  // as the engine's clock sees it (0 for all on the offline clock)
  int priority = 0;      // higher = more important
  std::string tenant;    // who sent it ("" for none): fairness across tenants (vtc)
  // When its first token is due on the engine's clock: arrival + its TTFT SLO (the tenant's or
  // the experiment's [slo] ttft_s); +infinity without one. Deadline-aware schedulers (edf).
  double ttft_deadline_s = std::numeric_limits<double>::infinity();
  std::int64_t prompt_tokens = 0;
  std::int64_t max_new_tokens = 0;   // generation stops here unless EOS comes first
  std::vector<std::int32_t> tokens;  // prompt + generated
  std::int64_t computed = 0;         // leading tokens whose KV is in the pool (or swap buffer)
  std::int64_t allocated = 0;        // leading tokens with a KV slot
  std::int64_t admitted_step = -1;   // step it (last) entered the running queue
  RequestStatus status = RequestStatus::waiting;
  bool recompute_each_step = false;  // the no-cache variant: its KV is rebuilt before each token
  SwapBuffer swap;                   // while swapped
  std::string last_deferral;         // why the scheduler last left it waiting ("" = news)
  // Its tokens' block hashes as the allocator's prefix cache names them, computed once (tokens
  // only grow at the end): a cache, filled through a read-only view of the request as well.
  mutable PrefixHashCache prefix_hashes;
  // Speculative decoding: tokens proposed to follow the newest (not in `tokens`, no KV), set by
  // the engine's proposer before the step's schedule and cleared after the step. A scheduler may
  // grant a decoding request up to 1 + proposed.size() new tokens (schedulable_tokens): the
  // newest and the proposals the target then verifies in one entry.
  std::vector<std::int32_t> proposed;

  std::int64_t length() const { return static_cast<std::int64_t>(tokens.size()); }
  std::int64_t generated() const { return length() - prompt_tokens; }
  std::int64_t remaining_output() const { return max_new_tokens - generated(); }
  // Tokens without KV: the whole prompt (or the recomputed sequence) while prefilling, 1 while
  // decoding. vLLM v1's num_new_tokens: one number covers prefill, chunks and decode.
  std::int64_t new_tokens() const { return length() - computed; }
  // Its newest token is the only one without KV.
  bool decoding() const { return generated() > 0 && new_tokens() == 1; }
  // The most new tokens a step may grant it: new_tokens(), plus its proposals when decoding.
  std::int64_t schedulable_tokens() const {
    return new_tokens() + (decoding() ? static_cast<std::int64_t>(proposed.size()) : 0);
  }
  // Anything else unfinished: a prompt, or a preempted request recomputing its sequence.
  bool prefilling() const { return computed < length() && !decoding(); }
  bool is_waiting() const {
    return status == RequestStatus::waiting || status == RequestStatus::swapped;
  }
};

}  // namespace kvlab
