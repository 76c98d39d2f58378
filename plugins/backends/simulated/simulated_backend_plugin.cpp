// The `simulated` backend plugin: no math (SimulatedBackend); each step's time comes from the
// cost model of [backend] profile, which the engine's clock asks, not from this plugin.
#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"
#include "kvlab/sim/simulated_backend.hpp"

namespace {

const kvlab::ModelConfig& model_of(const kvlab::PluginContext& context) {
  if (context.model == nullptr)
    throw kvlab::Error("simulated backend: needs the model (a host bug)");
  return *context.model;
}

class SimulatedBackendPlugin final : public kvlab::SimulatedBackend {
 public:
  SimulatedBackendPlugin(const kvlab::PluginParams& /*params*/, const kvlab::PluginContext& context)
      : SimulatedBackendPlugin(model_of(context)) {}

 private:
  explicit SimulatedBackendPlugin(const kvlab::ModelConfig& model)
      : SimulatedBackend(model.vocab_size, model.eos_token_ids) {}
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::backend, SimulatedBackendPlugin, "simulated",
             "no math: synthetic tokens (never EOS), each step timed by the cost model of "
             "backend.profile; the KV pool is bookkeeping only",
             kvlab::kNoParams)
