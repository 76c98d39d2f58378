#include "kvlab/model/tokenizer.hpp"

#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include "kvlab/error.hpp"

namespace kvlab {

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::open(const std::filesystem::path& model_file) {
  auto impl = std::make_unique<Impl>();
  const auto status = impl->processor.Load(model_file.string());
  if (!status.ok())
    throw Error(fmt::format("cannot load SentencePiece tokenizer {}: {}", model_file.string(),
                            status.ToString()));
  return Tokenizer(std::move(impl));
}

std::optional<Tokenizer> Tokenizer::open_if_present(const std::filesystem::path& directory) {
  const auto file = directory / "tokenizer.model";
  if (!std::filesystem::exists(file)) return std::nullopt;
  return open(file);
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = impl_->processor.Encode(text, &ids);
  if (!status.ok()) throw Error(fmt::format("tokenizer cannot encode text: {}", status.ToString()));
  return {ids.begin(), ids.end()};
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids) const {
  // A model's vocabulary may be larger than its tokenizer's (padded embeddings; random-weight
  // models): ids the tokenizer does not know are shown as <id:N> instead of failing.
  const int pieces = impl_->processor.GetPieceSize();
  std::string text;
  std::vector<int> run;
  auto flush = [&] {
    if (run.empty()) return;
    std::string decoded;
    const auto status = impl_->processor.Decode(run, &decoded);
    if (!status.ok())
      throw Error(fmt::format("tokenizer cannot decode ids: {}", status.ToString()));
    text += decoded;
    run.clear();
  };
  for (std::int32_t id : ids) {
    if (id >= 0 && id < pieces) {
      run.push_back(id);
    } else {
      flush();
      text += fmt::format("<id:{}>", id);
    }
  }
  flush();
  return text;
}

std::int32_t Tokenizer::vocab_size() const {
  return impl_->processor.GetPieceSize();
}

}  // namespace kvlab
