#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include "kvlab/error.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

// Trains a small SentencePiece model with the real trainer, the way a user's tokenizer.model
// would have been made.
std::filesystem::path train_tokenizer(const test::TempDir& dir) {
  std::string corpus;
  const char* words[] = {"the", "cat", "sat", "on",  "a",    "mat",
                         "and", "dog", "ran", "far", "away", "home"};
  for (int i = 0; i < 3000; ++i)
    corpus += std::string(words[(i * 7) % 12]) + (i % 9 == 8 ? ".\n" : " ");
  test::write_file(dir / "corpus.txt", corpus);
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt").string() +
      " --model_prefix=" + (dir / "tokenizer").string() +
      " --vocab_size=60 --model_type=bpe --minloglevel=2 --bos_id=1 --eos_id=2 --unk_id=0");
  EXPECT_TRUE(status.ok()) << status.ToString();
  return dir / "tokenizer.model";
}

TEST(Tokenizer, EncodeDecodeRoundTrip) {
  test::TempDir dir;
  const Tokenizer tokenizer = Tokenizer::open(train_tokenizer(dir));
  EXPECT_EQ(tokenizer.vocab_size(), 60);
  const auto ids = tokenizer.encode("the cat sat on a mat");
  EXPECT_FALSE(ids.empty());
  EXPECT_EQ(tokenizer.decode(ids), "the cat sat on a mat");
}

TEST(Tokenizer, AbsentIsNotAnError) {
  test::TempDir dir;
  EXPECT_FALSE(Tokenizer::open_if_present(dir.path()).has_value());
}

TEST(Tokenizer, CorruptModelIsAClearError) {
  test::TempDir dir;
  test::write_file(dir / "tokenizer.model", "not a protobuf");
  const std::string message =
      test::error_of<Error>([&] { Tokenizer::open_if_present(dir.path()); });
  EXPECT_NE(message.find("tokenizer.model"), std::string::npos) << message;
}

}  // namespace
}  // namespace kvlab
