#pragma once
// The plugin ABI. A plugin is a shared library exporting one descriptor through Boost.DLL:
//
//   class PagedAllocator final : public kvlab::KvAllocator { ... };
//   const kvlab::ParamSpec kParams[] = {{"block_size", kvlab::ParamType::param_integer, "...",
//   "16", 1, 4096}}; KVLAB_PLUGIN(kvlab::PluginKind::kv_allocator, PagedAllocator, "paged", "one
//   line", kParams)
//
// The host checks abi_version and abi_fingerprint (plugin_abi.hpp) by exact equality, validates
// parameters against the schema, and wraps created objects so they are destroyed by the plugin's
// own `destroy` while the library is still loaded. Nothing that needs the library's code after
// unload crosses the boundary: no exception (create catches and copies the message), no
// std::function, no deleter.
#include <boost/config.hpp>
#include <boost/dll/alias.hpp>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>

#include "kvlab/attention_variant.hpp"
#include "kvlab/backend.hpp"
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_policy.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/model_weights.hpp"
#include "kvlab/plugin_abi.hpp"
#include "kvlab/plugin_params.hpp"
#include "kvlab/proposer.hpp"
#include "kvlab/router.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

enum class PluginKind : std::uint32_t {
  kv_allocator = 1,
  attention_variant = 2,
  scheduler = 3,
  backend = 4,
  router = 5,
  tier_policy = 6,
  kv_policy = 7,
  proposer = 8
};
// "allocator", "attention", "scheduler", "backend", "router", "tier_policy", "kv_policy",
// "proposer"
const char* plugin_kind_name(PluginKind kind);

// What a plugin object may need from the host when it is created.
struct PluginContext {
  // allocators: the pool whose slots they hand out; proposers: the draft model's (with `draft`)
  KvPool* pool = nullptr;
  const ModelConfig* model = nullptr;  // the model being served
  std::int64_t max_seq_len = 0;        // longest sequence (prompt + output) a request may reach
  const ModelWeightsView* weights = nullptr;  // backends: the checkpoint (K/V heads converted)
  std::int64_t window = 0;                    // backends: sliding-window size, 0 for none
  const KvTierSpec* tiers = nullptr;  // allocators: KV tiers below the pool ([kv_tiers]), or none
  // proposers: a backend running the draft model ([speculation] draft_model or draft_layers),
  // its K/V in `pool` (which holds nothing else), or none; `model` is then the draft's config
  Backend* draft = nullptr;
};

struct PluginDescriptor {
  std::uint32_t abi_version;      // first field: readable whatever else changes
  std::uint64_t abi_fingerprint;  // kPluginAbiFingerprint as the plugin was built
  PluginKind kind;
  const char* name;
  const char* description;
  const ParamSpec* params;
  std::size_t param_count;
  // The object as a pointer to the kind's interface, cast to void*; nullptr with a message in
  // error[0, error_size) when creation failed.
  void* (*create)(const PluginParams& params, const PluginContext& context, char* error,
                  std::size_t error_size);
  void (*destroy)(void* object);
};

// The layouts of every type crossing the boundary, this header's own included.
inline constexpr std::uint64_t kPluginAbiFingerprint =
    detail::Fnv1a{plugin_abi_fingerprint()}.type<PluginContext>().type<PluginDescriptor>().hash;

template <PluginKind K>
struct PluginInterface;
template <>
struct PluginInterface<PluginKind::kv_allocator> {
  using type = KvAllocator;
};
template <>
struct PluginInterface<PluginKind::attention_variant> {
  using type = AttentionVariant;
};
template <>
struct PluginInterface<PluginKind::scheduler> {
  using type = Scheduler;
};
template <>
struct PluginInterface<PluginKind::backend> {
  using type = Backend;
};
template <>
struct PluginInterface<PluginKind::router> {
  using type = Router;
};
template <>
struct PluginInterface<PluginKind::tier_policy> {
  using type = KvTierPolicy;
};
template <>
struct PluginInterface<PluginKind::kv_policy> {
  using type = KvPolicy;
};
template <>
struct PluginInterface<PluginKind::proposer> {
  using type = Proposer;
};

namespace detail {
template <PluginKind K, typename Impl>
void* guarded_create(const PluginParams& params, const PluginContext& context, char* error,
                     std::size_t size) {
  try {
    using Interface = typename PluginInterface<K>::type;
    return static_cast<void*>(static_cast<Interface*>(new Impl(params, context)));
  } catch (const std::exception& e) {
    std::snprintf(error, size, "%s", e.what());
  } catch (...) {
    std::snprintf(error, size, "unknown exception");
  }
  return nullptr;
}
}  // namespace detail

}  // namespace kvlab

// Defines and exports the plugin's descriptor (symbol "kvlab_plugin_descriptor").
// PARAMS: an array of kvlab::ParamSpec, or kvlab::kNoParams.
#define KVLAB_PLUGIN(KIND, IMPL, NAME, DESCRIPTION, PARAMS)                                     \
  namespace {                                                                                   \
  void* kvlab_plugin_create(const ::kvlab::PluginParams& p, const ::kvlab::PluginContext& c,    \
                            char* e, std::size_t n) {                                           \
    return ::kvlab::detail::guarded_create<KIND, IMPL>(p, c, e, n);                             \
  }                                                                                             \
  void kvlab_plugin_destroy(void* object) {                                                     \
    delete static_cast<::kvlab::PluginInterface<KIND>::type*>(object);                          \
  }                                                                                             \
  const std::span<const ::kvlab::ParamSpec> kvlab_plugin_params{PARAMS};                        \
  const ::kvlab::PluginDescriptor kvlab_plugin_descriptor_value{::kvlab::kPluginAbiVersion,     \
                                                                ::kvlab::kPluginAbiFingerprint, \
                                                                KIND,                           \
                                                                NAME,                           \
                                                                DESCRIPTION,                    \
                                                                kvlab_plugin_params.data(),     \
                                                                kvlab_plugin_params.size(),     \
                                                                &kvlab_plugin_create,           \
                                                                &kvlab_plugin_destroy};         \
  const ::kvlab::PluginDescriptor* kvlab_plugin_get_descriptor() {                              \
    return &kvlab_plugin_descriptor_value;                                                      \
  }                                                                                             \
  }                                                                                             \
  BOOST_DLL_ALIAS(kvlab_plugin_get_descriptor, kvlab_plugin_descriptor)

namespace kvlab {
inline constexpr std::span<const ParamSpec> kNoParams{};
}
