#pragma once
// SentencePiece tokenizer of a model folder (tokenizer.model), via Debian's libsentencepiece.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvlab {

class Tokenizer {
 public:
  // Loads <directory>/tokenizer.model when it exists; nullopt when absent; throws
  // kvlab::Error when present but unreadable.
  static std::optional<Tokenizer> open_if_present(const std::filesystem::path& directory);
  static Tokenizer open(const std::filesystem::path& model_file);  // throws kvlab::Error

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<std::int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const std::int32_t> ids) const;
  std::int32_t vocab_size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlab
