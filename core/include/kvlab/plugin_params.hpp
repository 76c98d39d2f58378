#pragma once
// Plugin parameters: the schema a plugin declares, and the validated values it is created with.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvlab {

enum class ParamType : std::uint32_t { param_integer, param_real, param_boolean, param_string };
const char* param_type_name(ParamType type);

// One declared parameter. Plain data with static-storage strings: it lives in the plugin's
// read-only data and is read by the host while the library is loaded.
struct ParamSpec {
  const char* name;
  ParamType type;
  const char* description;
  const char* default_value;  // in TOML syntax: "16", "0.5", "true", "\"lru\""
  double min_value;           // inclusive bounds for integer/real
  double max_value;
};

using ParamValue = std::variant<std::int64_t, double, bool, std::string>;
std::string param_value_to_string(const ParamValue& value);

// Validated parameter values (every declared parameter present, defaults filled in).
class PluginParams {
 public:
  PluginParams() = default;
  explicit PluginParams(std::map<std::string, ParamValue, std::less<>> values)
      : values_(std::move(values)) {}
  // Accessors for plugins; the loader guarantees presence and type for declared parameters.
  std::int64_t integer(std::string_view name) const;
  double real(std::string_view name) const;
  bool boolean(std::string_view name) const;
  const std::string& string(std::string_view name) const;
  const std::map<std::string, ParamValue, std::less<>>& values() const { return values_; }

 private:
  std::map<std::string, ParamValue, std::less<>> values_;
};

// "" when the host can use `spec`; otherwise what is wrong: a null or empty name, a null
// description or default, a type kvlab does not know, a default that does not read as its type
// (whole text, finite), an inverted or NaN range, a default outside the range.
std::string param_spec_problem(const ParamSpec& spec);

// Checks user-given values against a schema and fills defaults. `plugin` names the plugin in
// messages. Throws kvlab::Error: unknown parameter (with the nearest name and the list), wrong
// type, value out of range. An integer is accepted where a real is declared.
PluginParams validate_plugin_params(std::string_view plugin, const std::vector<ParamSpec>& schema,
                                    const std::map<std::string, ParamValue, std::less<>>& given);

}  // namespace kvlab
