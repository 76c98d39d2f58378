#include "kvlab/cpu_reference/perplexity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kivi_groups.hpp"
#include "kvlab/kv/kv_keep.hpp"

namespace kvlab::cpu {
namespace {

// One log-softmax row, summed in double: its maximum and log-sum-exp.
struct RowNorm {
  float max = 0;
  double log_sum = 0;  // log sum_j exp(x_j - max)
  std::int64_t argmax = 0;
};

RowNorm normalize(const float* x, std::int64_t n) {
  RowNorm r;
  r.max = x[0];
  for (std::int64_t j = 1; j < n; ++j)
    if (x[j] > r.max) {
      r.max = x[j];
      r.argmax = j;
    }
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += std::exp(static_cast<double>(x[j] - r.max));
  r.log_sum = std::log(sum);
  return r;
}

double log_prob(const float* x, const RowNorm& r, std::int64_t j) {
  return static_cast<double>(x[j] - r.max) - r.log_sum;
}

// KL(p || q) = sum_j p_j (log p_j - log q_j), rows as logits.
double kl_divergence(const float* p, const RowNorm& pn, const float* q, const RowNorm& qn,
                     std::int64_t n) {
  double kl = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    const double lp = log_prob(p, pn, j);
    kl += std::exp(lp) * (lp - log_prob(q, qn, j));
  }
  return std::max(kl, 0.0);  // rounding can leave a tiny negative for equal rows
}

// A pool of `parallel` chunks' slots and the backend that reads it.
struct ScoringRun {
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<CpuBackend> backend;
};

// A pool of `slots` slots with the KV settings of `o` (nullptr: the exact f32 KV) and its backend.
ScoringRun make_run(const ModelWeightsView& weights,
                    const std::shared_ptr<const ComputeWeights>& compute,
                    const PerplexityOptions* o, std::int64_t slots) {
  const ModelConfig& c = weights.config;
  KvPoolShape shape{c.num_hidden_layers, c.cache_kv_heads(), c.cache_head_dim(), slots};
  if (o != nullptr) {
    shape.dtype = o->kv_dtype;
    shape.value_dtype = o->kv_value_dtype;
    shape.hadamard_rotated = o->hadamard;
    shape.kivi_residual = o->kivi_residual;
  }
  ScoringRun run;
  run.pool = std::make_unique<KvPool>(shape);
  run.backend = std::make_unique<CpuBackend>(weights, *run.pool,
                                             o != nullptr ? o->window : std::nullopt, compute);
  return run;
}

// The chunks of `batch` (whole-chunk entries, chunk_room slots each) streamed `step` tokens a
// forward, every position kept; the logits of positions [first, n_ctx) laid out as
// CpuBackend::run(batch, n_ctx - first) lays them out. A KIVI pool's prompt is fp16 until it
// leaves the residual, so only a stream reads its quantized groups as a generation would.
void stream_chunks(CpuBackend& backend, std::span<const BatchEntry> batch, std::int64_t step,
                   std::int64_t first, RowMatrix& logits) {
  const auto n_ctx = static_cast<std::int64_t>(batch[0].tokens.size()), scored = n_ctx - first;
  logits.resize(static_cast<std::int64_t>(batch.size()) * scored, backend.vocab_size());
  std::vector<BatchEntry> part(batch.begin(), batch.end());
  for (std::int64_t start = 0; start < n_ctx; start += step) {
    const std::int64_t len = std::min(step, n_ctx - start);
    for (std::size_t s = 0; s < batch.size(); ++s) {
      part[s].tokens =
          batch[s].tokens.subspan(static_cast<std::size_t>(start), static_cast<std::size_t>(len));
      part[s].start_position = start;
      part[s].view.extents = {{batch[s].view.extents[0].start_slot, start + len}};
    }
    const RowMatrix& out = backend.run(part, len);  // (seqs x len, vocab)
    for (std::size_t s = 0; s < batch.size(); ++s)
      for (std::int64_t i = std::max<std::int64_t>(0, first - start); i < len; ++i)
        logits.row(static_cast<std::int64_t>(s) * scored + start + i - first) =
            out.row(static_cast<std::int64_t>(s) * len + i);
  }
}

// Slots for `tokens` positions in whole KIVI groups of 32: each chunk's (each sequence's) slots
// start a group.
std::int64_t chunk_slots(std::int64_t tokens) {
  return (tokens + kKiviGroup - 1) / kKiviGroup * kKiviGroup;
}

// Chunks streamed through a KV policy: each sequence s owns slots [s * room, + room), the K/V
// of the positions some layer's head keeps first, in order, and then one step's new tokens.
class PolicyStream {
 public:
  PolicyStream(CpuBackend& backend, KvPool& pool, KvPolicy& policy, std::string policy_name,
               std::int64_t step)
      : backend_(backend),
        pool_(pool),
        policy_(policy),
        policy_name_(std::move(policy_name)),
        step_(step) {
    for (std::int64_t l = 0; l < pool.shape().layers; ++l)
      layer_windows_.push_back(backend.layer_window(l));
  }

