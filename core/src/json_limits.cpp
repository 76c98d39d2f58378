#include "kvlab/json_limits.hpp"

#include <fmt/format.h>

namespace kvlab {

std::string json_limit_problem(std::string_view text, const JsonLimits& limits) {
  if (text.size() > limits.max_bytes)
    return fmt::format("{} bytes, past the limit of {}", text.size(), limits.max_bytes);
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limits.max_depth)
        return fmt::format("nested deeper than {} levels (arrays and objects)", limits.max_depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return {};
}

}  // namespace kvlab
