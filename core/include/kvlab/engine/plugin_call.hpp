#pragma once
// Calls across the plugin boundary: whatever a plugin throws (a std::exception, or anything else)
// becomes one kvlab::Error naming the plugin and the step, instead of std::terminate.
#include <fmt/format.h>

#include <cstdint>
#include <exception>
#include <new>
#include <string_view>

#include "kvlab/error.hpp"

namespace kvlab {

enum class PluginErrors : std::uint8_t {
  all,        // the call is the plugin's own code: even a kvlab::Error it throws is named
  non_kvlab,  // the call is host code that calls plugins: its kvlab::Errors are complete
};

// `who`: e.g. `scheduler plugin "fcfs" (/path/kvlab_plugin_fcfs.so)`. std::bad_alloc passes
// as it is (the CLI reports it as out of memory).
// `at`, `unit`: where the run was ("step 12", "request 7").
template <PluginErrors kWrap = PluginErrors::all, typename F>
decltype(auto) plugin_call(std::string_view who, std::int64_t at, F&& call,
                           const char* unit = "step") {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const Error& e) {
    if constexpr (kWrap == PluginErrors::non_kvlab) throw;
    throw Error(fmt::format("{} {}: {} failed: {}", unit, at, who, e.what()));
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} {}: {} threw an exception: {}", unit, at, who, e.what()));
  } catch (...) {
    throw Error(
        fmt::format("{} {}: {} threw something that is not a std::exception", unit, at, who));
  }
}

}  // namespace kvlab
