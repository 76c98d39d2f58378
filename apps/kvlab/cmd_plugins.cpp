// kvlab plugins: what the plugin search path holds.
#include <fmt/format.h>

#include <memory>

#include <toml++/toml.h>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin/allocator_conformance.hpp"
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::cli {
namespace {

struct PluginsOptions {
  std::vector<std::string> extra_paths;
  std::vector<std::string> files;
  // conformance
  std::string allocator;
  std::vector<std::string> params;  // key=value, the value in TOML syntax (bare words: strings)
  bool release_window = false;
  std::int64_t kv_groups = 0;
  bool evict = false;
  bool rollback = false;
};

PluginRegistry make_registry(const PluginsOptions& o) {
  auto search = PluginRegistry::default_search_path();
  search.insert(search.end(), o.extra_paths.begin(), o.extra_paths.end());
  PluginRegistry registry(search);
  for (const auto& file : o.files) registry.load_file(file);
  return registry;
}

// kvlab plugins conformance NAME: the allocator conformance suite on any allocator plugin.
void run_conformance(const PluginsOptions& o) {
  const PluginRegistry registry = make_registry(o);
  std::map<std::string, ParamValue, std::less<>> params;
  for (const auto& text : o.params) params.insert(parse_param(text));
  ConformanceOptions options;
  options.release_window = o.release_window;
  options.evict = o.evict;
  options.rollback = o.rollback;
  options.kv_groups = o.kv_groups;
  const ConformanceReport report =
      check_allocator_conformance(registry, o.allocator, params, options);
  fmt::print("allocator {}: {} random operations over {} seeds, {} refused for lack of room{}\n",
             o.allocator, report.operations, options.seeds.size(), report.full_pool_refusals,
             o.rollback ? fmt::format(", {} tokens rolled back", report.rolled_back_tokens) : "");
  for (const auto& failure : report.failures) fmt::print("FAIL {}\n", failure);
  if (!report.passed())
    throw Error(fmt::format("allocator \"{}\" does not conform ({} of {} seeds failed)",
                            o.allocator, report.failures.size(), options.seeds.size()));
  fmt::print("conforms: every contract in kvlab/kv_allocator.hpp held\n");
}

void run_plugins(const PluginsOptions& o) {
  const auto search = [&] {
    auto path = PluginRegistry::default_search_path();
    path.insert(path.end(), o.extra_paths.begin(), o.extra_paths.end());
    return path;
  }();
  const PluginRegistry registry = make_registry(o);
  fmt::print("search path:");
  for (const auto& directory : search) fmt::print(" {}", directory.string());
  fmt::print("\n");
  for (PluginKind kind : {PluginKind::kv_allocator, PluginKind::attention_variant,
                          PluginKind::scheduler, PluginKind::backend, PluginKind::router,
                          PluginKind::tier_policy, PluginKind::kv_policy, PluginKind::proposer}) {
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
  sub->callback([o, sub]() {
    if (sub->get_subcommands().empty()) run_plugins(*o);
  });
  auto* check = sub->add_subcommand(
      "conformance", "Run the KV allocator conformance suite on an allocator plugin");
  check->add_option("allocator", o->allocator, "Allocator plugin name")->required();
  check->add_option("--param", o->params, "Plugin parameter key=value (repeatable)");
  check->add_option("--path", o->extra_paths, "Extra plugin folder (repeatable)");
  check->add_option("--load", o->files, "Load this plugin file too (repeatable)");
  check->add_flag("--evict", o->evict,
                  "Also drop random positions with evict (allocators that serve KV policies)");
  check->add_flag("--rollback", o->rollback,
                  "Also roll speculative appends back with truncate (speculative decoding)");
  check->add_flag("--release-window", o->release_window,
                  "Also exercise release_before (allocators that free old KV early)");
  check
      ->add_option("--kv-groups", o->kv_groups,
                   "Run it under KV groups (a local:global model's layers): N groups, the first "
                   "global, the others an 8-token window (kvlab/kv/kv_groups.hpp)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{64}));
  check->callback([o]() { run_conformance(*o); });
}

}  // namespace kvlab::cli