  // Slots a sequence of n_ctx tokens takes: what the policy may hold and a step's tokens, or in
  // a KIVI pool the whole chunk's (its positions stay in place), in whole KIVI groups.
  static std::int64_t slots(const KvPolicy& policy, std::int64_t step, std::int64_t n_ctx,
                            DType dtype) {
    if (dtype_is_kivi(dtype)) return chunk_slots(n_ctx);
    return chunk_slots(std::min(std::max(policy.held_limit(), policy.budget()), n_ctx) + step);
  }

  // Runs the chunks `sequences` (n_ctx tokens each, ids `first_id` on) step by step; writes the
  // logits of positions [first, n_ctx) of sequence s into rows s * (n_ctx - first) + ... of
  // `logits`, as CpuBackend::run(whole chunks, n_ctx - first) would.
  void run(std::span<const std::span<const std::int32_t>> sequences, std::int64_t first_id,
           std::int64_t first, RowMatrix& logits);
  // What the policy's selections held and saw, over every run so far.
  const KvKeepStats& stats() const { return stats_; }

 private:
  struct Sequence {
    HeadSelection kept;              // positions in slot order, and what each head sees
    std::vector<std::int64_t> held;  // kept.positions and then this step's new ones
    std::vector<std::uint8_t> mask;  // the view's key mask (BatchEntry::key_mask)
  };
  void keep_selected(std::size_t s, std::int64_t id, std::span<const float> scores,
                     std::int64_t new_tokens, bool prompt_done);
  // The slots of `held` from `base`: moved down to [base, base + held) in order, or (in place)
  // each position's own slot, in runs of consecutive positions.
  std::vector<KvExtent> held_extents(std::int64_t base, std::span<const std::int64_t> held) const;

