#pragma once
// Backend: runs the forward pass over a mixed batch, one call a step (forward -> ForwardResult).
// Implementations: the CPU backend (cpu_reference/), the simulated backend (core/sim, a cost
// model), the CUDA backend (cuda/, a plugin).
#include <boost/config.hpp>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kvlab/kv_pool.hpp"

namespace kvlab {

// One sequence's share of a batch: `tokens` sit at positions [start_position, + size()).
// `view` must already map every position up to start_position + size() (the allocator gave the
// new tokens their slots) and back to the oldest position attention needs.
struct BatchEntry {
  std::span<const std::int32_t> tokens;
  std::int64_t start_position = 0;
  KvView view;
  // false: the entry's K/V are computed but not stored (a static batch's padding rows: pad
  // tokens whose logits are discarded, their views mapping the request's own cached slots and,
  // past what it holds, any pool slots): the backend attends to the cache as it is and leaves
  // every slot of the view as it is (vLLM's padding slot), so a discarded row never reaches a
  // cached block, nor another sequence's.
  bool writes_kv = true;
  // > 0: the backend reports the attention the entry's last `scored_queries` queries give each
  // key of its view (ForwardResult::key_scores), for a KV policy (kvlab/kv_policy.hpp).
  std::int32_t scored_queries = 0;
  // How many of the entry's last tokens get logits (or a choice each): 1, its last, as a decode
  // or a prompt's end needs; more to verify a speculative proposal (the positions of the k
  // proposed tokens and the one after them: k + 1). At most tokens.size(). ForwardResult then
  // holds sum(logit_rows) rows, entry by entry, each entry's in position order. A backend that
  // cannot answer more than one row per entry refuses such a batch (kvlab::Error).
  std::int32_t logit_rows = 1;
  // With KV groups (kvlab/kv/kv_groups.hpp: a pool slot holds one token of one group's layers),
  // the entry's view in every group, group_views[0] == view; layer l reads and writes
  // group_views[group_of_layer[l]] at pool layer pool_layer[l]. Empty: every layer uses `view`.
  std::vector<KvView> group_views = {};
  // (layers, kv_heads, view.length()) row-major, or empty: 0 where that layer's K/V head no
  // longer sees that key of the view (a per-head KV policy hid it: kvlab/kv/kv_keep.hpp), 1
  // where it does. The query heads of a K/V head see what it sees. A backend that cannot mask
  // refuses an entry with one (kvlab::Error).
  std::span<const std::uint8_t> key_mask = {};
};

// How one batch entry's next token is picked: the request's SamplingParams filters and this
// step's draw from its RNG. A backend that picks where its logits are (a GPU) picks as
// kvlab::pick_token picks from the same row (kvlab/engine/sampling.hpp).
struct TokenChoice {
  double temperature = 0;  // 0: the argmax, lowest id on ties (uniform unused)
  double top_p = 1;        // 1: off
  double uniform = 0;      // the draw, in [0, 1)
  std::int32_t top_k = 0;  // 0: off
  // -1: no log-probabilities; k >= 0: the chosen token's and the k most likely tokens'
  // (ForwardResult::logprobs), as kvlab::token_logprob and kvlab::top_logprobs compute them.
  std::int32_t logprobs = -1;
};

struct TokenLogprob {
  std::int32_t token = 0;
  float logprob = 0;  // natural log of the model's probability (softmax of the raw logits)
};

// What one forward returns for its batch, entries in batch order: each entry's logits, or the
// token the backend chose for it (and, when its choice asked, the log-probabilities). The spans
// point into the backend's own buffers and stay valid until its next forward; nothing else of the
// call outlives it.
struct ForwardResult {
  // (rows, vocab) row-major: the logits of each entry's last logit_rows tokens (one row an entry
  // unless an entry asked for more), entry by entry. Empty when `tokens` is set.
  std::span<const float> logits;
  // (rows): the backend's choice for each row (one TokenChoice per row), -1 for a row holding NaN
  // or +-inf. Empty when `logits` is set.
  std::span<const std::int32_t> tokens;
  // (entries, logprob_width) row-major, with `tokens` when some choice asked (logprobs >= 0),
  // logprob_width = 1 + the most asked. Row e: the chosen token and its log-probability under
  // softmax(logits) (temperature 1, before any filtering), then the k_e most likely tokens,
  // most likely first, the lower id first among equals; {-1, NaN} fill the rest (and the whole
  // row of a non-finite row). Empty when none was asked or the backend has no logits.
  std::span<const TokenLogprob> logprobs;
  std::size_t logprob_width = 0;
  // When some entry asked (BatchEntry::scored_queries): for each entry in batch order,
  // (layers, kv_heads, keys of its view) row-major: the softmax weights its scored queries gave
  // each key in each layer, summed over the queries and over the query heads of each K/V head
  // (zeros for an entry that did not ask). Empty otherwise, or from a backend that cannot score
  // (it then refuses such a batch).
  std::span<const float> key_scores;

  static ForwardResult of_logits(std::span<const float> logits) {
    ForwardResult r;
    r.logits = logits;
    return r;
  }
  static ForwardResult of_tokens(std::span<const std::int32_t> tokens,
                                 std::span<const TokenLogprob> logprobs = {},
                                 std::size_t logprob_width = 0) {
    ForwardResult r;
    r.tokens = tokens;
    r.logprobs = logprobs;
    r.logprob_width = logprob_width;
    return r;
  }
};

// How a backend's forwards ran so far (Backend::counters), for a run's report.
struct BackendCounters {
  std::int64_t graph_captures = 0;  // CUDA graphs captured (the cuda backend's decode steps)
  std::int64_t graph_replays = 0;   // forwards that replayed one instead of launching each kernel
};

class BOOST_SYMBOL_VISIBLE Backend {
 public:
  virtual ~Backend() = default;
  // The one call: runs `batch`, writing each new token's K/V into its slot (entries whose
  // writes_kv is false excepted). `choices`: empty when the caller reads the logits, else one
  // per entry, which lets the backend pick each entry's token where the logits are (only ids
  // cross to the host) or return the logits for the caller to pick with the same draws; a
  // backend without logits (the simulated one) always returns tokens.
  virtual ForwardResult forward(std::span<const BatchEntry> batch,
                                std::span<const TokenChoice> choices) = 0;
  virtual std::int64_t vocab_size() const = 0;
  // Totals since the backend was made (zeros where a backend has nothing to count).
  virtual BackendCounters counters() const { return {}; }
  // What it computes with, for a run's report (the cpu backend: the formats its products read);
  // "" for nothing to say.
  virtual std::string description() const { return {}; }
};

}  // namespace kvlab
