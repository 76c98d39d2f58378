#include "kvlab/engine/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <new>
#include <optional>

#include "engine_extensions.hpp"
#include "kvlab/engine/admission.hpp"
#include "kvlab/engine/plan_check.hpp"
#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kv_groups.hpp"

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

std::int64_t expected_steps(std::span<const Submission> requests) {
  std::int64_t steps = 0;  // each step gives each running request a token, or prefills
  for (const Submission& r : requests) steps += r.output_tokens + 1;
  return steps;
}

Engine::Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler,
               EngineOptions options)
    : backend_(backend),
      allocator_(allocator),
      scheduler_(scheduler),
      options_(std::move(options)),
      apply_options_{options_.rules, options_.pool, options_.swap_slots},
      pricer_(options_.cost_model, options_.kv_tiers, options_.clock),
      admission_(options_.rules, options_.names.allocator) {}

Engine::~Engine() = default;

EngineResult Engine::run(const std::vector<Submission>& requests) {
  start(requests);
  while (step()) {
  }
  return take_result();
}

void Engine::start(const std::vector<Submission>& requests) {
  const bool priced = options_.clock == EngineClock::virtual_clock ||
                      options_.clock == EngineClock::offline ||
                      options_.clock == EngineClock::paced;
  if (priced && options_.cost_model == nullptr)
    throw Error(
        "engine: the virtual, offline and paced clocks price every step with a cost model; give "
        "EngineOptions::cost_model (a hardware profile: profiles/cpu.toml for the CPU backend) or "
        "use the measured clock");
  clock_ = make_clock(options_.clock);
  pending_cancels_.clear();
  own_extensions_ = engine_extensions(options_, backend_.vocab_size(), allocator_);
  extensions_.clear();
  for (const auto& extension : own_extensions_) extensions_.push_back(extension.get());
  extensions_.insert(extensions_.end(), options_.extensions.begin(), options_.extensions.end());
  table_ = std::make_unique<RequestTable>(requests, clock_->all_arrive_at_zero());
  log_ = {};
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
  for (StepExtension* extension : extensions_) extension->finish(result_);
  result_.tokens = table_->generated_tokens();
  result_.requests = table_->take_timelines();
  result_.logprobs = table_->take_logprobs();
  result_.events = log_.take();
  table_.reset();
  return std::move(result_);
}

RequestId Engine::submit(const Submission& request) {
  if (!table_) throw Error("engine: submit() before start()");
  return table_->submit(request);
}

RequestId Engine::submit_for_prefill(const Submission& request) {
  if (!table_) throw Error("engine: submit_for_prefill() before start()");
  return table_->submit_for_prefill(request);
}

