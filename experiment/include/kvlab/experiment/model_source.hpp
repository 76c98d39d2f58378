#pragma once
// A --model argument or [model] name: a preset, a Hugging Face model folder or a GGUF file.
#include <filesystem>
#include <string>

#include "kvlab/model_config.hpp"

namespace kvlab {

struct ModelSource {
  ModelConfig config;
  std::filesystem::path directory;  // the folder or .gguf file; empty for a preset
  bool is_preset() const { return directory.empty(); }
};
// Throws kvlab::Error naming the presets (and the nearest one) when `name` is neither.
ModelSource resolve_model(const std::string& name);

}  // namespace kvlab
