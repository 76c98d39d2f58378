#pragma once
// Finds, loads and instantiates plugins (Boost.DLL). Errors are kvlab::Error with the file,
// the reason, and what is available instead.
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvlab/plugin.hpp"

namespace kvlab {

// A plugin object owned by the host: destroyed by its plugin's `destroy`, and its library
// stays loaded for as long as the object lives.
template <typename T>
class PluginObject {
 public:
  PluginObject() = default;
  PluginObject(std::shared_ptr<void> library, T* object, void (*destroy)(void*))
      : library_(std::move(library)), object_(object), destroy_(destroy) {}
  PluginObject(PluginObject&& other) noexcept { *this = std::move(other); }
  PluginObject& operator=(PluginObject&& other) noexcept {
    reset();
    library_ = std::move(other.library_);
    object_ = std::exchange(other.object_, nullptr);
    destroy_ = other.destroy_;
    return *this;
  }
  PluginObject(const PluginObject&) = delete;
  PluginObject& operator=(const PluginObject&) = delete;
  ~PluginObject() { reset(); }

  T* get() const { return object_; }
  T* operator->() const { return object_; }
  T& operator*() const { return *object_; }
  explicit operator bool() const { return object_ != nullptr; }
  void reset() {
    if (object_ != nullptr) destroy_(static_cast<void*>(object_));  // before the library goes
    object_ = nullptr;
    library_.reset();
  }

 private:
  std::shared_ptr<void> library_;  // keeps the shared library loaded
  T* object_ = nullptr;
  void (*destroy_)(void*) = nullptr;
};

struct PluginInfo {
  PluginKind kind;
  std::string name;
  std::string description;
  std::vector<ParamSpec> params;  // strings live in the library, kept loaded by `library`
  std::filesystem::path file;
  std::shared_ptr<void> library;
  const PluginDescriptor* descriptor = nullptr;
};

class PluginRegistry {
 public:
  // Files named kvlab_plugin_*.so in each folder, in order. Throws kvlab::Error when such a
  // file is not a kvlab plugin, was built for another ABI version, or repeats a name.
  explicit PluginRegistry(const std::vector<std::filesystem::path>& directories);

  // The default search path: the plugin folder next to the running kvlab (build tree:
  // build/plugins; installed: <prefix>/lib/kvlab/plugins), then KVLAB_PLUGIN_PATH (':'-separated).
  static std::vector<std::filesystem::path> default_search_path();

  // Loads one file explicitly (errors as above, and for a missing file).
  void load_file(const std::filesystem::path& file);

  const std::vector<PluginInfo>& plugins() const { return plugins_; }
  // Throws kvlab::Error listing the plugins of that kind, and the nearest name.
  const PluginInfo& find(PluginKind kind, std::string_view name) const;

  template <PluginKind K>
  PluginObject<typename PluginInterface<K>::type> create(
      std::string_view name, const std::map<std::string, ParamValue, std::less<>>& params,
      const PluginContext& context) const {
    using T = typename PluginInterface<K>::type;
    const PluginInfo& info = find(K, name);
    void* object = create_raw(info, params, context);
    return PluginObject<T>(info.library, static_cast<T*>(object), info.descriptor->destroy);
  }

 private:
  // load_file, with what loading the file in a child process showed ("" for nothing wrong).
  void load_probed_file(const std::filesystem::path& file, const std::string& probe_problem);
  void* create_raw(const PluginInfo& info,
                   const std::map<std::string, ParamValue, std::less<>>& params,
                   const PluginContext& context) const;
  std::vector<PluginInfo> plugins_;
};

}  // namespace kvlab
