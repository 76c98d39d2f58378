#include "replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kvlab/error.hpp"

namespace kvlab {

namespace detail {

void check_replay_options(std::string_view trace, double start_s, double duration_s,
                          double rate_scale, std::int64_t max_requests, std::int64_t context,
                          std::int64_t vocab_size) {
  if (!(start_s >= 0) || !(duration_s >= 0) || !std::isfinite(start_s + duration_s))
    throw Error(fmt::format("{} window: start_s {} and duration_s {} must be >= 0", trace, start_s,
                            duration_s));
  if (!(rate_scale > 0) || !std::isfinite(rate_scale))
    throw Error(fmt::format("{} rate_scale must be > 0, got {}", trace, rate_scale));
  if (max_requests < 0 || context < 0 || context == 1 || vocab_size < 1)
    throw Error(
        fmt::format("{} max_requests and context must be >= 0 (context >= 2), vocab >= 1", trace));
}

nlohmann::json parse_json_object(const std::string& line) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("not valid JSON: {}", e.what()));
  }
  if (!object.is_object()) throw Error("each line must be a JSON object");
  return object;
}

bool clip_to_context(std::int64_t& prompt, std::int64_t& output, std::int64_t context) {
  if (context == 0 || prompt + output <= context) return false;
  prompt = std::min(prompt, context - 1);
  output = std::min(output, context - prompt);
  return true;
}

}  // namespace detail

}  // namespace kvlab
