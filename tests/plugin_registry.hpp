#pragma once
// The plugins this build made (KVLAB_PLUGIN_DIR), loaded once per test executable.
#include "kvlab/plugin/plugin_loader.hpp"

namespace kvlab::test {

inline const PluginRegistry& plugin_registry() {
  static const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  return registry;
}

}  // namespace kvlab::test
