#include "engine_extensions.hpp"

#include "kvlab/engine/frames.hpp"
#include "kvlab/engine/kv_policy_runner.hpp"
#include "kvlab/engine/static_padding.hpp"
#include "kvlab/speculation/speculator.hpp"

namespace kvlab {

std::vector<std::unique_ptr<StepExtension>> engine_extensions(const EngineOptions& options,
                                                              std::int64_t vocab,
                                                              const KvAllocator& allocator) {
  std::vector<std::unique_ptr<StepExtension>> extensions;
  if (options.speculation.enabled())
    extensions.push_back(std::make_unique<Speculator>(options, vocab));
  if (options.kv_policy != nullptr)  // (sequence ids start again: its state from nothing)
    extensions.push_back(std::make_unique<KvPolicyRunner>(
        *options.kv_policy, options.names.kv_policy, options.names.allocator, options.names.backend,
        !options.rules.layer_windows.empty()
            ? static_cast<std::int64_t>(options.rules.layer_windows.size())
            : (options.pool != nullptr ? options.pool->shape().layers : 1),
        options.pool != nullptr ? options.pool->shape().kv_heads : 1, options.rules.layer_windows));
  // On a clock that times the backend (measured, wall) the backend computes the padding rows
  // too, or static batching would be timed without the padding the simulator charges it.
  const bool timed = options.clock == EngineClock::measured || options.clock == EngineClock::wall;
  extensions.push_back(std::make_unique<StaticPadding>(options.rules.context, timed));
  if (options.frame_budget > 0 || options.frame_observer != nullptr)
    extensions.push_back(std::make_unique<FrameRecorder>(
        options.frame_budget, options.frame_budget > 0 ? allocator.stats().capacity : 0,
        options.frame_observer));
  return extensions;
}

}  // namespace kvlab