  CpuBackend& backend_;
  KvPool& pool_;
  KvPolicy& policy_;
  std::string policy_name_;
  std::int64_t step_, room_ = 0;
  std::vector<std::optional<std::int64_t>> layer_windows_;  // (layers) the backend's
  bool in_place_ = false;  // positions stay in their slots (KIVI), else kept rows move down
  std::vector<Sequence> sequences_;
  std::vector<std::uint8_t> keep_;
  KvKeepStats stats_;
};

void PolicyStream::run(std::span<const std::span<const std::int32_t>> sequences,
                       std::int64_t first_id, std::int64_t first, RowMatrix& logits) {
  const std::int64_t n_ctx = static_cast<std::int64_t>(sequences[0].size()), scored = n_ctx - first;
  // A KIVI pool keeps each position in its own slot (a kept row moved into another group would
  // be quantized again with its new neighbours at every step): the chunk's whole room.
  in_place_ = dtype_is_kivi(pool_.shape().dtype);
  room_ = slots(policy_, step_, n_ctx, pool_.shape().dtype);
  const auto seqs = static_cast<std::int64_t>(sequences.size());
  logits.resize(seqs * scored, backend_.vocab_size());
  sequences_.assign(sequences.size(), {});
  for (std::int64_t start = 0; start < n_ctx; start += step_) {
    const std::int64_t len = std::min(step_, n_ctx - start);
    std::vector<BatchEntry> batch(sequences.size());
    for (std::size_t s = 0; s < sequences.size(); ++s) {
      Sequence& seq = sequences_[s];
      seq.held = seq.kept.positions;
      for (std::int64_t p = start; p < start + len; ++p) seq.held.push_back(p);
      key_mask_for(seq.kept, seq.held, start, seq.mask);
      BatchEntry& e = batch[s];
      e.tokens =
          sequences[s].subspan(static_cast<std::size_t>(start), static_cast<std::size_t>(len));
      e.start_position = start;
      e.view.extents = held_extents(static_cast<std::int64_t>(s) * room_, seq.held);
      e.view.first_position = seq.held.front();
      e.view.positions = seq.held;
      e.scored_queries = policy_.scored_queries();
      e.key_mask = seq.mask;
    }
    const RowMatrix& out = backend_.run(batch, len);  // (seqs x len, vocab)
    const std::span<const float> all = backend_.key_scores();
    std::size_t score_offset = 0;
    for (std::size_t s = 0; s < sequences.size(); ++s) {
      for (std::int64_t i = std::max<std::int64_t>(0, first - start); i < len; ++i)
        logits.row(static_cast<std::int64_t>(s) * scored + start + i - first) =
            out.row(static_cast<std::int64_t>(s) * len + i);
      const std::size_t cells =
          sequences_[s].held.size() *
          static_cast<std::size_t>(pool_.shape().layers * pool_.shape().kv_heads);
      keep_selected(s, first_id + static_cast<std::int64_t>(s),
                    all.empty() ? all : all.subspan(score_offset, cells), len,
                    start + len == n_ctx);
      score_offset += cells;
    }
  }
  for (std::size_t s = 0; s < sequences.size(); ++s)
    policy_.forget(first_id + static_cast<std::int64_t>(s));
}

std::vector<KvExtent> PolicyStream::held_extents(std::int64_t base,
                                                 std::span<const std::int64_t> held) const {
  if (!in_place_) return {{base, static_cast<std::int64_t>(held.size())}};
  std::vector<KvExtent> extents;
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (!extents.empty() && held[i] == held[i - 1] + 1)
      ++extents.back().length;
    else
      extents.push_back({base + held[i], 1});
  }
  return extents;
}

// Asks the policy which of sequence s's positions each head keeps, and moves the K/V of those
// some head keeps to the front of its slots, in order (a kept row only moves down, so no row is
// overwritten before it is read).
void PolicyStream::keep_selected(std::size_t s, std::int64_t id, std::span<const float> scores,
                                 std::int64_t new_tokens, bool prompt_done) {
  Sequence& seq = sequences_[s];
  const KvPoolShape& shape = pool_.shape();
  const auto n = static_cast<std::int64_t>(seq.held.size());
  keep_.assign(static_cast<std::size_t>(shape.layers * shape.kv_heads * n), 0);
  const KvKeep keep{keep_, shape.layers, shape.kv_heads, n};
  hide_outside_windows(layer_windows_, shape.kv_heads, seq.held, seq.mask);
  const KvPolicyStep step{id,           seq.held,       scores,     seq.mask,
                          shape.layers, shape.kv_heads, new_tokens, prompt_done};
  HeadSelection kept =
      kept_by_policy(policy_, policy_name_, step, keep, policy_.select(step, keep));
  const std::int64_t limit = std::max(policy_.held_limit(), policy_.budget());
  if (kept.held() > limit)
    throw Error(fmt::format("the KV policy held {} positions, more than its held limit {}",
                            kept.held(), limit));
  if (kept.cells < n * shape.layers * shape.kv_heads)  // it dropped some: the full cache
    stats_.add(kept, seq.held.back() + 1);             // would hold every position so far
  if (in_place_) {  // nothing moves: the view lists the kept positions' own slots
    seq.kept = std::move(kept);
    return;
  }
  const std::int64_t base = static_cast<std::int64_t>(s) * room_;
  std::size_t from = 0;
  for (std::int64_t k = 0; k < kept.held(); ++k) {
    const std::int64_t position = kept.positions[static_cast<std::size_t>(k)];
    while (seq.held[from] < position) ++from;  // kept.positions is a subset of held, in order
    if (static_cast<std::int64_t>(from) != k)
      pool_.move_slot(base + static_cast<std::int64_t>(from), base + k);
    ++from;
  }
  seq.kept = std::move(kept);
}

