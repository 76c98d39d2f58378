// kvlab plugins: what the plugin search path holds.
#include <fmt/format.h>

#include <memory>

#include "cli_common.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::cli {
namespace {

struct PluginsOptions {
  std::vector<std::string> extra_paths;
  std::vector<std::string> files;
};

void run_plugins(const PluginsOptions& o) {
  auto search = PluginRegistry::default_search_path();
  search.insert(search.end(), o.extra_paths.begin(), o.extra_paths.end());
  PluginRegistry registry(search);
  for (const auto& file : o.files) registry.load_file(file);
  fmt::print("search path:");
  for (const auto& directory : search) fmt::print(" {}", directory.string());
  fmt::print("\n");
  for (PluginKind kind : {PluginKind::kv_allocator, PluginKind::attention_variant,
                          PluginKind::scheduler, PluginKind::backend}) {
    for (const auto& info : registry.plugins()) {
      if (info.kind != kind) continue;
      fmt::print("\n{} {}: {}\n  file: {}\n", plugin_kind_name(kind), info.name, info.description,
                 info.file.string());
      for (const auto& p : info.params) {  // strings have no range
        const bool numeric = p.type == ParamType::param_integer || p.type == ParamType::param_real;
        fmt::print("  {} ({}, default {}{}): {}\n", p.name, param_type_name(p.type),
                   p.default_value,
                   numeric ? fmt::format(", range [{}, {}]", p.min_value, p.max_value) : "",
                   p.description);
      }
    }
  }
  if (registry.plugins().empty()) fmt::print("\nno plugins found\n");
}

}  // namespace

void register_plugins(CLI::App& app) {
  auto o = std::make_shared<PluginsOptions>();
  auto* sub = app.add_subcommand(
      "plugins", "List the plugins on the search path (build folder, KVLAB_PLUGIN_PATH)");
  sub->add_option("--path", o->extra_paths, "Extra plugin folder (repeatable)");
  sub->add_option("--load", o->files, "Load this plugin file too (repeatable)");
  sub->callback([o]() { run_plugins(*o); });
}

}  // namespace kvlab::cli
