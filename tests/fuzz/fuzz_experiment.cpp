// libFuzzer: experiment files with --set overrides. The input is the TOML text, then optionally
// a line "--- set" followed by one `dotted.key=value` override per line.
#include <string>
#include <vector>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = kvlab::fuzz::as_text(data, size);
  constexpr std::string_view kSeparator = "\n--- set\n";
  const std::size_t split = text.find(kSeparator);
  std::vector<std::string> overrides;
  if (split != std::string_view::npos) {
    std::string_view rest = text.substr(split + kSeparator.size());
    while (!rest.empty()) {
      const std::size_t end = std::min(rest.find('\n'), rest.size());
      if (end > 0) overrides.emplace_back(rest.substr(0, end));
      rest.remove_prefix(std::min(end + 1, rest.size()));
    }
  }
  const auto path = kvlab::fuzz::write_input(text.substr(0, split), ".toml");
  try {
    (void)kvlab::load_experiment(path, overrides);
  } catch (const kvlab::Error&) {
  }
  return 0;
}
