// libFuzzer: byte-level BPE encoding of arbitrary text with the four fixture tokenizers (GPT-2,
// SmolLM, Llama-3, Qwen2 pre-tokenizers; tests/fixtures/tokenizer). The first byte picks the
// tokenizer. Invalid UTF-8 must be a kvlab::Error; valid text must round-trip:
// decode(encode(x)) == x (NFC(x) for Qwen2, so there encode(decode(encode(x))) == encode(x)).
#include <array>
#include <cstdlib>
#include <memory>
#include <string>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/tokenizer.hpp"

namespace {

const std::array<std::unique_ptr<kvlab::Tokenizer>, 4>& tokenizers() {
  static const auto all = [] {
    const std::string dir = KVLAB_TOKENIZER_FIXTURES;
    return std::array<std::unique_ptr<kvlab::Tokenizer>, 4>{
        kvlab::open_tokenizer_json(dir + "/gpt2.tokenizer.json"),
        kvlab::open_tokenizer_json(dir + "/smollm.tokenizer.json"),
        kvlab::open_tokenizer_json(dir + "/llama3.tokenizer.json"),
        kvlab::open_tokenizer_json(dir + "/qwen2.tokenizer.json")};
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t which = data[0] % 4;
  const kvlab::Tokenizer& tokenizer = *tokenizers()[which];
  const std::string text(kvlab::fuzz::as_text(data + 1, size - 1));
  const bool valid = kvlab::valid_utf8_prefix(text) == text.size();
  try {
    const auto ids = tokenizer.encode(text);
    if (!valid) std::abort();  // invalid UTF-8 was accepted
    const std::string decoded = tokenizer.decode(ids);
    if (which != 3 && decoded != text) std::abort();  // lost or changed text
    if (which == 3 && tokenizer.encode(decoded) != ids) std::abort();
  } catch (const kvlab::Error&) {
    if (valid) std::abort();  // valid text must always encode
  }
  return 0;
}
