#pragma once
// Workloads: the requests an experiment submits. Synthetic (arrival process, length
// distributions, shared-prefix groups, priority mix, per-request sampling) or replayed from a
// trace (kvlab's CSV or JSONL; the recorded traces and prompt sets: real_workloads.hpp), each a
// source in one table (formats.hpp). Deterministic: the same spec and seed give the same
// requests.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/engine/metrics.hpp"
#include "kvlab/engine/sampling.hpp"
#include "kvlab/engine/submission.hpp"

namespace kvlab {

// A workload's request is what the engine takes in: a Submission (kvlab/engine/submission.hpp).
using WorkloadRequest = Submission;

enum class ArrivalKind { all_at_once, poisson, gamma, bursts };
struct ArrivalProcess {
  ArrivalKind kind = ArrivalKind::all_at_once;
  double rate_per_s = 1.0;  // mean request rate (poisson, gamma, bursts)
  double cv = 1.0;          // gamma: coefficient of variation of inter-arrival times (1 = poisson)
  std::int64_t burst_size = 8;  // bursts: requests arriving together
};

// Limits on what a workload may ask for, far beyond any model: a request of more tokens than
// this (prompt or output) is an input error, and so are more shared-prefix groups.
inline constexpr std::int64_t kMaxRequestTokens = std::int64_t{1} << 24;
// The latest arrival a workload may have: 1e9 s (31.7 years). Times are doubles; at 1e9 s one
// ulp is 1.2e-7 s, so a latency of a microsecond still shows. At 1e308 s a step's duration
// vanishes in the sum and every latency reads 0.
inline constexpr double kMaxArrivalSeconds = 1e9;
// Throws kvlab::Error when a request arrives later than kMaxArrivalSeconds (or at a non-finite
// or negative time), naming it, its time and `source` (a synthetic rate, a trace file).
void check_arrival_times(const std::vector<WorkloadRequest>& requests, const std::string& source);
inline constexpr std::int64_t kMaxPrefixGroups = 1'000'000;

enum class LengthKind { fixed, uniform, normal, lognormal, zipf };
struct LengthDistribution {
  LengthKind kind = LengthKind::fixed;
  double value = 128;    // fixed
  double mean = 128;     // normal, lognormal (mean of the resulting lengths)
  double stddev = 32;    // normal; lognormal: of the resulting lengths
  double alpha = 1.2;    // zipf exponent over [min, max]
  std::int64_t min = 1;  // uniform bounds, and the clamp for every kind
  std::int64_t max = 4096;
};

struct SyntheticWorkload {
  std::int64_t requests = 100;
  std::uint64_t seed = 0;
  std::int64_t vocab_size = 32000;
  ArrivalProcess arrival;
  LengthDistribution prompt_tokens;
  LengthDistribution output_tokens;
  std::int64_t prefix_groups = 0;  // N groups of requests share a system prompt ...
  std::int64_t prefix_tokens = 0;  // ... of this many tokens (counted inside prompt_tokens)
  std::vector<double> priority_weights{1.0};  // P(priority = i) proportional to weight i
  double temperature = 0.0;
  double top_p = 1.0;
  std::int32_t top_k = 0;
  std::int32_t logprobs = -1;  // SamplingParams::logprobs
  bool ignore_eos = true;      // fixed output lengths (random-weight models emit EOS at random)
};

// The workload's sampling settings (temperature, top_p, top_k, logprobs) for one request; the
// seed, max_tokens and ignore_eos are each workload source's own.
SamplingParams workload_sampling(const SyntheticWorkload& spec);

// Throws kvlab::Error naming the bad field (non-positive rate, min > max, ...).
std::vector<WorkloadRequest> generate_workload(const SyntheticWorkload& spec);

// `requests` arrival times of `arrival` (the same draws generate_workload makes for it).
std::vector<double> arrival_times(const ArrivalProcess& arrival, std::int64_t requests,
                                  std::uint64_t seed);

struct TraceOptions {
  std::int64_t vocab_size = 32000;
  std::uint64_t seed = 0;   // for prompt ids of rows that give only prompt_len
  SamplingParams sampling;  // temperature etc. for every row (each row's seed = seed + row)
};

// Reads a trace: CSV with a header row, or JSONL (one object per line), by file extension
// (.csv / .jsonl). Fields: arrival_s, prompt_len or prompt_ids, output_len, priority and tenant
// (optional). Rows are sorted by arrival. Every bad row is a kvlab::Error "file:line: why".
std::vector<WorkloadRequest> load_trace(const std::filesystem::path& path,
                                        const TraceOptions& options);

// Tenants: who sends each request, and the latency targets each asked for.
struct TenantSpec {
  std::string name;
  // Its fraction of the requests (relative to the others'): each request's tenant is drawn by
  // share. Unset for every tenant of a workload whose requests name their own (a trace's
  // tenant column); 1 for an unset one otherwise.
  std::optional<double> share;
  ServiceLevelObjectives slo;  // its requests' targets, over the run's
};
// A tenant name kvlab accepts: 1-64 of [A-Za-z0-9_-] (it becomes a results.csv column's part).
// Returns it; throws kvlab::Error saying what is wrong otherwise.
const std::string& check_tenant_name(const std::string& name);
// Gives each request its tenant and its latency targets: with `tenants` whose shares are set or
// when no request names a tenant, each request's tenant is drawn by share (seeded); when the
// requests name theirs, each listed tenant must send some (and none may have a share). Every
// request's SLOs are then its tenant's, key by key over `run_slo`. Throws kvlab::Error for a
// list that does not fit the requests.
void assign_tenants(std::vector<WorkloadRequest>& requests, std::span<const TenantSpec> tenants,
                    const ServiceLevelObjectives& run_slo, std::uint64_t seed);

}  // namespace kvlab
