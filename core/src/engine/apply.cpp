#include "kvlab/engine/apply.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

// A sliding window's positions no query reads again, released where the allocator can drop
// positions (the static and dynamic ones hold theirs to the end).
void release_outside_window(KvAllocator& kv, const RequestState& r, std::int64_t window) {
  if (KvPositionDropping* dropping = kv.features().dropping)
    dropping->release_before(r.id, r.length() - window);
}

// copy_kv_rows, timed: returns the seconds it took.
double timed_copy(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                  std::vector<std::byte>& buffer, bool to_host, std::int64_t* bytes = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t copied = copy_kv_rows(pool, view, first, end, buffer, to_host);
  if (bytes != nullptr) *bytes = copied;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// copy_kv_rows as one transfer of the applied plan: its bytes, count and measured time.
void copy_kv(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
             std::vector<std::byte>& buffer, bool to_host, AppliedPlan& applied,
             RequestTimeline& timeline) {
  std::int64_t bytes = 0;
  applied.swap_copy_s += timed_copy(pool, view, first, end, buffer, to_host, &bytes);
  applied.swap_bytes += bytes;
  ++applied.swap_transfers;
  timeline.swapped_bytes += bytes;
}

class PlanApplier {
 public:
  PlanApplier(std::int64_t step, RequestTable& table, KvAllocator& kv, const ApplyOptions& options,
              EventLog& log)
      : step_(step), table_(table), kv_(kv), options_(options), log_(log) {}

  void preempt(RequestState& r, PreemptMode mode, const char* reason);
  void log_deferral(const Deferral& deferral);
  void admit(RequestState& r, std::int64_t new_tokens);
  void continue_running(RequestState& r, std::int64_t new_tokens);
  AppliedPlan finish();

 private:
  bool swap_out(RequestState& r);
  [[noreturn]] void broken_promise(const RequestState& r, const char* what);
  void swap_in(RequestState& r, std::int64_t cached_tokens);

  std::int64_t step_;
  RequestTable& table_;
  KvAllocator& kv_;
  const ApplyOptions& options_;
  EventLog& log_;
  AppliedPlan applied_;
  std::vector<std::pair<RequestId, std::int64_t>> work_;  // new tokens granted, by request
};

// nano-vllm's preempt(): free (or swap out) the KV and put the request back in the queue.
void PlanApplier::preempt(RequestState& r, PreemptMode mode, const char* reason) {
  ++applied_.preempted;
  ++table_.timeline(r.id).preemptions;
  r.proposed.clear();
  if (mode == PreemptMode::swap && swap_out(r)) return;
  kv_.free(r.id);
  table_.timeline(r.id).recomputed_tokens += r.computed;
  r.computed = r.allocated = 0;
  table_.stop_running(r.id, RequestStatus::waiting);
  log_.add(EventKind::event_preempt, r.id, reason);
}

// Copies the computed KV to the host swap pool; false (and a swap_full event) when it is full
// or there is nothing to keep.
bool PlanApplier::swap_out(RequestState& r) {
  if (options_.pool == nullptr || !options_.rules.caches_kv || r.computed == 0) return false;
  const KvView view = kv_.view(r.id);
  if (view.has_holes()) return false;  // a KV policy thinned it: recomputed instead (in the docs)
  const std::int64_t first = view.first_position, tokens = r.computed - first;
  if (table_.swap_used_tokens() + tokens > options_.swap_slots) {
    log_.add(EventKind::event_swap_full, r.id,
             fmt::format("swap pool holds {} of {} tokens", table_.swap_used_tokens(),
                         options_.swap_slots));
    return false;
  }
  copy_kv(*options_.pool, view, first, r.computed, r.swap.data, true, applied_,
          table_.timeline(r.id));
  table_.add_swap_tokens(tokens);
  r.swap.first = first;
  kv_.free(r.id);
  r.allocated = 0;
  table_.stop_running(r.id, RequestStatus::swapped);
  log_.add(EventKind::event_swap_out, r.id, fmt::format("tokens={}", tokens));
  return true;
}

// Logged when the reason is news for the request, not every step it waits for the same one.
void PlanApplier::log_deferral(const Deferral& deferral) {
  RequestState& r = table_.at(deferral.id);
  if (r.last_deferral == deferral.reason) return;
  r.last_deferral = deferral.reason;
  log_.add(EventKind::event_defer, r.id, r.last_deferral);
}

// Allocates the sequence so far (prefix-cache hits come back computed) or copies a swapped
// request's KV back; the request joins the running queue.
void PlanApplier::admit(RequestState& r, std::int64_t new_tokens) {
  const auto allocation =
      kv_.allocate({r.id, r.tokens, r.length() + r.remaining_output(), &r.prefix_hashes});
  if (!allocation) broken_promise(r, "allocate its sequence");
  r.last_deferral.clear();  // a later deferral (after a preemption) is news again
  r.allocated = r.length();
  if (r.status == RequestStatus::swapped)
    swap_in(r, allocation->cached_tokens);
  else
    r.computed = options_.rules.caches_kv ? allocation->cached_tokens : 0;
  table_.start_running(r.id, step_);
  RequestTimeline& timeline = table_.timeline(r.id);
  if (!timeline.first_scheduled_s) {
    timeline.first_scheduled_s = log_.time();
    timeline.prefix_hit_tokens = allocation->cached_tokens;
  }
  log_.add(EventKind::event_admit, r.id,
           allocation->cached_tokens > 0
               ? fmt::format("prefix_hit_tokens={}", allocation->cached_tokens)
               : "");
  work_.emplace_back(r.id, new_tokens);
}

// Copies the swapped KV back into the new slots, skipping leading positions the prefix cache
// already serves.
void PlanApplier::swap_in(RequestState& r, std::int64_t cached_tokens) {
  KvPool& pool = *options_.pool;
  const std::int64_t first = r.swap.first, tokens = r.computed - first;
  const std::int64_t from = std::max(first, cached_tokens);
  if (from < r.computed) {
    std::vector<std::byte> part;
    if (from == first || (!pool.has_storage() && pool.device() == nullptr)) {
      part = std::move(r.swap.data);
    } else {  // the buffer's tail positions [from, computed), per layer half
      part = swapped_positions_from(pool, r.swap.data, tokens, from - first);
    }
    if (r.swap.transferred)  // its bytes crossed the cluster's link, priced there: time only
      applied_.swap_copy_s += timed_copy(pool, kv_.view(r.id), from, r.computed, part, false);
    else
      copy_kv(pool, kv_.view(r.id), from, r.computed, part, false, applied_, table_.timeline(r.id));
  }
  if (!r.swap.transferred) table_.add_swap_tokens(-tokens);
  r.swap = {};
  kv_.mark_computed(r.id, r.computed);
  if (options_.rules.window) release_outside_window(kv_, r, *options_.rules.window);
  log_.add(EventKind::event_swap_in, r.id, fmt::format("tokens={}", tokens));
}

// A running request's work (kv_operation): a decode gets a slot for its newest token (the
// no-cache variant re-allocates its whole sequence, freed at the step's start); a prompt
// chunk's slots were allocated at admission.
void PlanApplier::continue_running(RequestState& r, std::int64_t new_tokens) {
  switch (kv_operation(r)) {
    case KvOperation::kv_reallocate:
      if (!kv_.allocate({r.id, r.tokens, r.length(), &r.prefix_hashes}))
        broken_promise(r, "re-allocate its sequence");
      table_.timeline(r.id).recomputed_tokens += r.computed;
      r.computed = 0;
      r.allocated = r.length();
      work_.emplace_back(r.id, r.length());
      return;
    case KvOperation::kv_append: {
      // The newest token, then the proposals this step verifies (new_tokens - 1 of them): a
      // plain decode appends from the stack, a verify from a copy.
      const auto proposals = static_cast<std::size_t>(
          std::clamp<std::int64_t>(new_tokens - 1, 0, std::ssize(r.proposed)));
      const std::int32_t newest = r.tokens.back();
      std::vector<std::int32_t> verified;
      if (proposals > 0) {
        verified.push_back(newest);
        verified.insert(verified.end(), r.proposed.begin(), r.proposed.begin() + proposals);
      }
      if (!kv_.append(r.id, proposals > 0 ? std::span<const std::int32_t>(verified)
                                          : std::span<const std::int32_t>(&newest, 1)))
        broken_promise(
            r, proposals > 0 ? "append its newest and proposed tokens" : "append its newest token");
      r.allocated = r.computed + 1 + static_cast<std::int64_t>(proposals);
      break;
    }
    case KvOperation::kv_allocate:
    case KvOperation::kv_none:
      break;
  }
  work_.emplace_back(r.id, new_tokens);
}

// The scheduler planned this operation (plan_work) and the allocator promised it would commit.
void PlanApplier::broken_promise(const RequestState& r, const char* what) {
  throw Error(fmt::format(
      "step {}: the KV allocator refused to {} for request {} after its planner accepted it: "
      "the allocator breaks its plan_* contract (kvlab plugins conformance NAME checks it) or the "
      "scheduler returned work it did not plan with plan_work",
      step_, what, r.id));
}

// The batch in running order: each request's granted tokens, up to what it has without KV.
AppliedPlan PlanApplier::finish() {
  std::sort(work_.begin(), work_.end());
  for (const RequestState* r : table_.running()) {
    const auto it =
        std::lower_bound(work_.begin(), work_.end(), std::pair{r->id, std::int64_t{0}},
                         [](const auto& a, const auto& b) { return a.first < b.first; });
    if (it == work_.end() || it->first != r->id) continue;
    const std::int64_t tokens = std::min(it->second, r->schedulable_tokens());
    if (tokens <= 0) continue;
    const std::int64_t own = std::min(tokens, r->new_tokens());  // the rest are proposals
    ScheduledWork work{r->id, tokens, r->computed + own == r->length(), false, tokens - own};
    work.decode = own == 1 && work.samples && r->generated() > 0 && !r->recompute_each_step;
    (work.decode ? applied_.decode_tokens : applied_.prefill_tokens) += tokens;
    applied_.batch.push_back(work);
  }
  return std::move(applied_);
}

}  // namespace

