// libFuzzer: the tokenizer.json reader (model, vocab, merges, added tokens, normalizer,
// pre-tokenizer, post-processor); a tokenizer that loads encodes and decodes a fixed text.
#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data, size), ".json");
  try {
    const auto tokenizer = kvlab::open_tokenizer_json(path);
    const auto ids = tokenizer->encode("Hello <|im_start|> 12345 caf\u00e9 \U0001F600\n");
    (void)tokenizer->decode(ids);
  } catch (const kvlab::Error&) {
  }
  return 0;
}
