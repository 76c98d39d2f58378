#pragma once
// "Did you mean ...?" for unknown names (presets, plugins, config keys).
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvlab {

// Levenshtein distance between two strings (case-sensitive).
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate closest to `name`, when it is close enough to be a plausible typo
// (distance <= max(2, len/3)); nullopt otherwise.
std::optional<std::string> nearest_name(std::string_view name,
                                        std::span<const std::string> candidates);

// "a, b, c" — for error messages that list what exists.
std::string join_names(std::span<const std::string> names, std::string_view separator = ", ");

}  // namespace kvlab
