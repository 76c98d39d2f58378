#include "kvlab/tokenizer.hpp"

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
    throw Error(fmt::format("cannot load SentencePiece tokenizer {}: {}", model_file.string(), status.ToString()));
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
  std::string text;
  const std::vector<int> values(ids.begin(), ids.end());
  const auto status = impl_->processor.Decode(values, &text);
  if (!status.ok()) throw Error(fmt::format("tokenizer cannot decode ids: {}", status.ToString()));
  return text;
}

std::int32_t Tokenizer::vocab_size() const { return impl_->processor.GetPieceSize(); }

}  // namespace kvlab
