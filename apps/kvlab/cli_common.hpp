#pragma once
// Pieces shared by the kvlab subcommands.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kvlab/model_config.hpp"

namespace kvlab::cli {

// A --model argument: a preset name or a Hugging Face model folder (config.json).
struct ModelSource {
  ModelConfig config;
  std::filesystem::path directory;  // the folder or .gguf file; empty for a preset
  bool is_preset() const { return directory.empty(); }
};
// Throws kvlab::Error naming the presets (and the nearest one) when `name` is neither.
ModelSource resolve_model(const std::string& name);

// "1, 2,3" -> {1, 2, 3}. Throws kvlab::Error naming the bad item and its position.
std::vector<std::int32_t> parse_token_ids(const std::string& text);

// 1073741824 -> "1.00 GiB"
std::string human_bytes(double bytes);

void register_generate(CLI::App& app);
void register_model(CLI::App& app);
void register_memory(CLI::App& app);
void register_calibrate(CLI::App& app);
void register_plugins(CLI::App& app);
// run and check; a failed check sets exit_code.
void register_run(CLI::App& app, int& exit_code);

}  // namespace kvlab::cli