void check_options(const ModelConfig& c, std::int64_t text_tokens, const PerplexityOptions& o) {
  if (o.context < 4 || o.context > c.max_position_embeddings)
    throw Error(fmt::format("perplexity context must be in [4, {}] ({}'s context), not {}",
                            c.max_position_embeddings, c.name, o.context));
  if (o.chunks < 0 || o.parallel < 1)
    throw Error(fmt::format("perplexity needs chunks >= 0 and parallel >= 1, not {} and {}",
                            o.chunks, o.parallel));
  if (!kivi_residual_valid(o.kivi_residual))
    throw Error(
        fmt::format("KIVI's residual length must be a multiple of {} tokens in [0, {}], not {}",
                    kKiviGroup, kKiviResidualMost, o.kivi_residual));
  if (o.policy_step < 1)
    throw Error(fmt::format("a stream's step (a KV policy's, KIVI's) must be >= 1 token, not {}",
                            o.policy_step));
  if (o.policy != nullptr && o.policy->budget() < 1)
    throw Error(fmt::format("a KV policy needs a budget >= 1, not {}", o.policy->budget()));
  if (o.window && *o.window < 1)
    throw Error(fmt::format("the attention window must be >= 1 position, not {}", *o.window));
  if (text_tokens < 2 * o.context)
    throw Error(fmt::format(
        "the text has {} tokens: perplexity with a context of {} needs at least {} (two chunks, "
        "as llama-perplexity asks)",
        text_tokens, o.context, 2 * o.context));
}

// Rows [row0, row0 + targets.size()) of `logits`, row i predicting targets[i]; against the same
// rows of `exact` when given.
PerplexitySums score_rows(const RowMatrix& logits, const RowMatrix* exact, std::int64_t row0,
                          std::span<const std::int32_t> targets) {
  const std::int64_t vocab = logits.cols(), n = static_cast<std::int64_t>(targets.size());
  double nll_sum = 0, nll_squared = 0, kl_sum = 0, kl_squared = 0, exact_nll = 0;
  std::int64_t same_top1 = 0;
#pragma omp parallel for reduction(+ : nll_sum, nll_squared, kl_sum, kl_squared, exact_nll, \
                                       same_top1)
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t next = targets[static_cast<std::size_t>(i)];
    const float* x = logits.row(row0 + i).data();
    const RowNorm norm = normalize(x, vocab);
    const double nll = -log_prob(x, norm, next);
    nll_sum += nll;
    nll_squared += nll * nll;
    if (exact == nullptr) continue;
    const float* e = exact->row(row0 + i).data();
    const RowNorm exact_norm = normalize(e, vocab);
    const double kl = kl_divergence(e, exact_norm, x, norm, vocab);
    kl_sum += kl;
    kl_squared += kl * kl;
    same_top1 += exact_norm.argmax == norm.argmax;
    exact_nll += -log_prob(e, exact_norm, next);
  }
  return {n, nll_sum, nll_squared, kl_sum, kl_squared, same_top1, exact_nll};
}

void add(PerplexitySums& total, const PerplexitySums& more) {
  total.tokens += more.tokens;
  total.nll += more.nll;
  total.nll_squared += more.nll_squared;
  total.kl += more.kl;
  total.kl_squared += more.kl_squared;
  total.same_top1 += more.same_top1;
  total.exact_nll += more.exact_nll;
}

}  // namespace

double PerplexityResult::ppl() const {
  return sums.tokens > 0 ? std::exp(sums.nll / static_cast<double>(sums.tokens)) : 0.0;
}

// llama.cpp: sqrt((E[nll^2] - E[nll]^2) / (N - 1)) x ppl.
double PerplexityResult::ppl_error() const {
  if (sums.tokens < 2) return 0;
  const auto n = static_cast<double>(sums.tokens);
  const double mean = sums.nll / n, variance = sums.nll_squared / n - mean * mean;
  return variance > 0 ? std::sqrt(variance / (n - 1)) * ppl() : 0.0;
}

