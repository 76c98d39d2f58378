#include "kvlab/plugin_loader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>

#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

const char* plugin_kind_name(PluginKind kind) {
  switch (kind) {
    case PluginKind::kv_allocator:
      return "allocator";
    case PluginKind::attention_variant:
      return "attention";
    case PluginKind::scheduler:
      return "scheduler";
    case PluginKind::backend:
      return "backend";
  }
  return "unknown";
}

namespace {
constexpr const char* kDescriptorSymbol = "kvlab_plugin_descriptor";
constexpr const char* kFilePrefix = "kvlab_plugin_";
}  // namespace

PluginRegistry::PluginRegistry(const std::vector<std::filesystem::path>& directories) {
  for (const auto& directory : directories) {
    std::error_code ec;
    if (!std::filesystem::is_directory(directory, ec)) continue;
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
      const auto name = entry.path().filename().string();
      if (entry.is_regular_file() && name.rfind(kFilePrefix, 0) == 0 &&
          entry.path().extension() == ".so")
        files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& file : files) load_file(file);
  }
}

std::vector<std::filesystem::path> PluginRegistry::default_search_path() {
  std::vector<std::filesystem::path> path;
  std::error_code ec;
  const std::filesystem::path program = boost::dll::program_location(ec);
  if (!ec) {
    const auto bin = program.parent_path();
    path.push_back(bin.parent_path() / "plugins");  // build tree: build/bin/kvlab
    path.push_back(bin.parent_path() / "lib" / "kvlab" /
                   "plugins");  // installed: <prefix>/bin/kvlab
  }
  if (const char* env = std::getenv("KVLAB_PLUGIN_PATH")) {
    std::string list = env;
    std::size_t start = 0;
    while (start <= list.size()) {
      const std::size_t end = std::min(list.find(':', start), list.size());
      if (end > start) path.emplace_back(list.substr(start, end - start));
      start = end + 1;
    }
  }
  return path;
}

void PluginRegistry::load_file(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw Error(fmt::format("plugin file {} does not exist", file.string()));
  const auto canonical = std::filesystem::canonical(file, ec);
  for (const auto& loaded : plugins_)
    if (std::filesystem::equivalent(loaded.file, canonical, ec))
      return;  // same file twice on the path

  auto library = std::make_shared<boost::dll::shared_library>();
  boost::dll::fs::error_code load_error;
  library->load(canonical, boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local,
                load_error);
  if (load_error)
    throw Error(fmt::format("cannot load plugin {}: {}", file.string(), load_error.message()));
  if (!library->has(kDescriptorSymbol))
    throw Error(fmt::format(
        "{} is not a kvlab plugin: it exports no \"{}\" (build it with KVLAB_PLUGIN(...))",
        file.string(), kDescriptorSymbol));
  using DescriptorFunction = const PluginDescriptor*();
  const PluginDescriptor* descriptor = library->get_alias<DescriptorFunction>(kDescriptorSymbol)();
  if (descriptor == nullptr)
    throw Error(fmt::format("plugin {}: descriptor is null", file.string()));
  if (descriptor->abi_version != kPluginAbiVersion)
    throw Error(fmt::format(
        "plugin {} was built for kvlab plugin ABI version {}, this kvlab has ABI version {}: "
        "rebuild the plugin against this kvlab",
        file.string(), descriptor->abi_version, kPluginAbiVersion));
  PluginInfo info;
  info.kind = descriptor->kind;
  info.name = descriptor->name;
  info.description = descriptor->description;
  info.params.assign(descriptor->params, descriptor->params + descriptor->param_count);
  info.file = canonical;
  info.library = library;
  info.descriptor = descriptor;
  for (const auto& other : plugins_)
    if (other.kind == info.kind && other.name == info.name)
      throw Error(fmt::format(
          "two {} plugins are named \"{}\": {} and {} (remove one from the plugin path)",
          plugin_kind_name(info.kind), info.name, other.file.string(), info.file.string()));
  plugins_.push_back(std::move(info));
}

const PluginInfo& PluginRegistry::find(PluginKind kind, std::string_view name) const {
  std::vector<std::string> names;
  for (const auto& info : plugins_) {
    if (info.kind != kind) continue;
    if (info.name == name) return info;
    names.push_back(info.name);
  }
  std::string message = fmt::format("unknown {} plugin \"{}\"", plugin_kind_name(kind), name);
  if (auto near = nearest_name(name, names))
    message += fmt::format(" (did you mean \"{}\"?)", *near);
  message += names.empty()
                 ? fmt::format(
                       "; no {} plugins were found (is the plugin path right? see `kvlab plugins`)",
                       plugin_kind_name(kind))
                 : "; available: " + join_names(names);
  throw Error(message);
}

void* PluginRegistry::create_raw(const PluginInfo& info,
                                 const std::map<std::string, ParamValue, std::less<>>& params,
                                 const PluginContext& context) const {
  const PluginParams validated = validate_plugin_params(info.name, info.params, params);
  char error[1024] = {};
  void* object = info.descriptor->create(validated, context, error, sizeof(error));
  if (object == nullptr)
    throw Error(fmt::format("{} plugin \"{}\" ({}) could not be created: {}",
                            plugin_kind_name(info.kind), info.name, info.file.string(),
                            error[0] ? error : "no reason given"));
  return object;
}

}  // namespace kvlab
