// edf: earliest deadline first. Waiting requests are admitted in the order their first tokens
// are due (RequestState::ttft_deadline_s: arrival + the TTFT SLO of their tenant or of [slo]);
// requests without a deadline come after all that have one, by arrival. With late = "last"
// (the default) a request whose deadline has already passed goes behind every one that can
// still make it: under overload plain EDF spends the machine on requests that are late anyway
// and makes the next ones late too (the domino effect); "keep" is plain EDF.
#include <stdexcept>
#include <string>
#include <string_view>

#include "kvlab/continuous_scheduler.hpp"

namespace {

struct EdfScheduler final : kvlab::ContinuousScheduler {
  EdfScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : ContinuousScheduler(params, {.order = kvlab::ContinuousPolicy::Order::arrival,
                                     .chunked_prefill = params.boolean("chunked_prefill"),
                                     .preempt_for_priority = false}),
        late_last_(late_last(params.string("late"))) {}

  kvlab::StepPlan schedule(const kvlab::SchedulerInput& input) override {
    const double now = input.now_s;
    const bool late_last = late_last_;
    hooks_.admission_order = [now, late_last](const kvlab::RequestState& a,
                                              const kvlab::RequestState& b) {
      const bool a_late = late_last && a.ttft_deadline_s < now;
      const bool b_late = late_last && b.ttft_deadline_s < now;
      if (a_late != b_late) return b_late;
      return a.ttft_deadline_s < b.ttft_deadline_s;
    };
    return ContinuousScheduler::schedule(input);
  }

 private:
  static bool late_last(std::string_view late) {
    if (late == "last") return true;
    if (late == "keep") return false;
    throw std::invalid_argument("late must be \"last\" or \"keep\", got \"" + std::string(late) +
                                "\"");
  }
  bool late_last_;
};

constexpr auto kParams = kvlab::with_own_params(
    kvlab::continuous_scheduler_params("8192", "\"last_admitted\""),
    std::array<kvlab::ParamSpec, 2>{{
        kvlab::kChunkedPrefillParam,
        {"late", kvlab::ParamType::param_string,
         "requests past their deadline: \"last\" (behind all that can still make it) or "
         "\"keep\" (plain EDF)",
         "\"last\"", 0, 0},
    }});

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, EdfScheduler, "edf",
             "earliest TTFT deadline first (arrival + the tenant's or [slo] ttft_s); late ones "
             "last",
             kParams)
