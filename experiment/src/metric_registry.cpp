#include "kvlab/experiment/metric_registry.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace kvlab {

nlohmann::json latency_json(const LatencySummary& l) {
  return nlohmann::json{{"count", l.count}, {"mean", l.mean}, {"p50", l.p50},
                        {"p90", l.p90},     {"p99", l.p99},   {"max", l.max}};
}

namespace {

using json = nlohmann::json;

const KvAllocatorStats& last_kv(const RunOutput& out) {
  static const KvAllocatorStats none;
  return out.engine.steps.empty() ? none : out.engine.steps.back().kv;
}

// Mean fractions of the pool over steps: what the waste is made of.
json waste_breakdown(const RunOutput& out) {
  double reserved = 0, slack = 0, padding = 0, blocking = 0, unusable = 0;
  for (const auto& s : out.engine.steps) {
    const double capacity = static_cast<double>(s.kv.capacity);
    reserved += static_cast<double>(s.kv.reserved_unused) / capacity;
    slack += static_cast<double>(s.kv.last_block_slack) / capacity;
    padding += static_cast<double>(s.padding_slots) / capacity;
    blocking += static_cast<double>(s.blocking_unusable_free) / capacity;
    unusable += static_cast<double>(s.kv.unusable_free) / capacity;
  }
  const double n = out.engine.steps.empty() ? 1.0 : static_cast<double>(out.engine.steps.size());
  return {{"reserved_unused", reserved / n},
          {"last_block_slack", slack / n},
          {"padding", padding / n},
          {"unusable_free_blocking", blocking / n},
          {"unusable_free_all", unusable / n}};
}

// Speculative decoding's totals over the steps; null for a run without [speculation].
json speculation_total(const ExperimentConfig& c, const RunOutput& out,
                       double (*value)(std::int64_t verifies, std::int64_t proposed,
                                       std::int64_t accepted, double propose_s)) {
  std::int64_t verifies = 0, proposed = 0, accepted = 0;
  double propose_s = 0;
  for (const auto& s : out.engine.steps) {
    verifies += s.verify_entries;
    proposed += s.proposed_tokens;
    accepted += s.accepted_tokens;
    propose_s += s.propose_s;
  }
  // (a sweep's table reads every point with one point's config: the steps say it too)
  if (!c.speculation.enabled() && verifies == 0) return json();
  return value(verifies, proposed, accepted, propose_s);
}

double ratio(std::int64_t a, std::int64_t b) {
  return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0;
}

// TTFT of the finished requests of each priority level of the workload (0 .. weights - 1).
json ttft_by_priority(const ExperimentConfig& c, const RunOutput& out) {
  const int levels = std::max<int>(1, static_cast<int>(c.workload.priority_weights.size()));
  json all = json::array();
  for (int p = 0; p < levels; ++p) {
    std::vector<double> ttft;
    for (const auto& r : out.engine.requests)
      if (r.priority == p)
        if (const auto t = r.ttft_s()) ttft.push_back(*t);
    all.push_back(latency_json(summarize_latencies(std::move(ttft))));
  }
  return all;
}

// A per-tenant value: {tenant: value(its TenantSummary)}, null for a run without tenants.
template <typename Value>
json by_tenant(const ExperimentConfig&, const RunOutput& out, Value value) {
  if (out.tenants.empty()) return json();
  json all = json::object();
  for (const TenantSummary& t : out.tenants) all[t.tenant] = value(t);
  return all;
}

// SLO attainment: requests meeting every SLO set / submitted (the run's, or a tenant's).
json slo_fraction(const RunSummary& s) {
  return s.submitted ? static_cast<double>(s.slo_met) / static_cast<double>(s.submitted) : 0.0;
}

// e2e / output tokens of each finished request with an output token, averaged (vLLM's paper,
// section 6: "normalized latency").
json normalized_latency(const ExperimentConfig&, const RunOutput& out) {
  double sum = 0;
  std::int64_t count = 0;
  for (const auto& r : out.engine.requests)
    if (const auto e2e = r.e2e_s(); e2e && r.output_tokens() > 0) {
      sum += *e2e / static_cast<double>(r.output_tokens());
      ++count;
    }
  return count == 0 ? 0.0 : sum / static_cast<double>(count);
}

json optional_latency(const std::optional<LatencySummary>& l) {
  return l ? latency_json(*l) : json();
}

#define SUMMARY(field) [](const ExperimentConfig&, const RunOutput& out) { return json(field); }
// A per-tenant metric: `field` of each tenant's TenantSummary t.
#define TENANT_METRIC(field)                                                      \
  [](const ExperimentConfig& c, const RunOutput& out) {                           \
    return by_tenant(c, out, [](const TenantSummary& t) { return json(field); }); \
  }
// A [kv_tiers] total (t: RunOutput::KvTierTotals), null for a run without tiers.
#define TIER_METRIC(field)                            \
  [](const ExperimentConfig&, const RunOutput& out) { \
    if (!out.kv_tiers) return json();                 \
    const RunOutput::KvTierTotals& t = *out.kv_tiers; \
    return json(field);                               \
  }

const RunMetric kRunMetrics[] = {
    {"submitted",
     "requests",
     "requests the workload submitted",
     "count",
     true,
     SUMMARY(out.summary.submitted),
     {}},
    {"finished",
     "requests",
     "requests that ended with EOS, max tokens or a full context",
     "count",
     true,
     SUMMARY(out.summary.finished),
     {{"", "finished", "", 0}}},
    {"rejected",
     "requests",
     "requests that could never run (longer than the context or the KV pool), each with its "
     "reason in requests.csv",
     "count",
     true,
     SUMMARY(out.summary.rejected),
     {{"", "rejected", "", 0}}},
    {"duration_s",
     "s",
     "the run's length on its clock: from 0 to the last request's end",
     "once per run",
     true,
     SUMMARY(out.summary.duration_s),
     {}},
    {"requests_per_s",
     "requests/s",
     "throughput: finished requests per second of the run",
     "finished / duration",
     true,
     SUMMARY(out.summary.requests_per_s),
     {{"", "req/s", "", 2}}},
    {"output_tokens_per_s",
     "tokens/s",
     "throughput: generated tokens per second of the run",
     "output tokens / duration",
     true,
     SUMMARY(out.summary.output_tokens_per_s),
     {{"", "out tok/s", "", 1}}},
    {"total_tokens_per_s",
     "tokens/s",
     "throughput: prompt and generated tokens per second",
     "(prompt + output tokens) / duration",
     true,
     SUMMARY(out.summary.total_tokens_per_s),
     {}},
    {"ttft_s",
     "s",
     "time to first token (TTFT): first output token time - arrival",
     "over finished requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.ttft_s)),
     {{"", "TTFT p50 (s)", "p50", 3}, {"", "TTFT p99", "p99", 3}}},
    {"tpot_s",
     "s",
     "time per output token (TPOT): (last token - first token) / (output tokens - 1), requests "
     "with at least 2 tokens",
     "over those requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.tpot_s)),
     {{"", "TPOT p50", "p50", 4}, {"", "TPOT p99", "p99", 4}}},
    {"itl_s",
     "s",
     "inter-token latency (ITL): every gap between consecutive output tokens",
     "pooled over requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.itl_s)),
     {{"", "ITL p99", "p99", 4}}},
    {"e2e_s",
     "s",
     "end-to-end latency: finish - arrival",
     "over finished requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.e2e_s)),
     {{"e2e_p50", "e2e p50 (s)", "p50", 3}}},
    {"queue_delay_s",
     "s",
     "queueing delay: first scheduled - arrival",
     "over scheduled requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.queue_delay_s)),
     {{"queue_p99", "queue p99 (s)", "p99", 3}}},
    {"normalized_latency_s",
     "s/token",
     "normalized latency (vLLM's paper): a request's end-to-end latency / its output tokens",
     "mean over finished requests with an output token",
     true,
     normalized_latency,
     {{"normalized_latency", "norm. latency (s/tok)", "", 4}}},
    {"ttft_by_priority",
     "s",
     "TTFT of the finished requests of each priority level",
     "per level: mean, p50, p90, p99, max",
     false,
     ttft_by_priority,
     {{"ttft_by_priority", "TTFT p50 prio {level}", "p50", 3},
      {"ttft_by_priority", "TTFT p99 prio {level}", "p99", 3}}},
    {"requests_by_tenant",
     "requests",
     "requests each tenant submitted ([[workload.tenants]] or the trace's tenant column)",
     "count per tenant",
     true,
     TENANT_METRIC(t.run.submitted),
     {}},
    {"ttft_by_tenant",
     "s",
     "TTFT of each tenant's finished requests",
     "per tenant: mean, p50, p90, p99, max",
     true,
     TENANT_METRIC(latency_json(t.run.ttft_s)),
     {{"tenants", "TTFT p50 {tenant}", "p50", 3}, {"tenants", "TTFT p99 {tenant}", "p99", 3}}},
    {"tpot_by_tenant",
     "s",
     "TPOT of each tenant's requests with at least 2 output tokens",
     "per tenant: mean, p50, p90, p99, max",
     true,
     TENANT_METRIC(latency_json(t.run.tpot_s)),
     {}},
    {"slo_attainment_by_tenant",
     "fraction",
     "each tenant's requests meeting every SLO set (its own [[workload.tenants]] targets, over "
     "[slo]) / its requests",
     "per tenant",
     true,
     TENANT_METRIC(slo_fraction(t.run)),
     {{"tenant_slo", "SLO met {tenant}", "", 1, true}}},
    {"goodput_by_tenant",
     "requests/s",
     "each tenant's finished requests meeting every SLO set, per second of the run",
     "per tenant: its slo_met / the run's duration",
     true,
     TENANT_METRIC(t.run.goodput_per_s),
     {}},
    {"served_tokens_by_tenant",
     "tokens",
     "service each tenant received: prompt tokens prefilled + output tokens generated, of its "
     "finished requests",
     "sum per tenant",
     true,
     TENANT_METRIC(t.served_tokens),
     {{"tenants", "served tok {tenant}", "", 0}}},
    {"max_service_gap_tokens",
     "tokens",
     "the fairness gap of the VTC paper (OSDI 2024): the largest difference in service received "
     "(prompt + output tokens, each counted when its token comes) between two tenants over an "
     "interval in which both had requests waiting (among the 64 busiest tenants)",
     "over the run; null without tenants",
     true,
     [](const ExperimentConfig&, const RunOutput& out) {
       return out.service_gap_tokens ? json(*out.service_gap_tokens) : json();
     },
     {{"tenants", "service gap (tok)", "", 0}}},
    {"slo_met",
     "requests",
     "finished requests meeting every SLO set ([slo] ttft, tpot, e2e)",
     "count",
     true,
     SUMMARY(out.summary.slo_met),
     {}},
    {"goodput_per_s",
     "requests/s",
     "goodput (DistServe): finished requests meeting every SLO set, per second of the run",
     "slo_met / duration",
     true,
     SUMMARY(out.summary.goodput_per_s),
     {{"goodput", "goodput req/s", "", 2}}},
    {"goodput_per_gpu",
     "requests/s/GPU",
     "goodput per GPU: goodput_per_s / the cluster's GPUs (each replica's tensor_parallel x "
     "context_parallel, summed): how DistServe compares colocated and disaggregated clusters",
     "goodput_per_s / GPUs",
     true,
     [](const ExperimentConfig& c, const RunOutput& out) {
       return json(out.summary.goodput_per_s / static_cast<double>(c.gpus()));
     },
     {{"goodput_per_gpu", "goodput/GPU", "", 3}}},
    {"kv_transfer_s",
     "s",
     "disaggregated prefill and decode: the KV handoff of a request, from its first token on the "
     "prefill replica to the KV's arrival on its decode replica (waiting for a busy link "
     "included)",
     "over handed-off requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.kv_transfer_s)),
     {{"kv_transfer_p50", "KV transfer p50 (s)", "p50", 4}}},
    {"decode_queue_s",
     "s",
     "disaggregated prefill and decode: a handed-off request's wait on its decode replica, from "
     "its KV's arrival to its first decode step",
     "over handed-off requests: mean, p50, p90, p99, max",
     true,
     SUMMARY(latency_json(out.summary.decode_queue_s)),
     {{"decode_queue_p99", "decode queue p99 (s)", "p99", 4}}},
    {"kv_transfer_bytes",
     "bytes",
     "disaggregated prefill and decode: KV handed from prefill to decode replicas, in the pool's "
     "dtype",
     "sum over requests",
     true,
     SUMMARY(out.summary.kv_transfer_bytes),
     {{"kv_transfer_mib", "KV transfer MiB", "", 1, false, 1.0 / (1 << 20)}}},
    {"slo_attainment",
     "fraction",
     "SLO attainment: requests meeting every SLO set / submitted",
     "slo_met / submitted",
     false,
     SUMMARY(slo_fraction(out.summary)),
     {{"slo_attainment", "SLO met", "", 1, true}}},
    {"preemptions",
     "count",
     "times a running request was preempted (recompute or swap)",
     "sum over requests",
     true,
     SUMMARY(out.summary.preemptions),
     {{"", "preempt", "", 0}}},
    {"spec_proposed_tokens",
     "tokens",
     "speculative decoding: proposed tokens the target verified (each beside a decode's newest "
     "token, in the same entry)",
     "sum over steps",
     true,
     [](const ExperimentConfig& c, const RunOutput& out) {
       return speculation_total(c, out, [](std::int64_t, std::int64_t p, std::int64_t, double) {
         return static_cast<double>(p);
       });
     },
     {}},
    {"spec_acceptance_rate",
     "fraction",
     "speculative decoding: accepted / proposed tokens (the proposals equal to the target's own "
     "token at their position, before the first that is not)",
     "over the run's verified proposals",
     true,
     [](const ExperimentConfig& c, const RunOutput& out) {
       return speculation_total(c, out, [](std::int64_t, std::int64_t p, std::int64_t a, double) {
         return ratio(a, p);
       });
     },
     {{"spec_acceptance", "accepted", "", 1, true}}},
    {"spec_accepted_length",
     "tokens",
     "speculative decoding: mean accepted proposals per verifying entry (the entry then produces "
     "1 + that many tokens)",
     "accepted / verifying entries",
     true,
     [](const ExperimentConfig& c, const RunOutput& out) {
       return speculation_total(c, out, [](std::int64_t v, std::int64_t, std::int64_t a, double) {
         return ratio(a, v);
       });
     },
     {{"spec_accepted_length", "accepted/verify", "", 2}}},
    {"spec_propose_s",
     "s",
     "speculative decoding: the proposer's time, over every step (measured and wall clocks "
     "only: elsewhere a run's files are the same each time)",
     "sum over steps",
     true,
     [](const ExperimentConfig& c, const RunOutput& out) {
       if (c.clock != EngineClock::measured && c.clock != EngineClock::wall) return json();
       return speculation_total(
           c, out, [](std::int64_t, std::int64_t, std::int64_t, double s) { return s; });
     },
     {}},
    {"recomputed_tokens",
     "tokens",
     "tokens computed again after recompute preemptions",
     "sum over requests",
     true,
     SUMMARY(out.summary.recomputed_tokens),
     {{"recomputed_tokens", "recomputed tok", "", 0}}},
    {"mean_kv_used_fraction",
     "fraction",
     "KV slots holding live tokens (not a static batch's padding) / pool capacity",
     "mean over steps",
     true,
     SUMMARY(out.mean_kv_used),
     {{"", "KV used", "", 1, true}}},
    {"kv_waste_of_held_fraction",
     "fraction",
     "KV waste among held slots (vLLM's): (reserved ahead + unfilled last blocks + a static "
     "batch's padding) / slots sequences hold",
     "summed over all steps, then divided",
     true,
     SUMMARY(out.kv_waste_of_held),
     {{"", "KV waste/held", "", 1, true}}},
    {"mean_kv_waste_fraction",
     "fraction",
     "KV waste of the pool: the waste above plus free holes outside the largest free run on steps "
     "where they blocked an admission (external fragmentation), / capacity",
     "mean over steps",
     true,
     SUMMARY(out.mean_kv_waste),
     {{"", "KV waste/pool", "", 1, true}}},
    {"mean_kv_waste_breakdown",
     "fraction",
     "the pool's waste by cause: reserved_unused, last_block_slack, padding, "
     "unusable_free_blocking, and unusable_free_all (every hole, blocking or not)",
     "mean over steps, each / capacity",
     true,
     [](const ExperimentConfig&, const RunOutput& out) { return waste_breakdown(out); },
     {}},
    {"prefix_hit_rate",
     "fraction",
     "prefix-cache hit rate: prompt tokens served from the prefix cache / prompt tokens looked up",
     "over the run",
     true,
     SUMMARY(out.prefix_hit_rate),
     {{"prefix_hit_rate", "prefix hit", "", 1, true}}},
    {"ideal_prefix_hit_rate",
     "fraction",
     "the ceiling of prefix_hit_rate on a trace that names its prompt blocks (Mooncake's hash "
     "ids): prompt tokens an infinite cache keeping whole blocks would serve, in arrival order / "
     "prompt tokens (replayed requests only)",
     "over the run's requests",
     true,
     [](const ExperimentConfig&, const RunOutput& out) {
       return out.ideal_prefix_hit_rate ? json(*out.ideal_prefix_hit_rate) : json();
     },
     {{"ideal_prefix_hit_rate", "ideal prefix hit", "", 1, true}}},
    {"tier_host_hit_rate",
     "fraction",
     "KV tiers ([kv_tiers]): prompt tokens whose KV was loaded back from host memory / prompt "
     "tokens looked up (a part of prefix_hit_rate)",
     "over the run, every replica",
     true,
     TIER_METRIC(t.host_hit_rate),
     {{"tier_host_hit_rate", "host-tier hit", "", 1, true}}},
    {"tier_disk_hit_rate",
     "fraction",
     "KV tiers: prompt tokens whose KV was loaded back from disk / prompt tokens looked up (a "
     "part of prefix_hit_rate)",
     "over the run, every replica",
     true,
     TIER_METRIC(t.disk_hit_rate),
     {{"tier_disk_hit_rate", "disk-tier hit", "", 1, true}}},
    {"tier_bytes_stored",
     "bytes",
     "KV tiers: bytes of evicted prefix blocks stored down (device to host, host to disk), in the "
     "pool's dtype",
     "sum over the run, every replica",
     true,
     TIER_METRIC(t.bytes_stored),
     {{"tier_stored_mib", "tier stored MiB", "", 1, false, 1.0 / (1 << 20)}}},
    {"tier_bytes_loaded",
     "bytes",
     "KV tiers: bytes of prefix blocks loaded back to the device (from host or disk)",
     "sum over the run, every replica",
     true,
     TIER_METRIC(t.bytes_loaded),
     {{"tier_loaded_mib", "tier loaded MiB", "", 1, false, 1.0 / (1 << 20)}}},
    {"tier_dropped_blocks",
     "blocks",
     "KV tiers: evicted prefix blocks no tier kept (the policy refused them, or the disk gave "
     "them up)",
     "sum over the run, every replica",
     true,
     TIER_METRIC(t.dropped_blocks),
     {}},
    {"tier_time_s",
     "seconds",
     "KV tiers: step time charged to the tier copies (virtual clock: their price over the "
     "profile's links, or its excess over the step's compute when the profile overlaps them; "
     "measured clock: the copies as they took)",
     "sum over steps",
     true,
     TIER_METRIC(t.time_s),
     {{"tier_time_s", "tier time (s)", "", 3, false}}},
    {"swapped_bytes",
     "bytes",
     "KV copied to and from the host swap pool by swap preemptions, in the pool's dtype",
     "sum over requests",
     true,
     SUMMARY(out.summary.swapped_bytes),
     {{"swapped_mib", "swapped MiB", "", 1, false, 1.0 / (1 << 20)}}},
    {"bytes_copied",
     "bytes",
     "KV bytes the allocator moved (grow-by-copy, copy-on-write)",
     "over the run",
     true,
     SUMMARY(last_kv(out).bytes_copied),
     {}},
    {"steps",
     "steps",
     "engine steps that ran a batch (steps.csv's rows)",
     "count",
     true,
     SUMMARY(out.engine.steps.size()),
     {}},
    {"kv_slots",
     "tokens",
     "the KV pool's capacity",
     "once per run",
     true,
     SUMMARY(out.kv_slots),
     {}},
    {"mean_batch_sequences",
     "sequences",
     "sequences a step computes (a static batch's padding rows not counted): how many run "
     "together",
     "mean over steps",
     true,
     SUMMARY(out.mean_batch),
     {{"mean_batch", "mean batch", "", 1}}},
    {"max_batch_sequences",
     "sequences",
     "the most sequences one step computed (padding rows not counted)",
     "max over steps",
     true,
     SUMMARY(out.max_batch),
     {{"max_batch", "max batch", "", 0}}},
    {"kv_policy_held",
     "positions",
     "a KV policy's sequences after each selection that dropped some: the positions their slots "
     "hold, the union of what the layers' K/V heads keep (absent without a policy)",
     "mean over selections",
     true,
     [](const ExperimentConfig&, const RunOutput& out) {
       const KvKeepStats& k = out.engine.kv_policy;
       return k.selections > 0 ? json(k.mean_held()) : json();
     },
     {{"kv_policy_held", "KV held", "", 1}}},
    {"kv_policy_seen",
     "positions",
     "a KV policy's sequences after each selection that dropped some: the positions a layer's "
     "K/V head attends to (those held beyond them are masked for it; absent without a policy)",
     "mean over selections",
     true,
     [](const ExperimentConfig&, const RunOutput& out) {
       const KvKeepStats& k = out.engine.kv_policy;
       return k.selections > 0 ? json(k.mean_seen()) : json();
     },
     {{"kv_policy_seen", "KV seen", "", 1}}},
    {"kv_residual_peak",
     "MiB",
     "a KIVI KV pool's fp16 open key/value groups (its residual: up to `residual_length` + 32 "
     "tokens per running sequence; on the simulated backend what its running sequences would "
     "hold), the most one step held: KV memory beside the pool's slots, reserved out of "
     "`memory_mib` for `max_batch` requests (0 for the other dtypes)",
     "max over steps",
     true,
     SUMMARY(static_cast<double>(out.peak_kv_residual_bytes) / (1024.0 * 1024.0)),
     {{"kv_residual_peak_mib", "residual peak MiB", "", 2}}},
    {"step_prediction_error",
     "fraction",
     "|predicted - measured| / measured step time, with a cost model on the measured clock",
     "over steps: mean, p50, p90, p99, max",
     true,
     SUMMARY(optional_latency(out.step_prediction_error)),
     {}},
    {"step_time_ratio",
     "ratio",
     "measured / predicted step time (above 1: slower than the profile prices it)",
     "over steps: mean, p50, p90, p99, max",
     true,
     SUMMARY(optional_latency(out.step_time_ratio)),
     {}},
};

#undef SUMMARY
#undef TENANT_METRIC

const RequestMetric kRequestMetrics[] = {
    {"ttft_s", "s", "first output token time - arrival",
     [](const RequestTimeline& r) { return r.ttft_s(); }},
    {"tpot_s", "s", "(last token - first token) / (output tokens - 1), with at least 2 tokens",
     [](const RequestTimeline& r) { return r.tpot_s(); }},
    {"e2e_s", "s", "finish - arrival", [](const RequestTimeline& r) { return r.e2e_s(); }},
    {"kv_transfer_s", "s",
     "disaggregated: the KV's arrival on the decode replica - the first token (empty otherwise)",
     [](const RequestTimeline& r) -> std::optional<double> {
       if (!r.kv_arrival_s || r.token_times_s.empty()) return std::nullopt;
       return *r.kv_arrival_s - r.token_times_s.front();
     }},
    {"decode_queue_s", "s",
     "disaggregated: first scheduled on the decode replica - the KV's arrival there (empty "
     "otherwise)",
     [](const RequestTimeline& r) -> std::optional<double> {
       if (!r.kv_arrival_s || !r.decode_scheduled_s) return std::nullopt;
       return *r.decode_scheduled_s - *r.kv_arrival_s;
     }},
};

std::string columns_cell(const RunMetric& m) {
  std::string cell;
  for (const MetricColumn& c : m.columns) {
    if (!cell.empty()) cell += ", ";
    cell += c.option.empty() ? fmt::format("`{}` (always)", c.header)
                             : fmt::format("`{}` (`{}`)", c.header, c.option);
  }
  return cell;
}

}  // namespace

