#include "kvlab/speculation/speculator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"

namespace kvlab {
namespace {

using SteadyClock = std::chrono::steady_clock;

}  // namespace

Speculator::Speculator(const EngineOptions& options, std::int64_t vocab)
    : spec_(options.speculation),
      context_(options.rules.context),
      vocab_(vocab),
      proposer_name_(options.names.proposer),
      cost_model_(options.cost_model),
      draft_cost_model_(options.draft_cost_model),
      proposer_(options.proposer) {
  if (options.kv_policy != nullptr)
    throw Error(
        "engine: speculative decoding with a KV policy is not supported: a rejected proposal is "
        "rolled back by truncating the sequence, which a policy's dropped positions prevent; run "
        "[speculation] without [kv_policy]");
  if (spec_.adaptive == AdaptiveLength::priced && cost_model_ == nullptr)
    throw Error(
        "engine: an adaptive proposal length priced by the cost model needs one; give "
        "EngineOptions::cost_model (a hardware profile), price by the steps' measured times "
        "(AdaptiveLength::measured) or use a fixed speculation.tokens");
  if (proposer_ == nullptr) {
    owned_proposer_ = make_proposer(spec_, vocab, options.rules.eos_token_ids);
    proposer_ = owned_proposer_.get();
  }
}

void Speculator::before_plan(StepState& step) {
  step_ = step.step;
  step.record.propose_s = propose(step);
}

// Speculative decoding's proposals for this step: each running decode (not handed off) gets up
// to speculation.tokens, never past its output limit or the context, from one call of the
// proposer; every other request's are cleared.
double Speculator::propose(StepState& step) {
  draft_price_s_ = 0;
  const auto start = SteadyClock::now();
  RequestTable& table = step.table;
  std::vector<const RequestState*> decodes;
  for (const RequestState* running : table.running()) {
    RequestState& r = table.at(running->id);
    r.proposed.clear();
    if (!r.decoding() || r.recompute_each_step || table.hands_off(r.id)) continue;
    decodes.push_back(&r);
  }
  // Each decode's proposals at most: `tokens`, within its output limit and the context.
  std::vector<std::int64_t> rooms;
  for (const RequestState* r : decodes)
    rooms.push_back(
        std::min({spec_.tokens, r->remaining_output() - 1, context_ - r->length() - 1}));
  const std::vector<std::int64_t> lengths = proposal_lengths(decodes, rooms);
  std::vector<ProposeAsk> asks;
  for (std::size_t i = 0; i < decodes.size(); ++i) {
    RequestState& r = table.at(decodes[i]->id);
    if (lengths[i] > 0) asks.push_back({&r, lengths[i], &r.proposed});
  }
  if (!asks.empty()) {
    plugin_call<PluginErrors::non_kvlab>(proposer_name_, step_, [&] { proposer_->propose(asks); });
    check_proposals(step_, asks);
    draft_price_s_ = price_draft(asks);
  }
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// A proposer's answer, checked before anything uses it: no more tokens than asked, each in the
// vocabulary.
void Speculator::check_proposals(std::int64_t step, std::span<const ProposeAsk> asks) const {
  for (const ProposeAsk& ask : asks) {
    const auto count = static_cast<std::int64_t>(ask.proposed->size());
    const auto bad = std::find_if(ask.proposed->begin(), ask.proposed->end(),
                                  [&](std::int32_t t) { return t < 0 || t >= vocab_; });
    if (count > ask.max_tokens || bad != ask.proposed->end())
      throw Error(fmt::format(
          "step {}: {} answered request {} with {} proposals{} (asked for at most {}, each a "
          "token id below {})",
          step, proposer_name_, ask.request->id, count,
          bad != ask.proposed->end() ? fmt::format(", one of them {}", *bad) : std::string(),
          ask.max_tokens, vocab_));
  }
}

// The draft model's steps for these proposals (draft_cost_model): as many sequential decode
// steps as the longest proposal, each over the decodes still proposing (one token a sequence, its
// context growing by one a step; draft_step_seconds). 0 without a draft.
double Speculator::price_draft(std::span<const ProposeAsk> asks) const {
  if (draft_cost_model_ == nullptr) return 0;
  double seconds = 0;
  std::vector<EntryShape> shapes;
  for (std::int64_t j = 0;; ++j) {
    shapes.clear();
    for (const ProposeAsk& ask : asks)
      if (static_cast<std::int64_t>(ask.proposed->size()) > j)
        shapes.push_back({1, ask.request->computed + j, 0, 1});
    if (shapes.empty()) return seconds;
    seconds += draft_step_seconds(*draft_cost_model_, shapes);
  }
}

void Speculator::forget(RequestId id) {
  plugin_call<PluginErrors::non_kvlab>(proposer_name_, step_, [&] { proposer_->forget(id); });
}

// Each decode's proposals at most (rooms[i], up to speculation.tokens), or with an adaptive length
// the best for these decodes by each request's acceptance so far and the price of the step: the
// cost model's, or the measured times of the steps run so far. Until 64 proposed positions have
// been tried it proposes `tokens`: an acceptance nobody measured (a prior of 1/2 worth 4
// positions) could keep it from ever proposing, and so from ever learning that the proposals pay.
// A request's own acceptance counts as much as its positions tried against 32 of the run's.
std::vector<std::int64_t> Speculator::proposal_lengths(std::span<const RequestState* const> decodes,
                                                       std::span<const std::int64_t> rooms) const {
  constexpr double kAcceptanceEvidence = 64;  // positions tried before the acceptance is trusted
  constexpr double kRunsWeight = 32;          // the run's acceptance, in a request's positions
  const SpeculationOptions& spec = spec_;
  std::vector<std::int64_t> lengths(rooms.begin(), rooms.end());
  if (spec.adaptive == AdaptiveLength::off || decodes.empty() || tried_ < kAcceptanceEvidence)
    return lengths;
  const double run = (accepted_ + 2) / (tried_ + 4);
  std::vector<double> acceptance;
  for (const RequestState* r : decodes) {
    const auto it = by_request_.find(r->id);
    const auto [accepted, tried] = it == by_request_.end() ? std::pair{0.0, 0.0} : it->second;
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
std::optional<double> Speculator::uniform_verify_seconds(
    std::span<const RequestState* const> decodes, std::int64_t k) const {
  const auto count = static_cast<std::int64_t>(decodes.size());
  if (spec_.adaptive == AdaptiveLength::measured) return step_times_.seconds(count * (1 + k));
  std::vector<EntryShape> shapes;
  for (const RequestState* r : decodes) shapes.push_back({1 + k, r->computed, 0, 1 + k});
  const CostModel& cost = *cost_model_;
  return cost.cost(cost.work(shapes)).total();
}

// A priced draft's step at each depth j (0..tokens - 1), for one decode (the first) and for all.
Speculator::DraftPrices Speculator::draft_prices(
    std::span<const RequestState* const> decodes) const {
  DraftPrices prices;
  const CostModel* draft = draft_cost_model_;
  if (draft == nullptr || spec_.adaptive != AdaptiveLength::priced) return prices;
  std::vector<EntryShape> shapes;
  for (std::int64_t j = 0; j < spec_.tokens; ++j) {
    shapes.clear();
    for (const RequestState* r : decodes) shapes.push_back({1, r->computed + j, 0, 1});
    prices.all.push_back(draft_step_seconds(*draft, shapes));
    prices.one.push_back(draft_step_seconds(*draft, std::span(shapes).first(1)));
  }
  return prices;
}

double Speculator::DraftPrices::at(std::size_t depth, std::int64_t proposing,
                                   std::int64_t decodes) const {
  if (depth >= all.size() || proposing == 0) return 0;
  if (decodes == 1) return all[depth];
  return one[depth] + (all[depth] - one[depth]) * static_cast<double>(proposing - 1) /
                          static_cast<double>(decodes - 1);
}

// The acceptance measured so far: each verify tried its accepted positions and, unless it
// accepted them all, the first rejected one.
void Speculator::count_acceptance(std::int64_t step, const AppliedPlan& applied) {
  for (const ScheduledWork& work : applied.batch) {
    if (work.proposals == 0) continue;
    verifies_.push_back({step, work.id, work.proposals, work.accepted});
    const double tried =
        static_cast<double>(work.accepted + (work.accepted < work.proposals ? 1 : 0));
    accepted_ += static_cast<double>(work.accepted);
    tried_ += tried;
    auto& [accepted, tried_by_request] = by_request_[work.id];
    accepted += static_cast<double>(work.accepted);
    tried_by_request += tried;
  }
}

// Each verify entry: the newest token and the proposals, a row of logits at each.
void Speculator::shape_batch(StepState& step, std::vector<BatchEntry>& batch) {
  const AppliedPlan& applied = *step.applied;
  std::size_t verify_tokens = 0;
  for (const ScheduledWork& work : applied.batch)
    if (work.proposals > 0) verify_tokens += static_cast<std::size_t>(work.tokens);
  verified_.clear();
  verified_.reserve(verify_tokens);  // (the entries' spans point into it)
  for (std::size_t i = 0; i < applied.batch.size(); ++i) {
    const ScheduledWork& work = applied.batch[i];
    if (work.proposals == 0) continue;
    const RequestState& r = step.table.at(work.id);
    const std::size_t at = verified_.size();
    verified_.push_back(r.tokens.back());
    verified_.insert(verified_.end(), r.proposed.begin(), r.proposed.begin() + work.proposals);
    batch[i].tokens = std::span<const std::int32_t>(verified_).subspan(at);
    batch[i].logit_rows = static_cast<std::int32_t>(1 + work.proposals);
    step.record.proposed_tokens += work.proposals;
    ++step.record.verify_entries;
  }
}

// The proposer's measured time, and the draft's steps as the cost model prices them.
void Speculator::price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) {
  (void)rows;
  timing.measured_propose_s = step.record.propose_s;
  if (step.cost_model != nullptr)
    timing.modelled_propose_s = step.record.predicted_propose_s = draft_price_s_;
}

void Speculator::after_forward(StepState& step, std::span<const BatchEntry> requests,
                               const ForwardResult& result) {
  (void)requests;
  (void)result;
  for (const ScheduledWork& work : step.applied->batch)
    step.record.accepted_tokens += work.accepted;
  count_acceptance(step.step, *step.applied);
  if (spec_.adaptive == AdaptiveLength::measured)
    step_times_.observe(step.record.prefill_tokens + step.record.decode_tokens,
                        step.record.duration_s);
}

// A request that stopped running here (finished, preempted or handed off) proposes afresh.
void Speculator::after_update(StepState& step, std::span<const RequestId> held) {
  (void)held;
  for (const ScheduledWork& work : step.applied->batch)
    if (step.table.at(work.id).status != RequestStatus::running || step.table.hands_off(work.id))
      forget(work.id);
}

}  // namespace kvlab
