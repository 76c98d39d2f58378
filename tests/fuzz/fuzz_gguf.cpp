// libFuzzer: the GGUF reader (header, every metadata type, nested arrays, tensor infos,
// alignment, offsets); every tensor of a file that opens is dequantized, its model metadata
// (llama.* or gemma3.* keys) read as a model config, and its tokenizer metadata
// (tokenizer.ggml.*) read and, when it loads, encodes a text.
#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/gguf.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "kvlab/model/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data, size), ".gguf");
  try {
    const auto file = kvlab::GgufFile::open(path);
    for (const auto& [key, value] : file.metadata()) (void)value.to_string();
    for (const auto& tensor : file.tensors())
      if (tensor.elements <= (1 << 20)) (void)file.dequantize(tensor);
    try {
      (void)kvlab::gguf_model_config(file);
    } catch (const kvlab::Error&) {  // not a model (most inputs): the tokenizer is still read
    }
    const auto lookup = kvlab::find_tokenizer(path);
    if (lookup.tokenizer) (void)lookup.tokenizer->decode(lookup.tokenizer->encode("Hi 12 <|x|>"));
  } catch (const kvlab::Error&) {
  }
  return 0;
}
