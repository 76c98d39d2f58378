#include "kvlab/plugin_params.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

const char* param_type_name(ParamType type) {
  switch (type) {
    case ParamType::param_integer:
      return "integer";
    case ParamType::param_real:
      return "number";
    case ParamType::param_boolean:
      return "boolean";
    case ParamType::param_string:
      return "string";
  }
  return "?";
}

std::string param_value_to_string(const ParamValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>)
          return "\"" + v + "\"";
        else if constexpr (std::is_same_v<T, bool>)
          return v ? "true" : "false";
        else
          return fmt::format("{}", v);
      },
      value);
}

namespace {

template <typename T>
const T& get(const std::map<std::string, ParamValue, std::less<>>& values, std::string_view name) {
  auto it = values.find(name);
  if (it == values.end() || !std::holds_alternative<T>(it->second))
    throw Error(fmt::format("internal: plugin parameter \"{}\" missing or of another type", name));
  return std::get<T>(it->second);
}

// A schema's default read strictly for its type: the whole text, finite, no silent zero.
std::optional<ParamValue> read_default(const ParamSpec& spec) {
  const std::string text = spec.default_value;
  char* end = nullptr;
  errno = 0;
  switch (spec.type) {
    case ParamType::param_integer: {
      const long long value = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || errno == ERANGE) return std::nullopt;
      return static_cast<std::int64_t>(value);
    }
    case ParamType::param_real: {
      const double value = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !std::isfinite(value)) return std::nullopt;
      return value;
    }
    case ParamType::param_boolean:
      if (text != "true" && text != "false") return std::nullopt;
      return text == "true";
    case ParamType::param_string:
      return text.size() >= 2 && text.front() == '"' && text.back() == '"'
                 ? text.substr(1, text.size() - 2)
                 : text;
  }
  return std::nullopt;
}

double as_number(const ParamValue& value) {
  return std::holds_alternative<std::int64_t>(value)
             ? static_cast<double>(std::get<std::int64_t>(value))
             : std::get<double>(value);
}

ParamValue parse_default(const ParamSpec& spec) {
  const auto value = read_default(spec);
  if (!value)  // param_spec_problem refused such a schema at load
    throw Error(fmt::format("internal: parameter \"{}\" has an unreadable default", spec.name));
  return *value;
}

}  // namespace

std::string param_spec_problem(const ParamSpec& spec) {
  if (spec.name == nullptr || spec.name[0] == '\0') return "a parameter has a null or empty name";
  const std::string name = spec.name;
  if (spec.type != ParamType::param_integer && spec.type != ParamType::param_real &&
      spec.type != ParamType::param_boolean && spec.type != ParamType::param_string)
    return fmt::format("parameter \"{}\" has type {}, not one kvlab knows (0-3)", name,
                       static_cast<std::uint32_t>(spec.type));
  if (spec.description == nullptr)
    return fmt::format("parameter \"{}\" has a null description", name);
  if (spec.default_value == nullptr)
    return fmt::format("parameter \"{}\" has a null default", name);
  const auto value = read_default(spec);
  if (!value)
    return fmt::format("parameter \"{}\"'s default \"{}\" is not a {}", name, spec.default_value,
                       param_type_name(spec.type));
  if (spec.type != ParamType::param_integer && spec.type != ParamType::param_real) return "";
  if (std::isnan(spec.min_value) || std::isnan(spec.max_value) || spec.min_value > spec.max_value)
    return fmt::format("parameter \"{}\" has the range [{}, {}]: not a range", name, spec.min_value,
                       spec.max_value);
  if (as_number(*value) < spec.min_value || as_number(*value) > spec.max_value)
    return fmt::format("parameter \"{}\"'s default {} is outside its range [{}, {}]", name,
                       spec.default_value, spec.min_value, spec.max_value);
  return "";
}

std::int64_t PluginParams::integer(std::string_view name) const {
  return get<std::int64_t>(values_, name);
}
double PluginParams::real(std::string_view name) const {
  return get<double>(values_, name);
}
bool PluginParams::boolean(std::string_view name) const {
  return get<bool>(values_, name);
}
const std::string& PluginParams::string(std::string_view name) const {
  return get<std::string>(values_, name);
}

namespace {

// `value` as `spec` declares it (an integer widened for a real), or an error naming the plugin,
// the parameter and what was wrong: its type or its range.
ParamValue checked_value(std::string_view plugin, const ParamSpec& spec, const ParamValue& value) {
  ParamValue converted = value;
  if (spec.type == ParamType::param_real && std::holds_alternative<std::int64_t>(value))
    converted = static_cast<double>(std::get<std::int64_t>(value));
  const bool type_ok =
      (spec.type == ParamType::param_integer && std::holds_alternative<std::int64_t>(converted)) ||
      (spec.type == ParamType::param_real && std::holds_alternative<double>(converted)) ||
      (spec.type == ParamType::param_boolean && std::holds_alternative<bool>(converted)) ||
      (spec.type == ParamType::param_string && std::holds_alternative<std::string>(converted));
  if (!type_ok)
    throw Error(fmt::format("plugin \"{}\" parameter \"{}\" must be {} {}, got {}", plugin,
                            spec.name, spec.type == ParamType::param_integer ? "an" : "a",
                            param_type_name(spec.type), param_value_to_string(value)));
  if (spec.type == ParamType::param_integer || spec.type == ParamType::param_real) {
    const double number = as_number(converted);
    if (number < spec.min_value || number > spec.max_value)
      throw Error(fmt::format("plugin \"{}\" parameter \"{}\" = {} is out of range [{}, {}]",
                              plugin, spec.name, param_value_to_string(value), spec.min_value,
                              spec.max_value));
  }
  return converted;
}

}  // namespace

PluginParams validate_plugin_params(std::string_view plugin, const std::vector<ParamSpec>& schema,
                                    const std::map<std::string, ParamValue, std::less<>>& given) {
  std::vector<std::string> names;
  for (const auto& spec : schema) names.emplace_back(spec.name);
  std::map<std::string, ParamValue, std::less<>> values;
  for (const auto& spec : schema) values[spec.name] = parse_default(spec);
  for (const auto& [name, value] : given) {
    const ParamSpec* spec = nullptr;
    for (const auto& s : schema)
      if (name == s.name) spec = &s;
    if (spec == nullptr) {
      std::string message = fmt::format("plugin \"{}\" has no parameter \"{}\"", plugin, name);
      if (auto near = nearest_name(name, names))
        message += fmt::format(" (did you mean \"{}\"?)", *near);
      message += names.empty() ? "; it takes no parameters" : "; parameters: " + join_names(names);
      throw Error(message);
    }
    values[name] = checked_value(plugin, *spec, value);
  }
  return PluginParams(std::move(values));
}

}  // namespace kvlab
