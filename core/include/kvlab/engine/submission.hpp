#pragma once
// What the engine takes in (Engine::submit, RequestTable): one request as a client or a workload
// gives it, before the engine tracks it (RequestState). Workloads make these
// (kvlab/workload/workload.hpp: WorkloadRequest is this type); the engine needs nothing else of
// them.
#include <cstdint>
#include <string>
#include <vector>

#include "kvlab/engine/metrics.hpp"
#include "kvlab/engine/sampling.hpp"

namespace kvlab {

struct Submission {
  std::int64_t id = 0;
  double arrival_s = 0;
  std::vector<std::int32_t> prompt;  // token ids
  std::int64_t output_tokens = 0;    // max_tokens (generation stops here unless EOS comes first)
  int priority = 0;                  // higher = more important
  std::int64_t prefix_group = -1;    // shared-prefix group, -1 for none
  SamplingParams sampling;           // seed is per request
  std::string tenant;                // who sent it ("" for none)
  std::string cache_salt;            // prefix blocks are shared only within one salt ("": none)
  ServiceLevelObjectives slo;        // its latency targets (its tenant's over the run's [slo])
};

}  // namespace kvlab
