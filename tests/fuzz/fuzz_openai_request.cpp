// libFuzzer: kvlab serve's request bodies (the OpenAI API's JSON): the first input byte picks
// completions (even) or chat completions (odd); the rest is the body. Every input parses or is
// an ApiError (a 400 naming the field); the stop strings it names are run over its own bytes.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvlab/serve/openai_api.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool chat = data[0] % 2 == 1;
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  try {
    const kvlab::serve::CompletionRequest r = kvlab::serve::parse_completion_request(body, chat);
    kvlab::serve::StopStrings stops(r.stop);
    std::size_t released = 0;
    for (std::size_t at = 0; at < body.size() && !stops.stopped(); at += 3)
      released += stops.push(body.substr(at, 3)).size();
    released += stops.flush().size();
    if (released > body.size()) __builtin_trap();  // it can only hold back or cut, never add
  } catch (const kvlab::serve::ApiError& e) {
    if (e.status != 400) __builtin_trap();
  }
  return 0;
}
