#pragma once
// Serving metrics: what happened to each request, and the summaries an experiment reports.
// Definitions (docs/metrics.md, generated from experiment/src/metric_registry.cpp):
//   TTFT  = first token time - arrival           queue delay = first scheduled - arrival
//   TPOT  = (finish - first token) / (output tokens - 1), requests with >= 2 output tokens
//   ITL   = every gap between consecutive output tokens, pooled over requests
//   e2e   = finish - arrival
//   goodput = finished requests meeting every SLO set, per second of the run
// Percentiles interpolate linearly between order statistics (numpy's default).
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvlab {

// Latency targets; an unset one is not checked. A request's own (its tenant's) override the
// run's ([slo]) key by key.
struct ServiceLevelObjectives {
  std::optional<double> ttft_s;
  std::optional<double> tpot_s;
  std::optional<double> e2e_s;
};

struct RequestTimeline {
  std::int64_t id = 0;
  int priority = 0;
  std::string tenant;
  ServiceLevelObjectives slo;  // its targets: its tenant's over the experiment's [slo]
  std::int64_t prompt_tokens = 0;
  double arrival_s = 0;
  std::optional<double> first_scheduled_s;
  std::vector<double> token_times_s;  // when each output token was produced
  std::optional<double> finish_s;
  bool rejected = false;
  std::string reject_reason;
  std::int64_t preemptions = 0;
  std::int64_t recomputed_tokens = 0;
  std::int64_t swapped_bytes = 0;
  std::int64_t prefix_hit_tokens = 0;  // prompt tokens the prefix cache served at first admission
  std::string finish_reason;  // "eos" | "max_tokens" | "context_full" | "handoff" | "cancelled"
  // Disaggregated prefill and decode: the KV handed from its prefill replica to its decode
  // replica (bytes in the pool's dtype), when the transfer ended there (the request's arrival
  // at the decode replica) and when that replica first scheduled it. 0 / nullopt otherwise.
  std::int64_t kv_transfer_bytes = 0;
  std::optional<double> kv_arrival_s, decode_scheduled_s;

  std::int64_t output_tokens() const { return static_cast<std::int64_t>(token_times_s.size()); }
  std::optional<double> ttft_s() const;
  std::optional<double> tpot_s() const;
  std::optional<double> e2e_s() const;
  std::optional<double> queue_delay_s() const;
};

struct LatencySummary {
  std::int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;  // all 0 when count == 0
};

// Linear-interpolation percentile of sorted values, q in [0, 100].
double percentile_of_sorted(std::span<const double> sorted, double q);
LatencySummary summarize_latencies(std::vector<double> values);

struct RunSummary {
  std::int64_t submitted = 0, finished = 0, rejected = 0;
  double duration_s = 0;
  double requests_per_s = 0, output_tokens_per_s = 0, total_tokens_per_s = 0;
  LatencySummary ttft_s, tpot_s, itl_s, e2e_s, queue_delay_s;
  std::int64_t slo_met = 0;  // finished requests meeting every SLO set
  double goodput_per_s = 0;  // slo_met / duration
  std::int64_t preemptions = 0, recomputed_tokens = 0, swapped_bytes = 0;
  // Disaggregated prefill and decode (requests handed to a decode replica): the KV transfer
  // (first token to the KV's arrival there), the wait there until scheduled, and the bytes.
  LatencySummary kv_transfer_s, decode_queue_s;
  std::int64_t kv_transfer_bytes = 0;
};

// Throws kvlab::Error when a request is neither finished nor rejected (the engine lost it):
// submitted = finished + rejected must hold. Each request is held to its own targets
// (RequestTimeline::slo: its tenant's over the experiment's [slo]); a target set in `instead`
// replaces every request's, to score a run against other targets.
RunSummary summarize_run(std::span<const RequestTimeline> requests, double duration_s,
                         const ServiceLevelObjectives& instead = {});
// A finished request met every target set: `instead`'s where set, else its own.
bool meets_slo(const RequestTimeline& request, const ServiceLevelObjectives& instead);

// One tenant's share of a run (requests with that RequestTimeline::tenant).
struct TenantSummary {
  std::string tenant;
  RunSummary run;  // summarize_run over its requests (its throughputs over the run's duration)
  // Service received: prompt tokens prefilled + output tokens generated, of finished requests.
  std::int64_t served_tokens = 0;
};
// Per tenant, in order of first arrival; empty when no request names a tenant.
std::vector<TenantSummary> summarize_tenants(std::span<const RequestTimeline> requests,
                                             double duration_s,
                                             const ServiceLevelObjectives& instead = {});
// The fairness gap of "Fairness in Serving LLMs" (VTC, OSDI 2024): the largest difference in
// service received (prompt tokens when the first token comes, each output token when it
// comes) between two tenants over any interval in which both are backlogged (each has a
// request that arrived and was not yet first scheduled). 0 with fewer than two tenants; with
// more than kMaxGapTenants, among the kMaxGapTenants busiest (most requests and tokens).
inline constexpr std::size_t kMaxGapTenants = 64;
double max_service_gap_tokens(std::span<const RequestTimeline> requests);

}  // namespace kvlab