RequestId Engine::submit_with_kv(const Submission& request, KvHandoff handoff) {
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
void Engine::apply_cancels(StepState& state) {
  std::erase_if(pending_cancels_, [&](RequestId id) {
    if (!table_->has_arrived(id)) return false;
    RequestState& r = table_->at(id);
    if (r.status == RequestStatus::finished || r.status == RequestStatus::rejected) return true;
    if (r.status == RequestStatus::running) allocator_.free(id);
    for (StepExtension* extension : extensions_) extension->on_leave(state, id);
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
  return replica_load(table_.get(), allocator_);
}

// Requests whose arrival time has come join the waiting queue, or are rejected with the reason.
void Engine::receive_arrivals() {
  log_.set_time(step_, clock_->now());
  while (const auto next = table_->next_arrival()) {
    if (table_->at(*next).arrival_s > clock_->now()) break;
    const RequestId id = table_->arrive();
    if (std::string reason = admission_.never_fits(table_->at(id), extensions_, allocator_);
        !reason.empty()) {
      log_.add(EventKind::event_reject, id, reason);
      table_->reject(id, std::move(reason));
    }
  }
}

bool Engine::step() {
  StepRecord record;
  StepState state{step_, 0, *table_, allocator_, record, options_.cost_model};
  if (const std::optional<bool> more = begin_step(state)) return *more;
  for (StepExtension* extension : extensions_) extension->before_plan(state);
  step_start_ = SteadyClock::now();
  bool fragmentation_blocked = false;
  AppliedPlan applied = plan_and_apply(fragmentation_blocked);
  state.applied = &applied;
  if (applied.batch.empty()) return retry_or_idle(state);
  idle_steps_ = 0;
  record.preempted = applied.preempted;
  const std::vector<std::int32_t> sampled = run_batch(state, applied);
  update(state, sampled);
  record_step(record, fragmentation_blocked);
  return !table_->all_done();
}

// Before the plan: a real-time clock that sat idle (a live engine's wait) reads now, arrivals
// come in and cancellations take effect. A value when the step ends there: false, every request
// is done; true, nothing waits or runs and the clock moved to the next arrival.
std::optional<bool> Engine::begin_step(StepState& state) {
  const std::optional<RequestId> next = table_->next_arrival();
  const bool busy = !table_->waiting().empty() || !table_->running().empty();
  clock_->catch_up(next ? std::optional<double>(table_->at(*next).arrival_s) : std::nullopt, busy);
  state.now = clock_->now();
  receive_arrivals();
  if (!pending_cancels_.empty()) apply_cancels(state);
  if (table_->all_done()) return false;
  if (table_->waiting().empty() && table_->running().empty()) {  // idle until the next arrival
    clock_->idle_until(table_->at(*table_->next_arrival()).arrival_s);
    return true;
  }
  return std::nullopt;
}

// 1. plan, checked before it is applied, 2. apply.
AppliedPlan Engine::plan_and_apply(bool& fragmentation_blocked) {
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
  fragmentation_blocked = admission_blocked_by_fragmentation(plan, *table_, allocator_);
  return applied;
}

// The plan applied to nothing: an extension that freed KV (a static batch's padding after a
// preemption emptied it) has the step plan again; otherwise the step idles.
bool Engine::retry_or_idle(StepState& state) {
  bool retry = false;
  for (StepExtension* extension : extensions_) retry = extension->retry_empty_batch(state) || retry;
  if (retry) return true;
  idle_step();
  return !table_->all_done();
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

// The step's requests' entries: each request's tokens from its computed count (as many as it has
// of the work's: an extension adds what it feeds beyond them) and its KV view.
std::vector<BatchEntry> Engine::batch_entries(const AppliedPlan& applied) const {
  std::vector<BatchEntry> batch;
  batch.reserve(applied.batch.size());
  const bool slots = reads_kv_slots();
  const KvGroupViewing* groups = slots ? allocator_.features().groups : nullptr;
  for (const ScheduledWork& work : applied.batch) {
    const RequestState& r = table_->at(work.id);
    const auto computed = static_cast<std::size_t>(r.computed);
    BatchEntry entry;
    entry.tokens = std::span<const std::int32_t>(r.tokens).subspan(
        computed, std::min(static_cast<std::size_t>(work.tokens), r.tokens.size() - computed));
    entry.start_position = r.computed;
    entry.view = slots ? allocator_.view(work.id) : allocator_.positions_view(work.id);
    if (groups != nullptr)
      for (std::int64_t g = 0; g < static_cast<std::int64_t>(groups->layer_groups().groups.size());
           ++g)
        entry.group_views.push_back(groups->group_view(work.id, g));
    batch.push_back(std::move(entry));
  }
  return batch;
}

// 3. The forward over the batch as the extensions shaped it, priced for the clock; 4. each
// sampling entry's token. Token choices are offered to the backend unless someone reads the
// logits (on_logits).
std::vector<std::int32_t> Engine::run_batch(StepState& state, AppliedPlan& applied) {
  std::vector<BatchEntry> batch = batch_entries(applied);
  for (StepExtension* extension : extensions_) extension->shape_batch(state, batch);
  const std::vector<TokenChoice> choices = draw_token_choices(applied, *table_, batch.size());
  const std::span<const TokenChoice> offered =
      options_.observers.on_logits ? std::span<const TokenChoice>() : choices;
  const auto start = SteadyClock::now();
  const ForwardResult result = plugin_call<PluginErrors::non_kvlab>(
      options_.names.backend, step_, [&] { return backend_.forward(batch, offered); });
  const auto end = SteadyClock::now();
  StepRecord& record = state.record;
  record.step = step_;
  record.start_s = clock_->now();
  record.batch = static_cast<std::int64_t>(applied.batch.size());
  record.prefill_tokens = applied.prefill_tokens;
  record.decode_tokens = applied.decode_tokens;
  record.measured_forward_s = seconds_between(start, end);
  record.measured_step_s = seconds_between(step_start_, end);
  const auto requests = std::span<const BatchEntry>(batch).first(applied.batch.size());
  record.duration_s = clock_->advance(price(state, requests));
  state.now = clock_->now();
  std::vector<std::int32_t> sampled =
      pick_tokens(result, choices, applied, *table_, backend_.vocab_size(), step_,
                  options_.observers, [this](std::int32_t t) { return options_.rules.is_eos(t); });
  for (StepExtension* extension : extensions_) extension->after_forward(state, requests, result);
  return sampled;
}

// The step as the clock prices it (StepPricer), with what the extensions add.
StepTiming Engine::price(StepState& state, std::span<const BatchEntry> requests) {
  priced_rows_.clear();
  StepTiming timing;
  for (StepExtension* extension : extensions_) extension->price(state, priced_rows_, timing);
  return pricer_.price(*state.applied, requests, priced_rows_, timing, allocator_, state.record);
}

// 5. update: tokens appended, stop rules, finished KV freed (a padded static batch's finished
// requests held for its extension), handoffs stamped; then the extensions.
void Engine::update(StepState& state, std::span<const std::int32_t> sampled) {
  log_.set_time(step_, clock_->now());
  std::vector<RequestId> finished_held;
  const std::size_t handed = handoffs_.size();
  apply_tokens(*state.applied, sampled, clock_->now(), *table_, allocator_, apply_options_, log_,
               &finished_held, &handoffs_);
  for (std::size_t h = handed; h < handoffs_.size(); ++h) handoffs_[h].time_s = clock_->now();
  for (StepExtension* extension : extensions_) extension->after_update(state, finished_held);
}

// Whether the backend may read the batch's KV slots: not when the pool holds no K/V anywhere
// (the simulated backend's bookkeeping pool), whose views then carry positions only. A test
// engine without a pool gets whole views.
bool Engine::reads_kv_slots() const {
  const KvPool* pool = options_.pool;
  return pool == nullptr || pool->has_storage() || pool->device() != nullptr;
}

// A KIVI pool's fp16 open groups: those the pool holds, or on a pool without storage (the
// simulated backend's) those its running sequences would hold (kivi_open_groups).
std::int64_t Engine::kivi_residual_bytes() const {
  const KvPool* pool = options_.pool;
  if (pool == nullptr || !dtype_is_kivi(pool->shape().dtype)) return 0;
  if (pool->has_storage()) return pool->open_group_bytes();
  std::int64_t groups = 0;
  for (const RequestState* r : table_->running())
    groups += kivi_open_groups(r->computed, pool->shape().kivi_residual);
  return groups * pool->bytes_per_open_group();
}

// The step's record: queue lengths and the allocator's numbers after the update.
void Engine::record_step(StepRecord record, bool fragmentation_blocked) {
  record.waiting = static_cast<std::int64_t>(table_->waiting().size());
  record.running = static_cast<std::int64_t>(table_->running().size());
  record.kv = allocator_.stats();
  record.kv_residual_bytes = kivi_residual_bytes();
  record.blocking_unusable_free = fragmentation_blocked ? record.kv.unusable_free : 0;
  if (record.kv.evictions > evictions_seen_) {  // cached prefix blocks reused for other data
    log_.add_evictions(record.kv.evictions - evictions_seen_);
    evictions_seen_ = record.kv.evictions;
  }
  result_.steps.push_back(record);
  ++step_;
}

}  // namespace kvlab