std::span<const RunMetric> run_metrics() {
  return kRunMetrics;
}
std::span<const RequestMetric> request_metrics() {
  return kRequestMetrics;
}

nlohmann::json swept_json(const ExperimentConfig& config) {
  nlohmann::json swept = nlohmann::json::object();
  for (const auto& [key, value] : config.swept) swept[key] = nlohmann::json::parse(value);
  return swept;
}

std::vector<std::string> metric_column_options() {
  std::vector<std::string> options;
  for (const RunMetric& m : kRunMetrics)
    for (const MetricColumn& c : m.columns)
      if (!c.option.empty() && std::find(options.begin(), options.end(), c.option) == options.end())
        options.emplace_back(c.option);
  return options;
}

std::string metrics_markdown() {
  std::string md =
      "| metric | unit | definition | aggregated | summary.json | summary table column "
      "(`[output] columns`) |\n|---|---|---|---|---|---|\n";
  for (const RunMetric& m : kRunMetrics)
    md += fmt::format("| `{}` | {} | {} | {} | {} | {} |\n", m.name, m.unit, m.definition,
                      m.aggregation, m.in_summary_json ? "yes" : "no", columns_cell(m));
  md += "\nPer request (requests.csv):\n\n| column | unit | definition |\n|---|---|---|\n";
  for (const RequestMetric& m : kRequestMetrics)
    md += fmt::format("| `{}` | {} | {} |\n", m.name, m.unit, m.definition);
  return md;
}

}  // namespace kvlab
