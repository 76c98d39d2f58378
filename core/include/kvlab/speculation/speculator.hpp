#pragma once
// Speculative decoding as a step extension (kvlab/engine/step_extension.hpp): before each plan
// every running decode gets up to speculation.tokens proposals from the proposer (fixed, or an
// adaptive length by the acceptance measured so far and the step's price); the batch's verify
// entries carry the newest token and the proposals, a row of logits each; after the forward the
// acceptance is counted (and the step's time, for a measured adaptive length); a request that
// stops running has its proposals forgotten. The draft's steps are priced on the virtual clocks
// (EngineOptions::draft_cost_model); the proposer's own time is measured on every clock.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvlab/engine/engine.hpp"
#include "kvlab/engine/step_extension.hpp"
#include "kvlab/proposer.hpp"
#include "kvlab/speculation/speculation.hpp"

namespace kvlab {

class Speculator final : public StepExtension {
 public:
  // The engine's options (speculation, proposer, names, rules, cost models) and the target's
  // vocabulary; throws kvlab::Error for settings that cannot run (a KV policy beside it, a
  // priced adaptive length without a cost model).
  Speculator(const EngineOptions& options, std::int64_t vocab);

  void on_leave(StepState& step, RequestId id) override {
    step_ = step.step;
    forget(id);
  }
  void before_plan(StepState& step) override;
  void shape_batch(StepState& step, std::vector<BatchEntry>& batch) override;
  void price(StepState& step, std::vector<EntryShape>& rows, StepTiming& timing) override;
  void after_forward(StepState& step, std::span<const BatchEntry> requests,
                     const ForwardResult& result) override;
  void after_update(StepState& step, std::span<const RequestId> held) override;
  void finish(EngineResult& result) override { result.verifies = std::move(verifies_); }

 private:
  double propose(StepState& step);  // returns the seconds it took
  void check_proposals(std::int64_t step, std::span<const ProposeAsk> asks) const;
  double price_draft(std::span<const ProposeAsk> asks) const;
  void forget(RequestId id);
  std::vector<std::int64_t> proposal_lengths(std::span<const RequestState* const> decodes,
                                             std::span<const std::int64_t> rooms) const;
  std::optional<double> uniform_verify_seconds(std::span<const RequestState* const> decodes,
                                               std::int64_t k) const;
  // A priced draft's step at each depth: for one decode proposing, and for all of them (empty:
  // no draft priced); at(): linear between, 0 with none proposing.
  struct DraftPrices {
    std::vector<double> one, all;
    double at(std::size_t depth, std::int64_t proposing, std::int64_t decodes) const;
  };
  DraftPrices draft_prices(std::span<const RequestState* const> decodes) const;
  void count_acceptance(std::int64_t step, const AppliedPlan& applied);

  const SpeculationOptions& spec_;
  std::int64_t context_, vocab_;
  const std::string& proposer_name_;
  const CostModel *cost_model_, *draft_cost_model_;
  std::unique_ptr<Proposer> owned_proposer_;  // the built-in one, without EngineOptions::proposer
  Proposer* proposer_;
  std::int64_t step_ = 0;     // the step being proposed for (its errors name it)
  double draft_price_s_ = 0;  // this step's proposals' price (draft_cost_model)
  // The proposals accepted so far out of the positions tried (each verify tries its accepted
  // ones and, unless all were, the first rejected one), in all and per request.
  double accepted_ = 0, tried_ = 0;
  std::unordered_map<RequestId, std::pair<double, double>> by_request_;  // accepted, tried
  StepTimes step_times_;  // AdaptiveLength::measured: the steps' times by their tokens
  std::vector<std::int32_t> verified_;  // verify entries' tokens: the newest, then the proposals
  std::vector<VerifyRecord> verifies_;
};

}  // namespace kvlab
