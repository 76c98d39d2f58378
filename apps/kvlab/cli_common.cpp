#include "cli_common.hpp"

#include <fmt/format.h>

#include <charconv>

#include "kvlab/error.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab::cli {

std::vector<std::int32_t> parse_token_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::size_t start = 0;
  int index = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    std::string item = text.substr(start, end - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    std::int32_t value = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size())
      throw Error(fmt::format("bad token id list \"{}\": item {} (\"{}\") is not an integer", text,
                              index, item));
    if (value < 0)
      throw Error(
          fmt::format("bad token id list \"{}\": item {} ({}) is negative", text, index, value));
    ids.push_back(value);
    start = end + 1;
    ++index;
  }
  return ids;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[unit]);
}

}  // namespace kvlab::cli
