#include "kvlab/experiment/model_source.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kvlab/error.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

ModelSource resolve_model(const std::string& name) {
  const auto presets = model_preset_names();
  if (std::find(presets.begin(), presets.end(), name) != presets.end())
    return {model_preset(name), {}};
  const std::filesystem::path path(name);
  if (path.extension() == ".gguf" && std::filesystem::is_regular_file(path))
    return {gguf_model_config(GgufFile::open(path)), path};
  if (std::filesystem::is_directory(path)) {
    ModelConfig config = load_model_config(path / "config.json");
    config.name = path.string();
    return {config, path};
  }
  std::string message =
      fmt::format("model \"{}\" is neither a preset, a model folder nor a .gguf file", name);
  if (auto near = nearest_name(name, presets))
    message += fmt::format(" (did you mean \"{}\"?)", *near);
  message += "; presets: " + join_names(presets);
  throw Error(message);
}

}  // namespace kvlab
