// libFuzzer: experiment files with --set and --sweep changes. The input is the TOML text, then
// optionally a line "--- set" followed by one `dotted.key=value` --set per line, or
// `sweep dotted.key=v1,v2` for a --sweep.
#include <string>
#include <vector>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = kvlab::fuzz::as_text(data, size);
  constexpr std::string_view kSeparator = "\n--- set\n";
  const std::size_t split = text.find(kSeparator);
  kvlab::CommandLineChanges changes;
  if (split != std::string_view::npos) {
    std::string_view rest = text.substr(split + kSeparator.size());
    while (!rest.empty()) {
      const std::size_t end = std::min(rest.find('\n'), rest.size());
      const std::string_view line = rest.substr(0, end);
      if (line.starts_with("sweep "))
        changes.sweep.emplace_back(line.substr(6));
      else if (!line.empty())
        changes.set.emplace_back(line);
      rest.remove_prefix(std::min(end + 1, rest.size()));
    }
  }
  const auto path = kvlab::fuzz::write_input(text.substr(0, split), ".toml");
  try {
    std::vector<std::string> notes;
    (void)kvlab::load_experiment(path, changes, &notes);
  } catch (const kvlab::Error&) {
  }
  return 0;
}