double PerplexityResult::exact_ppl() const {
  return sums.tokens > 0 ? std::exp(sums.exact_nll / static_cast<double>(sums.tokens)) : 0.0;
}

double PerplexityResult::mean_kl() const {
  return sums.tokens > 0 ? sums.kl / static_cast<double>(sums.tokens) : 0.0;
}

double PerplexityResult::kl_error() const {
  if (sums.tokens < 2) return 0;
  const auto n = static_cast<double>(sums.tokens);
  const double mean = sums.kl / n, variance = sums.kl_squared / n - mean * mean;
  return variance > 0 ? std::sqrt(variance / (n - 1)) : 0.0;
}

double PerplexityResult::top1_agreement() const {
  return sums.tokens > 0 ? static_cast<double>(sums.same_top1) / static_cast<double>(sums.tokens)
                         : 0.0;
}

namespace {

bool is_exact(const PerplexityOptions& o) {
  return o.kv_dtype == DType::dtype_f32 && o.kv_value_dtype.value_or(o.kv_dtype) == o.kv_dtype &&
         !o.window && !o.hadamard && o.policy == nullptr;
}

// One point's KV pool, backend and (with a KV policy) its stream, over `parallel` chunks.
struct ScoredPoint {
  const PerplexityOptions* options = nullptr;
  ScoringRun run;
  std::optional<PolicyStream> stream;
  RowMatrix streamed;  // the stream's logits, laid out as the whole chunks' would be
  PerplexityResult result;
};

void check_points(const ModelConfig& c, std::int64_t text_tokens,
                  std::span<const PerplexityOptions> points) {
  if (points.empty()) throw Error("perplexity needs at least one setting to measure");
  for (const PerplexityOptions& o : points) {
    check_options(c, text_tokens, o);
    if (o.context != points[0].context || o.chunks != points[0].chunks ||
        o.parallel != points[0].parallel)
      throw Error(fmt::format(
          "settings measured together share context, chunks and parallel: {}/{}/{} is not "
          "{}/{}/{}",
          o.context, o.chunks, o.parallel, points[0].context, points[0].chunks,
          points[0].parallel));
  }
}

// A point's pool and backend for `parallel` chunks of n_ctx tokens (chunk_room slots each, or
// its KV policy stream's room), and whether it is compared with the exact run.
void set_up_point(const PerplexityOptions& o, const ModelWeightsView& weights,
                  const std::shared_ptr<const ComputeWeights>& compute, std::int64_t n_ctx,
                  std::int64_t parallel, std::int64_t chunk_room, ScoredPoint& point) {
  point.options = &o;
  point.result.compared = o.compare_with_exact && !is_exact(o);
  const std::int64_t room = o.policy != nullptr
                                ? PolicyStream::slots(*o.policy, o.policy_step, n_ctx, o.kv_dtype)
                                : chunk_room;
  point.run = make_run(weights, compute, &o, parallel * room);
  if (o.policy != nullptr)
    point.stream.emplace(*point.run.backend, *point.run.pool, *o.policy, o.policy_name,
                         o.policy_step);
}

}  // namespace

