// libFuzzer: the tokenizer.json reader (model, vocab, merges, added tokens, normalizer,
// pre-tokenizer, post-processor); a tokenizer that loads encodes and decodes a fixed text.
// Vocabularies: the file is also found as a model folder's tokenizer for an embedding of 1,000
// rows (the fixtures' size); one it accepts must never give an id past row 999, BOS and EOS
// included, and one that could is refused as a kvlab::Error.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/tokenizer.hpp"

namespace {

constexpr std::int64_t kEmbeddingRows = 1000;

const std::filesystem::path& model_folder() {
  static const auto folder = [] {
    const auto path =
        std::filesystem::temp_directory_path() / ("kvlab_fuzz_model_" + std::to_string(getpid()));
    std::filesystem::create_directories(path);
    return path;
  }();
  return folder;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = kvlab::fuzz::as_text(data, size);
  const auto path = kvlab::fuzz::write_input(text, ".json");
  const std::string sample = "Hello <|im_start|> 12345 caf\u00e9 \U0001F600\n";
  try {
    const auto tokenizer = kvlab::open_tokenizer_json(path);
    (void)tokenizer->decode(tokenizer->encode(sample));
  } catch (const kvlab::Error&) {
    return 0;  // not a tokenizer: the folder check below would refuse it the same way
  }
  std::filesystem::copy_file(path, model_folder() / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  try {
    const auto lookup = kvlab::find_tokenizer(model_folder(), kEmbeddingRows);
    const kvlab::Tokenizer& t = *lookup.tokenizer;
    if (t.vocab_size() > kEmbeddingRows) std::abort();
    for (const std::int32_t id : t.encode_prompt(sample))
      if (id < 0 || id >= kEmbeddingRows) std::abort();  // an id past the embedding got through
  } catch (const kvlab::Error&) {
  }
  return 0;
}
