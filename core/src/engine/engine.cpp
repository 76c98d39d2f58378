#include "kvlab/engine/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <new>
#include <optional>

#include "kvlab/engine/plan_check.hpp"
#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"

namespace kvlab {
namespace {

using SteadyClock = std::chrono::steady_clock;

double seconds_between(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The most step records reserve_steps() makes room for: 1M records, about 400 MB of address
// space (a longer run grows as it needs).
constexpr std::int64_t kMostReservedSteps = std::int64_t{1} << 20;

}  // namespace

std::int64_t expected_steps(std::span<const WorkloadRequest> requests) {
  std::int64_t steps = 0;  // each step gives each running request a token, or prefills
  for (const WorkloadRequest& r : requests) steps += r.output_tokens + 1;
  return steps;
}

Engine::Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler,
               EngineOptions options)
    : backend_(backend),
      allocator_(allocator),
      scheduler_(scheduler),
      options_(std::move(options)),
      apply_options_{options_.rules, options_.pool, options_.swap_slots},
      padding_(options_.rules.context) {}

Engine::~Engine() = default;

EngineResult Engine::run(const std::vector<WorkloadRequest>& requests) {
  start(requests);
  while (step()) {
  }
  return take_result();
}

void Engine::start(const std::vector<WorkloadRequest>& requests) {
  const bool priced = options_.clock == EngineClock::virtual_clock ||
                      options_.clock == EngineClock::offline ||
                      options_.clock == EngineClock::paced;
  if (priced && options_.cost_model == nullptr)
    throw Error(
        "engine: the virtual, offline and paced clocks price every step with a cost model; give "
        "EngineOptions::cost_model (a hardware profile: profiles/cpu.toml for the CPU backend) or "
        "use the measured clock");
  clock_ = make_clock(options_.clock);
  padding_.clear();
  pending_cancels_.clear();
  if (options_.kv_policy != nullptr && options_.speculation.enabled())
    throw Error(
        "engine: speculative decoding with a KV policy is not supported: a rejected proposal is "
        "rolled back by truncating the sequence, which a policy's dropped positions prevent; run "
        "[speculation] without [kv_policy]");
  if (options_.speculation.adaptive == AdaptiveLength::priced && options_.speculation.enabled() &&
      options_.cost_model == nullptr)
    throw Error(
        "engine: an adaptive proposal length priced by the cost model needs one; give "
        "EngineOptions::cost_model (a hardware profile), price by the steps' measured times "
        "(AdaptiveLength::measured) or use a fixed speculation.tokens");
  owned_proposer_.reset();
  proposer_ = nullptr;
  if (options_.speculation.enabled()) {
    if (options_.proposer == nullptr)
      owned_proposer_ =
          make_proposer(options_.speculation, backend_.vocab_size(), options_.rules.eos_token_ids);
    proposer_ = options_.proposer != nullptr ? options_.proposer : owned_proposer_.get();
  }
  spec_accepted_ = spec_tried_ = 0;
  spec_by_request_.clear();
  step_times_ = {};
  if (options_.kv_policy != nullptr)  // (sequence ids start again: its state from nothing)
    kv_policy_.emplace(*options_.kv_policy, options_.names.kv_policy, options_.names.allocator);
  table_ = std::make_unique<RequestTable>(requests, clock_->all_arrive_at_zero());
  log_ = {};
  frames_ = FrameRecorder(options_.frame_budget,
                          options_.frame_budget > 0 ? allocator_.stats().capacity : 0);
  result_ = {};
  reserve_steps(expected_steps(requests));
  step_ = idle_steps_ = 0;
  evictions_seen_ = allocator_.stats().evictions;
}

void Engine::reserve_steps(std::int64_t steps) {
  try {
    result_.steps.reserve(
        static_cast<std::size_t>(std::clamp<std::int64_t>(steps, 0, kMostReservedSteps)));
  } catch (const std::bad_alloc&) {
    // Only a hint: under a tight address-space limit (ulimit -v) the records grow as they need.
  }
}

EngineResult Engine::take_result() {
  result_.duration_s = clock_->now();
  result_.frame_stride = frames_.stride();
  result_.frames = frames_.take();
  result_.tokens = table_->generated_tokens();
  result_.requests = table_->take_timelines();
  result_.logprobs = table_->take_logprobs();
  result_.events = log_.take();
  table_.reset();
  return std::move(result_);
}

RequestId Engine::submit(const WorkloadRequest& request) {
  if (!table_) throw Error("engine: submit() before start()");
  return table_->submit(request);
}

RequestId Engine::submit_for_prefill(const WorkloadRequest& request) {
  if (!table_) throw Error("engine: submit_for_prefill() before start()");
  return table_->submit_for_prefill(request);
}

RequestId Engine::submit_with_kv(const WorkloadRequest& request, KvHandoff handoff) {
  if (!table_) throw Error("engine: submit_with_kv() before start()");
  return table_->submit_with_kv(request, std::move(handoff));
}

bool Engine::cancel(RequestId id) {
  if (!table_ || id < 0 || static_cast<std::size_t>(id) >= table_->size()) return false;
  const RequestStatus status = table_->at(id).status;
  if (status == RequestStatus::finished || status == RequestStatus::rejected) return false;
  if (std::find(pending_cancels_.begin(), pending_cancels_.end(), id) == pending_cancels_.end())
    pending_cancels_.push_back(id);
  return true;
}

// The cancellations of arrived requests take effect: KV freed, finished as "cancelled". Those not
// arrived yet wait for their arrival; those that ended meanwhile are dropped.
void Engine::apply_cancels() {
  std::erase_if(pending_cancels_, [&](RequestId id) {
    if (!table_->has_arrived(id)) return false;
    RequestState& r = table_->at(id);
    if (r.status == RequestStatus::finished || r.status == RequestStatus::rejected) return true;
    if (r.status == RequestStatus::running) allocator_.free(id);
    if (kv_policy_) kv_policy_->forget(id);
    if (proposer_) forget_proposals(id);
    log_.add(EventKind::event_finish, id, "cancelled");
    table_->cancel(id, clock_->now());
    return true;
  });
}

double Engine::now() const {
  return clock_ ? clock_->now() : 0.0;
}

bool Engine::has_work() const {
  return table_ && !table_->all_done();
}

ReplicaLoad Engine::load() const {
  ReplicaLoad load;
  const KvAllocatorStats kv = allocator_.stats();
  load.kv_used = kv.used;
  load.kv_capacity = kv.capacity;
  if (!table_) return load;
  auto pending = [](const RequestState& r) {
    return std::max<std::int64_t>(0, r.length() - r.computed) + r.remaining_output();
  };
  for (const RequestState* r : table_->waiting()) {
    load.queued_tokens += pending(*r);
    load.queued_prefill_tokens += std::max<std::int64_t>(0, r->length() - r->computed);
  }
  for (const RequestState* r : table_->running()) load.queued_tokens += pending(*r);
  for (const RequestId id : table_->not_arrived()) {  // routed here, not arrived yet
    const RequestState& r = table_->at(id);
    load.queued_tokens += r.prompt_tokens + r.max_new_tokens;
    load.queued_prefill_tokens += r.prompt_tokens;
  }
  load.waiting = static_cast<std::int64_t>(table_->waiting().size() + table_->not_arrived().size());
  load.running = static_cast<std::int64_t>(table_->running().size());
  return load;
}

// Why a request can never run here, or "" when it can. With a sliding window a sequence holds
// at most its prompt or the window (+1 for the new token), whichever is longer.
std::string Engine::never_fits(const RequestState& r) const {
  const std::int64_t total = r.prompt_tokens + r.max_new_tokens;
  if (r.prompt_tokens == 0) return "empty prompt";
  if (total > options_.rules.context)
    return fmt::format("prompt {} + max tokens {} exceed the context of {}", r.prompt_tokens,
                       r.max_new_tokens, options_.rules.context);
  std::int64_t held = total;  // with a window or a KV policy: what it keeps and a new token
  if (options_.rules.window)
    held = std::min(held, std::max(r.prompt_tokens, *options_.rules.window + 1));
  if (kv_policy_) held = std::min(held, std::max(r.prompt_tokens, kv_policy_->budget() + 1));
  if (unmatched_tokens_.size() < static_cast<std::size_t>(held))
    unmatched_tokens_.resize(static_cast<std::size_t>(held), -1);  // no prefix hits
  const std::span<const std::int32_t> tokens(unmatched_tokens_.data(),
                                             static_cast<std::size_t>(held));
  const std::int64_t capacity = allocator_.stats().capacity;
  if (allocator_.slots_to_allocate({r.id, tokens, held}) <= capacity) return {};
  if (held <= capacity)  // the pool would hold them: the allocator's own limit refuses them
    return fmt::format(
        "prompt {} + max tokens {} fit the pool ({} slots), but {} refuses a sequence this long "
        "(its own limit, e.g. the static allocator's max_seq_len)",
        r.prompt_tokens, r.max_new_tokens, capacity, options_.names.allocator);
  return fmt::format("prompt {} + max tokens {} need more KV than the pool holds ({} slots)",
                     r.prompt_tokens, r.max_new_tokens, capacity);
}

// Requests whose arrival time has come join the waiting queue, or are rejected with the reason.
void Engine::receive_arrivals() {
  log_.set_time(step_, clock_->now());
  while (const auto next = table_->next_arrival()) {
    if (table_->at(*next).arrival_s > clock_->now()) break;
    const RequestId id = table_->arrive();
    if (std::string reason = never_fits(table_->at(id)); !reason.empty()) {
      log_.add(EventKind::event_reject, id, reason);
      table_->reject(id, std::move(reason));
    }
  }
}

bool Engine::step() {
  // A real-time clock that sat idle (a live engine's wait) reads now.
  const std::optional<RequestId> next = table_->next_arrival();
  const bool busy = !table_->waiting().empty() || !table_->running().empty();
  clock_->catch_up(next ? std::optional<double>(table_->at(*next).arrival_s) : std::nullopt, busy);
  receive_arrivals();
  if (!pending_cancels_.empty()) apply_cancels();
  if (table_->all_done()) return false;
  if (table_->waiting().empty() && table_->running().empty()) {  // idle until the next arrival
    clock_->idle_until(table_->at(*table_->next_arrival()).arrival_s);
    return true;
  }
  const double propose_s = propose();
  // 1. plan, 2. apply
  (void)padding_.release_if_batch_ended(*table_, allocator_);
  step_start_ = SteadyClock::now();
  const StepPlan plan = plugin_call(options_.names.scheduler, step_, [&] {
    return scheduler_.schedule(
        {table_->waiting(), table_->running(), &allocator_, step_, clock_->now()});
  });
  if (const std::string problem = plan_checker_.problem(plan, *table_); !problem.empty())
    throw Error(fmt::format("step {}: {} returned a plan that {}", step_, options_.names.scheduler,
                            problem));
  AppliedPlan applied = plugin_call<PluginErrors::non_kvlab>(options_.names.allocator, step_, [&] {
    return apply_plan(plan, step_, *table_, allocator_, apply_options_, log_);
  });
  const bool fragmentation_blocked = admission_blocked_by_fragmentation(plan);
  if (applied.batch.empty()) {
    // Preemption emptied a padded static batch: free its padding and plan again.
    if (padding_.release_if_batch_ended(*table_, allocator_)) return true;
    idle_step();
    return !table_->all_done();
  }
  idle_steps_ = 0;
  // 3. run, 4. sample, 5. update
  StepRecord record;
  record.preempted = applied.preempted;
  record.propose_s = propose_s;
  const std::vector<std::int32_t> sampled = run_batch(applied, record);
  log_.set_time(step_, clock_->now());
  std::vector<RequestId> finished_held;
  const std::size_t handed = handoffs_.size();
  apply_tokens(applied, sampled, clock_->now(), *table_, allocator_, apply_options_, log_,
               &finished_held, &handoffs_);
  if (kv_policy_)
    plugin_call<PluginErrors::non_kvlab>(options_.names.kv_policy, step_,
                                         [&] { kv_policy_->select(applied, *table_, allocator_); });
  if (proposer_)
    for (const ScheduledWork& work : applied.batch)
      if (table_->at(work.id).status != RequestStatus::running || table_->hands_off(work.id))
        forget_proposals(work.id);
  for (std::size_t h = handed; h < handoffs_.size(); ++h) handoffs_[h].time_s = clock_->now();
  padding_.hold(finished_held, *table_, allocator_);
  record_step(record, fragmentation_blocked);
  frames_.record(step_ - 1, clock_->now(), applied, allocator_, *table_);
  if (options_.frame_observer != nullptr && options_.frame_observer->wants_frame())
    options_.frame_observer->on_frame(
        make_frame(step_ - 1, clock_->now(), applied, allocator_, *table_));
  return !table_->all_done();
}

// True when a request refused for memory (kv_full) would have fitted in the free slots in all:
// external fragmentation blocked an admission this step.
bool Engine::admission_blocked_by_fragmentation(const StepPlan& plan) const {
  std::optional<KvAllocatorStats> stats;  // read only when a request was refused for memory
  for (const Deferral& d : plan.deferred) {
    const RequestState& r = table_->at(d.id);
    if (d.reason != "kv_full" || !r.is_waiting()) continue;
    if (!stats) stats = allocator_.stats();
    if (stats->unusable_free == 0) return false;
    const AllocateRequest request{r.id, r.tokens, r.length() + r.remaining_output(),
                                  &r.prefix_hashes};
    if (allocator_.slots_to_allocate(request) <= stats->free) return true;
  }
  return false;
}

// Nothing to run: everyone waits for memory or for a scheduler limit. With nothing running and
// nothing left to arrive, the head request can never be admitted: it is rejected.
void Engine::idle_step() {
  if (++idle_steps_ > options_.max_idle_steps)
    throw Error(fmt::format(
        "engine: {} steps without progress ({} waiting, {} running): the scheduler stalls",
        idle_steps_, table_->waiting().size(), table_->running().size()));
  const auto next = table_->next_arrival();
  if (table_->running().empty() && !table_->waiting().empty() && !next) {
    const RequestState& head = *table_->waiting().front();
    std::string reason = fmt::format(
        "not admitted even with nothing running (scheduler: {}): it exceeds the scheduler's "
        "limits or the KV pool",
        head.last_deferral.empty() ? "no reason given" : head.last_deferral);
    log_.add(EventKind::event_reject, head.id, reason);
    table_->reject(head.id, std::move(reason));
  } else if (next) {
    clock_->skip_to(table_->at(*next).arrival_s);
  }
  ++step_;
}

// Speculative decoding's proposals for this step: each running decode (not handed off) gets up
// to speculation.tokens, never past its output limit or the context, from one call of the
// proposer; every other request's are cleared.
double Engine::propose() {
  draft_price_s_ = 0;
  if (!proposer_) return 0;
  const auto start = SteadyClock::now();
  std::vector<const RequestState*> decodes;
  for (const RequestState* running : table_->running()) {
    RequestState& r = table_->at(running->id);
    r.proposed.clear();
    if (!r.decoding() || r.recompute_each_step || table_->hands_off(r.id)) continue;
    decodes.push_back(&r);
  }
  // Each decode's proposals at most: `tokens`, within its output limit and the context.
  std::vector<std::int64_t> rooms;
  for (const RequestState* r : decodes)
    rooms.push_back(std::min({options_.speculation.tokens, r->remaining_output() - 1,
                              options_.rules.context - r->length() - 1}));
  const std::vector<std::int64_t> lengths = proposal_lengths(decodes, rooms);
  std::vector<ProposeAsk> asks;
  for (std::size_t i = 0; i < decodes.size(); ++i) {
    RequestState& r = table_->at(decodes[i]->id);
    if (lengths[i] > 0) asks.push_back({&r, lengths[i], &r.proposed});
  }
  if (!asks.empty()) {
    plugin_call<PluginErrors::non_kvlab>(options_.names.proposer, step_,
                                         [&] { proposer_->propose(asks); });
    check_proposals(asks);
    draft_price_s_ = price_draft(asks);
  }
  return seconds_between(start, SteadyClock::now());
}

// A proposer's answer, checked before anything uses it: no more tokens than asked, each in the
// vocabulary.
void Engine::check_proposals(std::span<const ProposeAsk> asks) const {
  const std::int64_t vocab = backend_.vocab_size();
  for (const ProposeAsk& ask : asks) {
    const auto count = static_cast<std::int64_t>(ask.proposed->size());
    const auto bad = std::find_if(ask.proposed->begin(), ask.proposed->end(),
                                  [&](std::int32_t t) { return t < 0 || t >= vocab; });
    if (count > ask.max_tokens || bad != ask.proposed->end())
      throw Error(fmt::format(
          "step {}: {} answered request {} with {} proposals{} (asked for at most {}, each a "
          "token id below {})",
          step_, options_.names.proposer, ask.request->id, count,
          bad != ask.proposed->end() ? fmt::format(", one of them {}", *bad) : std::string(),
          ask.max_tokens, vocab));
  }
}

// The draft model's steps for these proposals (draft_cost_model): as many sequential decode
// steps as the longest proposal, each over the decodes still proposing (one token a sequence, its
// context growing by one a step; draft_step_seconds). 0 without a draft.
double Engine::price_draft(std::span<const ProposeAsk> asks) const {
  if (options_.draft_cost_model == nullptr) return 0;
  double seconds = 0;
  std::vector<EntryShape> shapes;
  for (std::int64_t j = 0;; ++j) {
    shapes.clear();
    for (const ProposeAsk& ask : asks)
      if (static_cast<std::int64_t>(ask.proposed->size()) > j)
        shapes.push_back({1, ask.request->computed + j, 0, 1});
    if (shapes.empty()) return seconds;
    seconds += draft_step_seconds(*options_.draft_cost_model, shapes);
  }
}

void Engine::forget_proposals(RequestId id) {
  plugin_call<PluginErrors::non_kvlab>(options_.names.proposer, step_,
                                       [&] { proposer_->forget(id); });
}

// Each decode's proposals at most (rooms[i], up to speculation.tokens), or with an adaptive length
// the best for these decodes by each request's acceptance so far and the price of the step: the
// cost model's, or the measured times of the steps run so far. Until 64 proposed positions have
// been tried it proposes `tokens`: an acceptance nobody measured (a prior of 1/2 worth 4
// positions) could keep it from ever proposing, and so from ever learning that the proposals pay.
// A request's own acceptance counts as much as its positions tried against 32 of the run's.
std::vector<std::int64_t> Engine::proposal_lengths(std::span<const RequestState* const> decodes,
                                                   std::span<const std::int64_t> rooms) const {
  constexpr double kAcceptanceEvidence = 64;  // positions tried before the acceptance is trusted
  constexpr double kRunsWeight = 32;          // the run's acceptance, in a request's positions
  const SpeculationOptions& spec = options_.speculation;
  std::vector<std::int64_t> lengths(rooms.begin(), rooms.end());
  if (spec.adaptive == AdaptiveLength::off || decodes.empty() || spec_tried_ < kAcceptanceEvidence)
    return lengths;
  const double run = (spec_accepted_ + 2) / (spec_tried_ + 4);
  std::vector<double> acceptance;
  for (const RequestState* r : decodes) {
    const auto it = spec_by_request_.find(r->id);
    const auto [accepted, tried] = it == spec_by_request_.end() ? std::pair{0.0, 0.0} : it->second;
    acceptance.push_back((accepted + kRunsWeight * run) / (tried + kRunsWeight));
  }
  // The verify's price at k proposals a decode (k = 0..tokens), linear between those counts;
  // with a priced draft, its step at each depth, linear in the decodes still proposing.
  const auto count = static_cast<std::int64_t>(decodes.size());
  std::vector<double> at_k;
  for (std::int64_t k = 0; k <= spec.tokens; ++k) {
    const std::optional<double> seconds = uniform_verify_seconds(decodes, k);
    if (!seconds) {  // not measured yet: run k for every decode and see
      for (std::int64_t& length : lengths) length = std::min(length, k);
      return lengths;
    }
    at_k.push_back(*seconds);
  }
  const DraftPrices draft = draft_prices(decodes);
  return adaptive_proposal_lengths(
      [&](std::span<const std::int64_t> proposing) {
        std::int64_t m = 0;
        double seconds = 0;
        for (std::size_t j = 0; j < proposing.size(); ++j) {
          m += proposing[j];
          seconds += draft.at(j, proposing[j], count);
        }
        const std::int64_t k = std::min(m / count, spec.tokens - 1);
        const double share = static_cast<double>(m - k * count) / static_cast<double>(count);
        const auto at = static_cast<std::size_t>(k);
        return seconds + at_k[at] + share * (at_k[at + 1] - at_k[at]);
      },
      acceptance, rooms);
}

// The verify step's seconds if each of these decodes verified k proposals: the cost model's
// price, or (AdaptiveLength::measured) the measured times of the steps run so far, which hold
// the proposer's time too (nullopt: none ran that many tokens).
std::optional<double> Engine::uniform_verify_seconds(std::span<const RequestState* const> decodes,
                                                     std::int64_t k) const {
  const auto count = static_cast<std::int64_t>(decodes.size());
  if (options_.speculation.adaptive == AdaptiveLength::measured)
    return step_times_.seconds(count * (1 + k));
  std::vector<EntryShape> shapes;
  for (const RequestState* r : decodes) shapes.push_back({1 + k, r->computed, 0, 1 + k});
  const CostModel& cost = *options_.cost_model;
  return cost.cost(cost.work(shapes)).total();
}

// A priced draft's step at each depth j (0..tokens - 1), for one decode (the first) and for all.
Engine::DraftPrices Engine::draft_prices(std::span<const RequestState* const> decodes) const {
  DraftPrices prices;
  const CostModel* draft = options_.draft_cost_model;
  if (draft == nullptr || options_.speculation.adaptive != AdaptiveLength::priced) return prices;
  std::vector<EntryShape> shapes;
  for (std::int64_t j = 0; j < options_.speculation.tokens; ++j) {
    shapes.clear();
    for (const RequestState* r : decodes) shapes.push_back({1, r->computed + j, 0, 1});
    prices.all.push_back(draft_step_seconds(*draft, shapes));
    prices.one.push_back(draft_step_seconds(*draft, std::span(shapes).first(1)));
  }
  return prices;
}

double Engine::DraftPrices::at(std::size_t depth, std::int64_t proposing,
                               std::int64_t decodes) const {
  if (depth >= all.size() || proposing == 0) return 0;
  if (decodes == 1) return all[depth];
  return one[depth] + (all[depth] - one[depth]) * static_cast<double>(proposing - 1) /
                          static_cast<double>(decodes - 1);
}

// The acceptance measured so far: each verify tried its accepted positions and, unless it
// accepted them all, the first rejected one.
void Engine::count_acceptance(const AppliedPlan& applied) {
  for (const ScheduledWork& work : applied.batch) {
    if (work.proposals == 0) continue;
    result_.verifies.push_back({step_, work.id, work.proposals, work.accepted});
    const double tried =
        static_cast<double>(work.accepted + (work.accepted < work.proposals ? 1 : 0));
    spec_accepted_ += static_cast<double>(work.accepted);
    spec_tried_ += tried;
    auto& [accepted, tried_by_request] = spec_by_request_[work.id];
    accepted += static_cast<double>(work.accepted);
    tried_by_request += tried;
  }
}

// The forward over the applied batch (and a static batch's padding rows, on a measured clock),
// then each sampling entry's token; the clock prices the step. Token choices are offered to the
// backend unless someone reads the logits (on_logits).
std::vector<std::int32_t> Engine::run_batch(AppliedPlan& applied, StepRecord& record) {
  std::vector<BatchEntry> batch;
  batch.reserve(applied.batch.size());
  std::size_t verify_tokens = 0;  // (no pass over the batch for it without speculation)
  if (proposer_)
    for (const ScheduledWork& work : applied.batch)
      if (work.proposals > 0) verify_tokens += static_cast<std::size_t>(work.tokens);
  std::vector<std::int32_t> verified;  // verify entries' tokens: the newest, then the proposals
  verified.reserve(verify_tokens);     // (the entries' spans point into it)
  for (const ScheduledWork& work : applied.batch) {
    const RequestState& r = table_->at(work.id);
    BatchEntry entry;
    if (work.proposals > 0) {
      const std::size_t at = verified.size();
      verified.push_back(r.tokens.back());
      verified.insert(verified.end(), r.proposed.begin(), r.proposed.begin() + work.proposals);
      entry.tokens = std::span<const std::int32_t>(verified).subspan(at);
      entry.logit_rows = static_cast<std::int32_t>(1 + work.proposals);
      record.proposed_tokens += work.proposals;
      ++record.verify_entries;
    } else {
      entry.tokens = std::span<const std::int32_t>(r.tokens).subspan(
          static_cast<std::size_t>(r.computed), static_cast<std::size_t>(work.tokens));
    }
    entry.start_position = r.computed;
    entry.view = reads_kv_slots() ? allocator_.view(work.id) : allocator_.positions_view(work.id);
    batch.push_back(std::move(entry));
  }
  if (kv_policy_) kv_policy_->ask_scores(batch);
  if (computes_padding()) padding_.append_rows(*table_, allocator_, batch);
  const std::vector<TokenChoice> choices = draw_token_choices(applied, *table_, batch.size());
  const std::span<const TokenChoice> offered =
      options_.observers.on_logits ? std::span<const TokenChoice>() : choices;
  const auto start = SteadyClock::now();
  const ForwardResult result = plugin_call<PluginErrors::non_kvlab>(
      options_.names.backend, step_, [&] { return backend_.forward(batch, offered); });
  const auto end = SteadyClock::now();
  if (kv_policy_)
    kv_policy_->take_scores(std::span(batch).first(applied.batch.size()), result,
                            options_.names.backend);
  record.step = step_;
  record.start_s = clock_->now();
  record.batch = static_cast<std::int64_t>(applied.batch.size());
  record.prefill_tokens = applied.prefill_tokens;
  record.decode_tokens = applied.decode_tokens;
  record.measured_forward_s = seconds_between(start, end);
  record.measured_step_s = seconds_between(step_start_, end);
  record.duration_s =
      clock_->advance(price_step(applied, std::span(batch).first(applied.batch.size()), record));
  std::vector<std::int32_t> sampled =
      pick_tokens(result, choices, applied, *table_, backend_.vocab_size(), step_,
                  options_.observers, [this](std::int32_t t) { return options_.rules.is_eos(t); });
  for (const ScheduledWork& work : applied.batch) record.accepted_tokens += work.accepted;
  count_acceptance(applied);
  if (options_.speculation.adaptive == AdaptiveLength::measured)
    step_times_.observe(record.prefill_tokens + record.decode_tokens, record.duration_s);
  return sampled;
}

// Whether the backend may read the batch's KV slots: not when the pool holds no K/V anywhere
// (the simulated backend's bookkeeping pool), whose views then carry positions only. A test
// engine without a pool gets whole views.
bool Engine::reads_kv_slots() const {
  const KvPool* pool = options_.pool;
  return pool == nullptr || pool->has_storage() || pool->device() != nullptr;
}

// A static batch's finished rows cost a padded batch (Hugging Face generate()) a row of every
// step until the batch ends. The cost model prices them on every clock; on a clock that times
// the backend (measured, wall) the backend must also compute them, or static batching would be
// timed without the padding the simulator charges it.
bool Engine::computes_padding() const {
  return options_.clock == EngineClock::measured || options_.clock == EngineClock::wall;
}

// The step as each clock prices it: the cost model's roofline over the batch and the static
// batch's padding rows, and the swap copies over its link; the measured forward and copies.
StepTiming Engine::price_step(const AppliedPlan& applied, std::span<const BatchEntry> batch,
                              StepRecord& record) {
  StepTiming timing;
  timing.measured_forward_s = record.measured_forward_s;
  timing.measured_propose_s = record.propose_s;
  timing.measured_swap_s = applied.swap_copy_s;
  record.padding = static_cast<std::int64_t>(padding_.shapes().size());
  record.swap_bytes = applied.swap_bytes;
  record.swap_transfers = applied.swap_transfers;
  if (options_.cost_model != nullptr) {
    record.work = options_.cost_model->work(batch, padding_.shapes());
    record.predicted_s = options_.cost_model->cost(record.work).total();
    timing.predicted_s = record.predicted_s;
    timing.modelled_propose_s = record.predicted_propose_s = draft_price_s_;
    timing.modelled_swap_s =
        options_.cost_model->swap_seconds(applied.swap_bytes, applied.swap_transfers);
  }
  price_tier_copies(timing, record);
  return timing;
}

// The KV tier copies the allocator made since the last priced step (they happen as the plan is
// applied): the host link carries the device <-> host copies and the disk blocks loaded back,
// the disk its reads and writes.
void Engine::price_tier_copies(StepTiming& timing, StepRecord& record) {
  if (!options_.kv_tiers) return;
  const KvAllocatorStats now = allocator_.stats(), &was = tiers_seen_;
  if (now.host_copies == was.host_copies && now.disk_copies == was.disk_copies) return;
  timing.measured_tier_s = now.tier_copy_seconds - was.tier_copy_seconds;
  if (options_.cost_model != nullptr) {
    const CostModel& model = *options_.cost_model;
    const std::int64_t link_bytes = (now.host_bytes_stored - was.host_bytes_stored) +
                                    (now.host_bytes_loaded - was.host_bytes_loaded) +
                                    (now.disk_bytes_loaded - was.disk_bytes_loaded);
    const std::int64_t disk_bytes = (now.disk_bytes_stored - was.disk_bytes_stored) +
                                    (now.disk_bytes_loaded - was.disk_bytes_loaded);
    timing.modelled_tier_s = model.swap_seconds(link_bytes, now.host_copies - was.host_copies) +
                             model.disk_seconds(disk_bytes, now.disk_copies - was.disk_copies);
    timing.tier_copies_overlap = model.profile().tier_copies_overlap;
  }
  record.tier_s = timing.tier_copies_overlap
                      ? std::max(0.0, timing.modelled_tier_s - timing.predicted_s)
                      : timing.modelled_tier_s;
  if (options_.clock == EngineClock::measured) record.tier_s = timing.measured_tier_s;
  tiers_seen_ = now;
}

// The step's record: queue lengths and the allocator's numbers after the update.
void Engine::record_step(StepRecord record, bool fragmentation_blocked) {
  record.waiting = static_cast<std::int64_t>(table_->waiting().size());
  record.running = static_cast<std::int64_t>(table_->running().size());
  record.kv = allocator_.stats();
  if (options_.pool != nullptr) record.kv_residual_bytes = options_.pool->open_group_bytes();
  record.blocking_unusable_free = fragmentation_blocked ? record.kv.unusable_free : 0;
  record.padding_slots = padding_.slots();
  if (record.kv.evictions > evictions_seen_) {  // cached prefix blocks reused for other data
    log_.add_evictions(record.kv.evictions - evictions_seen_);
    evictions_seen_ = record.kv.evictions;
  }
  result_.steps.push_back(record);
  ++step_;
}

}  // namespace kvlab
