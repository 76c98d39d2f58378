#include "kvlab/sim/step_spec.hpp"

#include <fmt/format.h>

#include <charconv>

#include "kvlab/error.hpp"

namespace kvlab {
namespace {

std::int64_t parse_count(std::string_view text, std::string_view part, std::int64_t most) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc{} || end != text.data() + text.size() || value < 0)
    throw Error(fmt::format("step \"{}\": \"{}\" is not a count", part, text));
  if (value > most) throw Error(fmt::format("step \"{}\": {} is more than {}", part, value, most));
  return value;
}

// "KxN" -> (K, N); "N" -> (1, N).
std::pair<std::int64_t, std::int64_t> parse_times(std::string_view text, std::string_view part) {
  const auto x = text.find('x');
  if (x == std::string_view::npos) return {1, parse_count(text, part, kMaxStepSequenceTokens)};
  return {parse_count(text.substr(0, x), part, kMaxStepSequences),
          parse_count(text.substr(x + 1), part, kMaxStepSequenceTokens)};
}

void add_part(std::string_view part, std::vector<EntryShape>& entries) {
  const auto equals = part.find('=');
  const std::string_view kind = part.substr(0, equals);
  if (equals == std::string_view::npos || (kind != "prefill" && kind != "decode"))
    throw Error(fmt::format(
        "step \"{}\" is neither prefill=[Kx]N[@cached] nor decode=BxL (e.g. prefill=2048, "
        "prefill=4x512@1024, decode=32x1024, or both: prefill=512,decode=16x2048)",
        part));
  std::string_view value = part.substr(equals + 1);
  std::int64_t cached = 0;
  if (const auto at = value.find('@'); at != std::string_view::npos) {
    if (kind == "decode")
      throw Error(fmt::format("step \"{}\": a decode's cached tokens are its L in BxL", part));
    cached = parse_count(value.substr(at + 1), part, kMaxStepSequenceTokens);
    value = value.substr(0, at);
  }
  const auto [count, length] = parse_times(value, part);
  if (count == 0 || length == 0) throw Error(fmt::format("step \"{}\" has no tokens", part));
  if (kind == "decode" && value.find('x') == std::string_view::npos)
    throw Error(fmt::format("step \"{}\": a decode is BxL (B sequences after L tokens)", part));
  if (static_cast<std::int64_t>(entries.size()) + count > kMaxStepSequences)
    throw Error(fmt::format("step: more than {} sequences", kMaxStepSequences));
  const EntryShape shape =
      kind == "prefill" ? EntryShape{length, cached, 0, 1} : EntryShape{1, length, 0, 1};
  entries.insert(entries.end(), static_cast<std::size_t>(count), shape);
}

}  // namespace

std::vector<EntryShape> parse_step_spec(std::string_view text) {
  std::vector<EntryShape> entries;
  std::string_view rest = text;
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    add_part(rest.substr(0, comma), entries);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
  }
  if (entries.empty()) throw Error("step: empty (give prefill=N or decode=BxL)");
  return entries;
}

}  // namespace kvlab
