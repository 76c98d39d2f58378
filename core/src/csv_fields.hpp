#pragma once
// Reading CSV trace rows (kvlab's traces, the Azure trace): cells split at commas, numbers
// parsed whole. Private to the core libraries.
#include <fmt/format.h>

#include <charconv>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/error.hpp"

namespace kvlab {

// "a,b,,c," -> {"a", "b", "", "c", ""} (no quoting: trace cells hold numbers and id lists).
inline std::vector<std::string> csv_cells(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream stream(line);
  for (std::string cell; std::getline(stream, cell, ',');) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

// A header line's column names: a UTF-8 byte order mark and the spaces around each name dropped.
inline std::vector<std::string> csv_header_names(std::vector<std::string> cells) {
  if (!cells.empty() && cells.front().starts_with("\xEF\xBB\xBF")) cells.front().erase(0, 3);
  for (std::string& name : cells) {
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
  }
  return cells;
}

// The whole of `text` (spaces around it allowed) as a T; a kvlab::Error naming `field` else.
template <typename T>
T parse_number(std::string_view text, const char* field) {
  T value{};
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  while (begin < end && *begin == ' ') ++begin;
  while (end > begin && end[-1] == ' ') --end;
  const auto [ptr, ec] = std::from_chars(begin, end, value);
  if (begin == end || ec != std::errc() || ptr != end)
    throw Error(fmt::format("{} \"{}\" is not a valid number", field, text));
  return value;
}

}  // namespace kvlab
