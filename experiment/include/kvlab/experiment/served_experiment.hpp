#pragma once
// One run of an experiment file served live (kvlab serve): the file's model, backend, allocator,
// variant, scheduler, KV tiers, KV policy and cluster (its replicas behind its router), built as
// `kvlab run` builds them, each replica under a LiveEngine instead of a replay of the file's
// workload. When the serving ends, the run is a RunOutput like any other (a cluster's: each
// replica's summary and the merged run), for the results folder writer.
//
//   ServedExperiment served(config, live_options, {end_of_turn});
//   served.engine().submit(...) ...            (from the server's threads)
//   served.engine().shutdown(drain);
//   write_run_outputs(dir, config, served.finish());
#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "kvlab/engine/live_cluster.hpp"
#include "kvlab/experiment/experiment.hpp"

namespace kvlab {

class ServedExperiment {
 public:
  // `c`: one validated run (a [cluster], disaggregated or not, is a LiveCluster). `stop_tokens`:
  // tokens that end a request besides the model's EOS (a chat template's end of turn). With
  // the simulated backend the engine runs on the paced clock: each step lasts what the hardware
  // profile prices it at.
  ServedExperiment(const ExperimentConfig& c, LiveOptions live,
                   const std::vector<std::int32_t>& stop_tokens);
  ~ServedExperiment();
  ServedExperiment(const ServedExperiment&) = delete;
  ServedExperiment& operator=(const ServedExperiment&) = delete;

  LiveCluster& engine();
  const ModelConfig& model() const;             // as served: its EOS ids include stop_tokens
  const std::filesystem::path& source() const;  // the checkpoint; empty for a preset
  std::int64_t kv_slots() const;                // a replica's pool's capacity in tokens
  // After engine().shutdown(): the run's record, summaries and counters, as kvlab run's.
  RunOutput finish();

 private:
  struct Parts;
  std::unique_ptr<Parts> parts_;
};

}  // namespace kvlab
