#include "kvlab/data_sets.hpp"

#include <fmt/format.h>

#include <utility>

namespace kvlab {

std::string data_set_hint(std::string_view path) {
  // The folder (and for the derived prompt set, the file) under data/ -> get_data.sh's name.
  constexpr std::pair<std::string_view, std::string_view> kSets[] = {
      {"data/azure-llm-inference-2023/", "azure"},
      {"data/mooncake-fast25/", "mooncake"},
      {"data/wikitext-2-raw/", "wikitext2"},
      {"data/prompts/grounded_edits.jsonl", "grounded"},
      {"data/prompts/", "prompts"},
  };
  for (const auto& [where, name] : kSets)
    if (path.find(where) != std::string_view::npos)
      return fmt::format(
          "; it is a third-party data set, not in the repository: scripts/get_data.sh {} "
          "installs it (docs/data.md)",
          name);
  return {};
}

}  // namespace kvlab