AppliedPlan apply_plan(const StepPlan& plan, std::int64_t step, RequestTable& table,
                       KvAllocator& kv, const ApplyOptions& options, EventLog& log) {
  PlanApplier applier(step, table, kv, options, log);
  // The order the scheduler planned in (plan_step_begin, plan_free, plan_work): every free
  // first — the preempted, then the no-cache variant's decodes — then the work in plan order.
  for (const Preemption& p : plan.preempt) applier.preempt(table.at(p.id), p.mode, "kv_full");
  for (const RequestState* r : table.running())
    if (kv_operation(*r) == KvOperation::kv_reallocate) kv.free(r->id);
  for (const Deferral& d : plan.deferred) applier.log_deferral(d);
  for (const Work& w : plan.work) {
    RequestState& r = table.at(w.id);
    if (r.is_waiting())
      applier.admit(r, w.new_tokens);
    else if (r.status == RequestStatus::running)
      applier.continue_running(r, w.new_tokens);
  }
  AppliedPlan applied = applier.finish();
  applied.pad_finished = plan.pad_finished;
  return applied;
}

// A prefill-only request's KV copied out for its decode replica: positions with KV, as a swap
// buffer holds them (no data on a pool without storage: the bytes are still counted).
KvHandoff hand_off(const RequestState& r, const KvAllocator& kv, const ApplyOptions& options) {
  KvHandoff h;
  h.id = r.id;
  h.generated.assign(r.tokens.begin() + r.prompt_tokens, r.tokens.end());
  h.tokens_with_kv = r.computed;
  if (options.pool != nullptr && options.rules.caches_kv && r.computed > 0) {
    const KvView view = kv.view(r.id);
    if (view.has_holes())
      throw Error(fmt::format(
          "request {}: a KV policy dropped some of its positions, and handing thinned KV to a "
          "decode replica is not supported: run [kv_policy] without disaggregation",
          r.id));
    h.kv.first = view.first_position;
    h.copy_out_s =
        timed_copy(*options.pool, view, view.first_position, r.computed, h.kv.data, true, &h.bytes);
  }
  return h;
}

