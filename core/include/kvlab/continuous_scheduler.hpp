#pragma once
// What the continuous scheduler plugins (fcfs, priority, chunked, sjf_oracle) share: one
// Scheduler running schedule_continuous with a policy, and their parameter table. A plugin is
// then its policy and its defaults.
#include <array>

#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

class ContinuousScheduler : public Scheduler {
 public:
  // `base` fixes order / chunking / priority preemption; the parameters fill in the rest.
  ContinuousScheduler(const PluginParams& params, ContinuousPolicy base)
      : policy_(continuous_policy_from_params(params, base)) {}
  StepPlan schedule(const SchedulerInput& input) override {
    return schedule_continuous(input, policy_, hooks_);
  }

 protected:
  // A plugin's own admission order and victim choice (set in its constructor).
  PolicyHooks hooks_;

 private:
  ContinuousPolicy policy_;
};

// max_batch, max_tokens_per_step, preemption, victim — with a plugin's own defaults (string
// literals in TOML syntax, e.g. "512" and "\"last_admitted\"").
constexpr std::array<ParamSpec, 4> continuous_scheduler_params(
    const char* max_tokens_per_step_default, const char* victim_default) {
  return {{
      {"max_batch", ParamType::param_integer, "running requests at most", "256", 1, 1 << 20},
      {"max_tokens_per_step", ParamType::param_integer, "prefill + decode tokens per step",
       max_tokens_per_step_default, 1, 1 << 24},
      {"preemption", ParamType::param_string,
       "recompute (free KV, recompute later) or swap (to the host swap pool)", "\"recompute\"", 0,
       0},
      {"victim", ParamType::param_string,
       "who gives way: last_admitted, lowest_priority or most_kv", victim_default, 0, 0},
  }};
}

// A plugin's own parameters after the shared ones.
template <std::size_t Shared, std::size_t Own>
constexpr std::array<ParamSpec, Shared + Own> with_own_params(std::array<ParamSpec, Shared> shared,
                                                              std::array<ParamSpec, Own> own) {
  std::array<ParamSpec, Shared + Own> all{};
  for (std::size_t i = 0; i < Shared; ++i) all[i] = shared[i];
  for (std::size_t i = 0; i < Own; ++i) all[Shared + i] = own[i];
  return all;
}

// The chunked_prefill switch the policy plugins (edf, vtc) offer: prompts split over steps
// within max_tokens_per_step, as the chunked scheduler does.
inline constexpr ParamSpec kChunkedPrefillParam{
    "chunked_prefill",
    ParamType::param_boolean,
    "split prompts into chunks within max_tokens_per_step (as the chunked scheduler)",
    "false",
    0,
    0};

}  // namespace kvlab
