// The `cpu` backend plugin: CpuBackend over the host's weights view, multiplying in the format
// `weights` names with `activations`; K/V in the host pool it is given (it provides the pool's
// storage when the serving stack made it for bookkeeping only).
#include <fmt/format.h>

#include <optional>
#include <utility>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/weight_matrix.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"

namespace {

using kvlab::Error;

std::optional<std::int64_t> window_of(const kvlab::PluginContext& context) {
  return context.window > 0 ? std::optional<std::int64_t>(context.window) : std::nullopt;
}

// Checked before anything reads the context (a constructor's arguments are evaluated in no
// fixed order).
kvlab::cpu::CpuBackend make_backend(const kvlab::PluginParams& params,
                                    const kvlab::PluginContext& context) {
  if (context.weights == nullptr || context.pool == nullptr)
    throw Error("cpu backend: needs the model weights and the KV pool (a host bug)");
  kvlab::cpu::ComputeWeights compute = kvlab::cpu::select_compute_weights(
      *context.weights, params.string("weights"), params.string("activations"));
  context.pool->provide_host_storage();
  return {*context.weights, *context.pool, window_of(context), std::move(compute)};
}

class CpuBackendPlugin final : public kvlab::Backend {
 public:
  CpuBackendPlugin(const kvlab::PluginParams& params, const kvlab::PluginContext& context)
      : backend_(make_backend(params, context)) {}

  kvlab::ForwardResult forward(std::span<const kvlab::BatchEntry> batch,
                               std::span<const kvlab::TokenChoice> choices) override {
    return backend_.forward(batch, choices);
  }
  std::int64_t vocab_size() const override { return backend_.vocab_size(); }
  std::string description() const override { return backend_.description(); }

 private:
  kvlab::cpu::CpuBackend backend_;
};

const kvlab::ParamSpec kParams[] = {
    {"weights", kvlab::ParamType::param_string,
     "the format the products read: stored (a GGUF file's own types, f32 otherwise), f32, f16, "
     "bf16, q8_0, q4_0 or q4_1 ([backend] weights sets it)",
     "\"stored\"", 0, 0},
    {"activations", kvlab::ParamType::param_string,
     "activations the products read: f32, q8 (rounded per row block, as llama.cpp does) or bf16 "
     "([backend] activations sets it)",
     "\"f32\"", 0, 0},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::backend, CpuBackendPlugin, "cpu",
             "the LLaMA forward on this machine's cores: Eigen/OpenBLAS GEMMs over the batch, "
             "attention per sequence over the host KV pool",
             kParams)