namespace {

// A verify entry's outcome: its accepted proposals become tokens (produced now), the rejected
// ones' slots are rolled back (their KV is never marked computed, so nothing of them reaches
// the prefix cache), and the proposals are spent.
void accept_proposals(RequestState& r, const ScheduledWork& work, KvAllocator& kv, double now,
                      RequestTimeline& timeline) {
  if (work.accepted < work.proposals) {
    KvRollback* rollback = kv.features().rollback;
    if (rollback == nullptr || !rollback->truncate(r.id, r.computed))
      throw Error(fmt::format(
          "request {}: the KV allocator refused to roll back {} rejected proposed tokens "
          "(KvRollback::truncate to {}): speculative decoding needs an allocator that supports it",
          r.id, work.proposals - work.accepted, r.computed));
    r.allocated = r.computed;
  }
  const auto accepted = static_cast<std::size_t>(work.accepted);
  r.tokens.insert(r.tokens.end(), r.proposed.begin(), r.proposed.begin() + accepted);
  timeline.token_times_s.insert(timeline.token_times_s.end(), accepted, now);
  r.proposed.clear();
}

}  // namespace

std::int64_t apply_tokens(const AppliedPlan& applied, std::span<const std::int32_t> sampled,
                          double now, RequestTable& table, KvAllocator& kv,
                          const ApplyOptions& options, EventLog& log, std::vector<RequestId>* held,
                          std::vector<KvHandoff>* handoffs) {
  const SequenceRules& rules = options.rules;
  std::int64_t finished = 0;
  for (std::size_t e = 0; e < applied.batch.size(); ++e) {
    const ScheduledWork& work = applied.batch[e];
    RequestState& r = table.at(work.id);
    r.computed += work.tokens - work.proposals + work.accepted;
    if (work.proposals > 0) accept_proposals(r, work, kv, now, table.timeline(r.id));
    if (rules.caches_kv) kv.mark_computed(r.id, r.computed);
    if (!work.samples) continue;  // a prompt chunk, more to come
    const std::int32_t token = sampled[e];
    r.tokens.push_back(token);
    r.recompute_each_step = !rules.caches_kv;
    table.timeline(r.id).token_times_s.push_back(now);
    const bool eos = !table.ignores_eos(r.id) && rules.is_eos(token);
    const bool full = r.length() >= rules.context;
    const bool done = eos || r.generated() >= r.max_new_tokens || full;
    if (!done && table.hands_off(r.id) && handoffs != nullptr) {
      handoffs->push_back(hand_off(r, kv, options));
      table.timeline(r.id).finish_reason = "handoff";
      log.add(EventKind::event_finish, r.id, "handoff");
      kv.free(r.id);
      table.finish(r.id, now);
      ++finished;
      continue;
    }
    if (done) {
      std::string& reason = table.timeline(r.id).finish_reason;
      reason = eos ? "eos" : full ? "context_full" : "max_tokens";
      log.add(EventKind::event_finish, r.id, reason);
      if (applied.pad_finished && held != nullptr)
        held->push_back(r.id);  // padding until the static batch ends
      else
        kv.free(r.id);
      table.finish(r.id, now);
      ++finished;
      continue;
    }
    if (rules.window) release_outside_window(kv, r, *rules.window);
  }
  return finished;
}

}  // namespace kvlab
