// kvlab model init | info: make deterministic random-weight models, describe a model.
#include <fmt/format.h>

#include <map>
#include <memory>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"
#include "kvlab/model/safetensors.hpp"
#include "kvlab/model/weight_init.hpp"

namespace kvlab::cli {
namespace {

struct InitOptions {
  std::string preset;
  std::uint64_t seed = 0;
  std::string out;
  std::string dtype = "f32";
  bool force = false;
};

// A model folder is written over only with --force: its files may be a real checkpoint.
void check_model_folder(const std::filesystem::path& out, bool force) {
  std::error_code ec;
  if (std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out, ec))
    throw Error(fmt::format("--out {} is a file, not a folder", out.string()));
  if (force) return;
  for (const char* name : {"config.json", "model.safetensors"})
    if (std::filesystem::exists(out / name, ec))
      throw Error(fmt::format(
          "{} exists: pass --force to overwrite config.json and model.safetensors in {}, or "
          "--out another folder",
          (out / name).string(), out.string()));
}

void run_init(const InitOptions& o) {
  const ModelConfig config = model_preset(o.preset);
  const auto dtype = dtype_from_short_name(o.dtype);
  if (!dtype ||
      (*dtype != DType::dtype_f32 && *dtype != DType::dtype_f16 && *dtype != DType::dtype_bf16))
    throw Error(fmt::format(
        "--dtype \"{}\" is not a weight dtype kvlab writes: choose f32, f16 or bf16", o.dtype));
  check_model_folder(o.out, o.force);
  write_random_model(config, o.seed, *dtype, o.out);
  fmt::print("wrote {} ({} weights, seed {}, {:.1f}M parameters) to {}\n", o.preset, o.dtype,
             o.seed, static_cast<double>(config.parameter_count()) / 1e6, o.out);
}

// A GGUF file as it is: version, every metadata key (long arrays shortened), tensors by type.
// Mapping its metadata to a model config is the next step of the real-models work.
void print_gguf_info(const std::filesystem::path& path) {
  const GgufFile file = GgufFile::open(path);
  fmt::print("file:                {} (GGUF v{}, alignment {})\n", path.string(), file.version(),
             file.alignment());
  fmt::print("metadata:            {} keys\n", file.metadata().size());
  for (const auto& [key, value] : file.metadata())
    fmt::print("  {} = {}\n", key, value.to_string());
  std::map<std::string, std::pair<int, std::uint64_t>> by_type;  // type -> count, bytes
  std::int64_t elements = 0;
  for (const auto& t : file.tensors()) {
    auto& entry = by_type[gguf_type_name(t.type)];
    ++entry.first;
    entry.second += t.bytes;
    elements += t.elements;
  }
  fmt::print("tensors:             {} ({:.2f}M values)\n", file.tensors().size(),
             static_cast<double>(elements) / 1e6);
  for (const auto& [type, entry] : by_type)
    fmt::print("  {:<6} {:>4} tensors, {:.1f} MiB\n", type, entry.first,
               static_cast<double>(entry.second) / (1 << 20));
}

void run_info(const std::string& name) {
  if (name.ends_with(".gguf")) {
    print_gguf_info(name);
    return;
  }
  const ModelSource source = resolve_model(name);
  const ModelConfig& c = source.config;
  fmt::print("model:               {}{}\n", c.name, c.size_only ? " (size-only preset)" : "");
  fmt::print("architecture:        {}\n", c.architecture);
  fmt::print("parameters:          {} ({:.2f}M)\n", c.parameter_count(),
             static_cast<double>(c.parameter_count()) / 1e6);
  fmt::print("layers:              {}\n", c.num_hidden_layers);
  fmt::print("hidden / ffn:        {} / {}\n", c.hidden_size, c.intermediate_size);
  fmt::print("heads / kv heads:    {} / {} (group {}, head_dim {})\n", c.num_attention_heads,
             c.num_key_value_heads, c.group_size(), c.head_dim);
  fmt::print("vocab / context:     {} / {}\n", c.vocab_size, c.max_position_embeddings);
  fmt::print("rope_theta / eps:    {} / {}\n", c.rope_theta, c.rms_norm_eps);
  const RopeScaling& r = c.rope_scaling;
  if (r.type == RopeScaling::Type::linear)
    fmt::print("rope scaling:        linear, factor {}\n", r.factor);
  if (r.type == RopeScaling::Type::llama3)
    fmt::print(
        "rope scaling:        llama3, factor {}, low/high freq factor {} / {}, original "
        "context {}\n",
        r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
  fmt::print("tied embeddings:     {}\n", c.tie_word_embeddings ? "yes" : "no");
  if (c.sliding_window) fmt::print("sliding window:      {}\n", *c.sliding_window);
  if (!source.is_preset()) {
    const Checkpoint checkpoint = Checkpoint::open(source.directory);
    fmt::print("tensors:             {}\n", checkpoint.tensor_names().size());
  }
}

}  // namespace

void register_model(CLI::App& app) {
  auto* model = app.add_subcommand("model", "Make or describe model folders");
  model->require_subcommand(1);

  auto init = std::make_shared<InitOptions>();
  auto* init_cmd =
      model->add_subcommand("init", "Write a preset with deterministic random weights (HF layout)");
  init_cmd->add_option("--preset", init->preset, "tiny, stories15m or stories110m")->required();
  init_cmd->add_option("--seed", init->seed, "Weight seed (same seed, same bytes)")
      ->capture_default_str();
  init_cmd->add_option("--out", init->out, "Output folder (config.json + model.safetensors)")
      ->required();
  init_cmd->add_option("--dtype", init->dtype, "f32, f16 or bf16")->capture_default_str();
  init_cmd->add_flag("--force", init->force,
                     "Overwrite config.json and model.safetensors already in --out");
  init_cmd->callback([init]() { run_init(*init); });

  auto name = std::make_shared<std::string>();
  auto* info_cmd = model->add_subcommand("info", "Describe a preset or a model folder");
  info_cmd->add_option("model", *name, "Preset name, model folder or .gguf file")->required();
  info_cmd->callback([name]() { run_info(*name); });
}

}  // namespace kvlab::cli
