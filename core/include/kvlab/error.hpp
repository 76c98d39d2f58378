#pragma once
// kvlab's one exception type. Thrown only at the edges (config parsing, file loading, CLI):
// the message is complete (what, where, why) and is printed as-is by the CLI.
#include <stdexcept>
#include <string>

namespace kvlab {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace kvlab
