#pragma once
// Limits on JSON that comes from outside (an HTTP body, a results folder's files): its size and
// how deep it nests. nlohmann::json parses iteratively, but copying, comparing and dumping a
// value recurse, so a body nested 100,000 deep parsed fine and then overflowed the stack in
// dump(). The depth is checked by a scan of the text before anything is parsed.
#include <cstddef>
#include <string>
#include <string_view>

namespace kvlab {

struct JsonLimits {
  std::size_t max_bytes = std::size_t{64} << 20;
  int max_depth = 64;  // arrays and objects inside each other; kvlab's own files need < 10
};

// What is wrong with `text` under `limits` ("nested deeper than 64 levels", "... bytes, past the
// limit of ..."), or "" when it is within them. Syntax is not checked: the parser does that.
std::string json_limit_problem(std::string_view text, const JsonLimits& limits = {});

}  // namespace kvlab
