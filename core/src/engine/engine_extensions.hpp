#pragma once
// The engine's own step extensions (kvlab/engine/step_extension.hpp), made for each run.
#include <cstdint>
#include <memory>
#include <vector>

#include "kvlab/engine/engine.hpp"

namespace kvlab {

// In their order: speculative decoding (with speculation.tokens > 0), the KV policy (with one),
// a static batch's padding rows (always: any scheduler may pad), the step frames (with a frame
// budget or observer). `vocab`: the backend's. Throws kvlab::Error for settings that cannot run.
std::vector<std::unique_ptr<StepExtension>> engine_extensions(const EngineOptions& options,
                                                              std::int64_t vocab,
                                                              const KvAllocator& allocator);

}  // namespace kvlab