std::vector<PerplexityResult> measure_perplexity(
    const ModelWeightsView& weights, const std::function<ComputeWeights()>& make_compute,
    std::span<const std::int32_t> tokens, std::optional<std::int32_t> bos,
    std::span<const PerplexityOptions> points,
    const std::function<void(std::size_t, const PerplexityResult&)>& on_chunk) {
  const auto text_tokens = static_cast<std::int64_t>(tokens.size());
  check_points(weights.config, text_tokens, points);
  const std::int64_t n_ctx = points[0].context, first = n_ctx / 2;
  const std::int64_t available = text_tokens / n_ctx;
  const std::int64_t chunks =
      points[0].chunks > 0 ? std::min(points[0].chunks, available) : available;
  const std::int64_t parallel = std::min(points[0].parallel, chunks);
  // Whole chunks (the batch below) take chunk_room slots each: a KIVI pool's key groups are 32
  // slots, and each chunk's slots start a group. A KV policy's stream takes its own room.
  const std::int64_t chunk_room = chunk_slots(n_ctx);
  // One copy of the matrices for every point's backend and the exact run's.
  const auto compute = std::make_shared<const ComputeWeights>(make_compute());
  std::vector<ScoredPoint> scored(points.size());
  for (std::size_t p = 0; p < points.size(); ++p)
    set_up_point(points[p], weights, compute, n_ctx, parallel, chunk_room, scored[p]);
  const bool any_compared = std::any_of(scored.begin(), scored.end(),
                                        [](const ScoredPoint& p) { return p.result.compared; });
  ScoringRun reference;  // the exact KV, run once per batch for every point compared with it
  if (any_compared)
    reference =
        make_run(weights, compute, nullptr,
                 parallel * chunk_room);  // the whole chunks' slots, as the batch's views say

  std::vector<std::int32_t> batch_tokens(static_cast<std::size_t>(parallel * n_ctx));
  for (std::int64_t chunk = 0; chunk < chunks; chunk += parallel) {
    const std::int64_t seqs = std::min(parallel, chunks - chunk);
    std::vector<BatchEntry> batch;
    std::vector<std::span<const std::int32_t>> sequences;
    for (std::int64_t s = 0; s < seqs; ++s) {
      std::int32_t* seq = batch_tokens.data() + s * n_ctx;
      std::copy_n(tokens.begin() + (chunk + s) * n_ctx, n_ctx, seq);
      if (bos) seq[0] = *bos;  // llama.cpp: each chunk starts with BOS when the model adds one
      batch.push_back(
          {{seq, static_cast<std::size_t>(n_ctx)}, 0, {{{s * chunk_room, n_ctx}}, 0, {}}, true});
      sequences.push_back(batch.back().tokens);
    }
    // (seqs x (n_ctx - first), vocab): row s * (n_ctx - first) + i is position first + i of s.
    const RowMatrix* exact_logits =
        any_compared ? &reference.backend->run(batch, n_ctx - first) : nullptr;
    for (std::size_t p = 0; p < scored.size(); ++p) {
      ScoredPoint& point = scored[p];
      if (point.stream) {
        point.stream->run(sequences, chunk, first, point.streamed);
        point.result.kv_kept = point.stream->stats();
      }
      const bool kivi_stream = !point.stream && dtype_is_kivi(point.options->kv_dtype);
      if (kivi_stream)
        stream_chunks(*point.run.backend, batch, point.options->policy_step, first, point.streamed);
      const RowMatrix& logits = point.stream || kivi_stream
                                    ? point.streamed
                                    : point.run.backend->run(batch, n_ctx - first);
      for (std::int64_t s = 0; s < seqs; ++s) {
        const std::int64_t row0 = s * (n_ctx - first);
        const std::span<const std::int32_t> targets(batch_tokens.data() + s * n_ctx + first + 1,
                                                    static_cast<std::size_t>(n_ctx - first - 1));
        add(point.result.sums,
            score_rows(logits, point.result.compared ? exact_logits : nullptr, row0, targets));
        point.result.chunks += 1;
        point.result.running_ppl.push_back(point.result.ppl());
      }
      if (scored.size() > 1) {  // the next point's buffers take this one's place
        point.run.backend->release_buffers();
        point.streamed.resize(0, 0);
      }
      if (on_chunk) on_chunk(p, point.result);
    }
  }
  std::vector<PerplexityResult> results;
  for (ScoredPoint& point : scored) results.push_back(std::move(point.result));
  return results;
}

PerplexityResult measure_perplexity(const ModelWeightsView& weights,
                                    const std::function<ComputeWeights()>& make_compute,
                                    std::span<const std::int32_t> tokens,
                                    std::optional<std::int32_t> bos,
                                    const PerplexityOptions& options,
                                    const std::function<void(const PerplexityResult&)>& on_chunk) {
  std::function<void(std::size_t, const PerplexityResult&)> each;
  if (on_chunk) each = [&](std::size_t, const PerplexityResult& r) { on_chunk(r); };
  return std::move(
      measure_perplexity(weights, make_compute, tokens, bos, std::span(&options, 1), each).front());
}

}  // namespace kvlab::cpu
