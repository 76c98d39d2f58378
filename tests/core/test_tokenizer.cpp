#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "kvlab/error.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/model/gguf.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "test_util.hpp"
#include "tokenizer_fixture.hpp"

namespace kvlab {
namespace {

const std::filesystem::path kTokenizerFixtures =
    std::filesystem::path(KVLAB_FIXTURES_DIR) / "tokenizer";
const std::filesystem::path kPrompts =
    std::filesystem::path(KVLAB_FIXTURES_DIR) / ".." / ".." / "data" / "prompts";

// Trains a small SentencePiece model with the real trainer, the way a user's tokenizer.model
// would have been made.
std::filesystem::path train_sentencepiece(const test::TempDir& dir) {
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

TEST(Tokenizer, SentencePieceRoundTripAndBos) {
  test::TempDir dir;
  train_sentencepiece(dir);
  const TokenizerLookup lookup = find_tokenizer(dir.path());
  ASSERT_TRUE(lookup.tokenizer) << lookup.why_not;
  const Tokenizer& tokenizer = *lookup.tokenizer;
  EXPECT_EQ(tokenizer.vocab_size(), 60);
  const auto ids = tokenizer.encode("the cat sat on a mat");
  EXPECT_FALSE(ids.empty());
  EXPECT_EQ(tokenizer.decode(ids), "the cat sat on a mat");
  const auto prompt = tokenizer.encode_prompt("the cat sat on a mat");
  ASSERT_EQ(prompt.size(), ids.size() + 1);
  EXPECT_EQ(prompt[0], 1);  // Llama-2's convention: BOS first
}

TEST(Tokenizer, AbsentIsNotAnErrorButSaysWhy) {
  test::TempDir dir;
  const TokenizerLookup lookup = find_tokenizer(dir.path());
  EXPECT_FALSE(lookup.tokenizer);
  EXPECT_NE(lookup.why_not.find("no tokenizer.model or tokenizer.json"), std::string::npos);
}

TEST(Tokenizer, CorruptSentencePieceModelIsAClearError) {
  test::TempDir dir;
  test::write_file(dir / "tokenizer.model", "not a protobuf");
  test::expect_error_containing([&] { find_tokenizer(dir.path()); }, {"tokenizer.model"});
}

// The four pre-tokenizer families, each from its tokenizer.json and from its GGUF metadata:
// ids equal to Hugging Face `tokenizers` on MT-Bench, Vicuna bench, 200 GSM8K questions and the
// edge cases; decode(encode(x)) == x (NFC(x) for Qwen2, which normalizes).
class BpeFamily : public ::testing::TestWithParam<std::string> {};

void expect_matches_fixture(const Tokenizer& tokenizer, const std::string& family) {
  const auto texts = test::fixture_texts(kPrompts);
  const auto cases = test::fixture_cases(kTokenizerFixtures / (family + ".ids.jsonl"));
  ASSERT_EQ(cases.size(), 160u + 80u + 200u + 15u);  // + 15 extra cases
  int equal = 0;
  for (const auto& c : cases) {
    const std::string& text = c.text_in(texts);
    const auto ids = tokenizer.encode(text);
    if (ids == c.ids)
      ++equal;
    else
      ADD_FAILURE() << family << " " << c.source << ": ids differ from tokenizers'";
    const std::string expected_text =
        family == "qwen2" && c.source == "extra:7" ? "caf\u00e9 (combining accent)" : text;
    EXPECT_EQ(tokenizer.decode(ids), expected_text) << family << " " << c.source;
  }
  EXPECT_EQ(equal, static_cast<int>(cases.size()));
}

TEST_P(BpeFamily, TokenizerJsonEqualsHuggingFaceTokenizers) {
  const auto tokenizer = open_tokenizer_json(kTokenizerFixtures / (GetParam() + ".tokenizer.json"));
  expect_matches_fixture(*tokenizer, GetParam());
}

TEST_P(BpeFamily, GgufMetadataEqualsHuggingFaceTokenizers) {
  const TokenizerLookup lookup = find_tokenizer(kTokenizerFixtures / (GetParam() + ".gguf"));
  ASSERT_TRUE(lookup.tokenizer) << lookup.why_not;
  expect_matches_fixture(*lookup.tokenizer, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Families, BpeFamily,
                         ::testing::Values("gpt2", "smollm", "llama3", "qwen2"));

// The merge rule as written: rescan every adjacent pair, merge the lowest rank (leftmost among
// equals), repeat. O(n^2); kvlab's heap must give exactly its result on any piece.
std::vector<std::int32_t> quadratic_bpe(const nlohmann::json& model, const std::string& piece) {
  std::map<std::string, int> rank;
  for (std::size_t r = 0; r < model["merges"].size(); ++r) {
    const auto& m = model["merges"][r];
    rank.emplace(m.is_array() ? m[0].get<std::string>() + " " + m[1].get<std::string>()
                              : m.get<std::string>(),
                 static_cast<int>(r));
  }
  std::vector<std::string> symbols;
  for (char c : piece) symbols.emplace_back(1, c);  // ASCII letters map to themselves
  while (symbols.size() > 1) {
    int best = -1;
    std::size_t at = 0;
    for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
      if (auto it = rank.find(symbols[i] + " " + symbols[i + 1]);
          it != rank.end() && (best < 0 || it->second < best))
        best = it->second, at = i;
    if (best < 0) break;
    symbols[at] += symbols[at + 1];
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  std::vector<std::int32_t> ids;
  for (const auto& symbol : symbols) ids.push_back(model["vocab"][symbol].get<std::int32_t>());
  return ids;
}

TEST(Tokenizer, LongPiecesMergeAsTheRuleSays) {
  const auto file = kTokenizerFixtures / "gpt2.tokenizer.json";
  const auto json = nlohmann::json::parse(test::read_file(file));
  const auto tokenizer = open_tokenizer_json(file);
  std::mt19937 rng(5);
  const std::string letters = "thequickbrownfoxjumpsoverlazydgaeiou";
  std::vector<std::string> pieces{std::string(5000, 'a'), std::string(4001, 'e')};
  for (int n : {1, 2, 7, 300, 3000}) {
    std::string piece;
    for (int i = 0; i < n; ++i) piece += letters[rng() % letters.size()];
    pieces.push_back(piece);
  }
  for (const auto& piece : pieces) {
    const auto ids = tokenizer->encode(piece);
    EXPECT_EQ(ids, quadratic_bpe(json["model"], piece)) << piece.substr(0, 40);
    EXPECT_EQ(tokenizer->decode(ids), piece);
  }
}

// An added token past the model's embedding (16,777,000 for 1,000 rows crashed the forward):
// refused when the tokenizer is found for that model, with both numbers.
TEST(Tokenizer, IdsPastTheEmbeddingAreRefusedAtLoad) {
  test::TempDir dir;
  auto json = nlohmann::json::parse(test::read_file(kTokenizerFixtures / "gpt2.tokenizer.json"));
  json["added_tokens"].push_back({{"id", 16777000},
                                  {"content", "<|far|>"},
                                  {"single_word", false},
                                  {"lstrip", false},
                                  {"rstrip", false},
                                  {"normalized", false},
                                  {"special", true}});
  test::write_file(dir / "tokenizer.json", json.dump());
  EXPECT_NE(find_tokenizer(dir.path()).tokenizer, nullptr);  // no model to hold it to
  test::expect_error_containing(
      [&] { find_tokenizer(dir.path(), 1001); },
      {dir.path().string(), "ids go up to 16777000 (its vocabulary)", "embedding has 1001 rows"});
  json["added_tokens"].back()["id"] = 1000;  // the last row of a 1,001-row embedding
  test::write_file(dir / "tokenizer.json", json.dump());
  EXPECT_EQ(find_tokenizer(dir.path(), 1001).tokenizer->vocab_size(), 1001);
}

TEST(Tokenizer, BosComesFromThePostProcessorOrTheGgufFlag) {
  const auto json = open_tokenizer_json(kTokenizerFixtures / "llama3.tokenizer.json");
  const auto gguf = find_tokenizer(kTokenizerFixtures / "llama3.gguf").tokenizer;
  for (const Tokenizer* t : {json.get(), gguf.get()}) {
    EXPECT_TRUE(t->adds_bos());
    EXPECT_EQ(t->bos_id(), t->token_id("<|begin_of_text|>"));
    const auto prompt = t->encode_prompt("Hello");
    ASSERT_EQ(prompt.size(), t->encode("Hello").size() + 1);
    EXPECT_EQ(prompt[0], *t->bos_id());
  }
  const auto smollm = open_tokenizer_json(kTokenizerFixtures / "smollm.tokenizer.json");
  EXPECT_FALSE(smollm->adds_bos());
  EXPECT_EQ(smollm->encode_prompt("Hello"), smollm->encode("Hello"));
}

TEST(Tokenizer, AddedTokensAreMatchedInTheText) {
  const auto t = open_tokenizer_json(kTokenizerFixtures / "smollm.tokenizer.json");
  const auto ids = t->encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), *t->token_id("<|im_start|>"));
  EXPECT_EQ(ids.back(), *t->token_id("<|im_end|>"));
  EXPECT_EQ(t->decode(ids), "<|im_start|>user\nhi<|im_end|>");
}

TEST(Tokenizer, InvalidUtf8IsAClearError) {
  const auto t = open_tokenizer_json(kTokenizerFixtures / "gpt2.tokenizer.json");
  test::expect_error_containing([&] { t->encode("ok \xC3\x28 bad"); },
                                {"not valid UTF-8", "byte 3"});
  test::expect_error_containing([&] { t->encode("\xED\xA0\x80"); }, {"byte 0"});  // surrogate
}

TEST(Tokenizer, UnknownIdsDecodeVisibly) {
  const auto t = open_tokenizer_json(kTokenizerFixtures / "gpt2.tokenizer.json");
  std::vector<std::int32_t> ids = t->encode("Hello");
  ids.push_back(123456);
  ids.push_back(-1);
  EXPECT_EQ(t->decode(ids), "Hello<id:123456><id:-1>");
}

TEST(Tokenizer, StreamingHoldsBackSplitCharacters) {
  const auto t = open_tokenizer_json(kTokenizerFixtures / "gpt2.tokenizer.json");
  const std::string text = "emoji \U0001F600 caf\u00e9 \u4f60\u597d";
  const auto ids = t->encode(text);
  StreamingDecoder stream(*t);
  std::string streamed;
  int pieces = 0;
  for (std::int32_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_EQ(valid_utf8_prefix(piece), piece.size()) << "a split character was emitted";
    pieces += piece.empty() ? 0 : 1;
    streamed += piece;
  }
  streamed += stream.finish();
  EXPECT_EQ(streamed, text);
  EXPECT_GT(pieces, 3);  // it streamed, not everything at the end
  EXPECT_LT(static_cast<std::size_t>(pieces), ids.size());  // the emoji's bytes waited
}

// Malformed tokenizer.json files: every one is a kvlab::Error naming the file and the part.
struct BadTokenizerJson {
  const char* name;
  std::function<void(nlohmann::json&)> edit;
  const char* expected;
};

TEST(Tokenizer, MalformedTokenizerJsonIsAClearError) {
  const nlohmann::json good =
      nlohmann::json::parse(test::read_file(kTokenizerFixtures / "llama3.tokenizer.json"));
  const std::vector<BadTokenizerJson> cases = {
      {"wordpiece", [](auto& j) { j["model"]["type"] = "WordPiece"; }, "model.type"},
      {"byte_fallback", [](auto& j) { j["model"]["byte_fallback"] = true; }, "tokenizer.model"},
      {"no vocab", [](auto& j) { j["model"].erase("vocab"); }, "no \"vocab\""},
      {"bad merge", [](auto& j) { j["model"]["merges"][0] = nlohmann::json::array({"x"}); },
       "neither"},
      {"merge out of vocab",
       [](auto& j) {
         j["model"]["merges"][0] = nlohmann::json::array({"zzz", "qqq"});
       },
       "not in the vocabulary"},
      {"duplicate id", [](auto& j) { j["model"]["vocab"]["zzz"] = 5; }, "gives id 5"},
      {"huge id", [](auto& j) { j["model"]["vocab"]["zzz"] = 1LL << 40; }, "not a token id"},
      {"bad regex",
       [](auto& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
       "regex"},
      {"split removed",
       [](auto& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "only Isolated"},
      {"metaspace",
       [](auto& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}};
       },
       "Metaspace"},
      {"no byte level", [](auto& j) { j["pre_tokenizer"] = nullptr; }, "no ByteLevel"},
      {"lowercase",
       [](auto& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       },
       "Lowercase"},
      {"added without id", [](auto& j) { j["added_tokens"][0].erase("id"); }, "no \"id\""},
      {"single word", [](auto& j) { j["added_tokens"][0]["single_word"] = true; }, "single_word"},
      {"post two bos",
       [](auto& j) {
         auto& single = j["post_processor"]["single"];
         single.insert(single.begin(), single[0]);
       },
       "more than one"},
  };
  for (const auto& c : cases) {
    test::TempDir dir;
    nlohmann::json edited = good;
    c.edit(edited);
    test::write_file(dir / "tokenizer.json", edited.dump());
    test::expect_error_containing([&] { find_tokenizer(dir.path()); },
                                  {"tokenizer.json", c.expected});
  }
  test::TempDir dir;
  test::write_file(dir / "tokenizer.json", "{ not json");
  test::expect_error_containing([&] { find_tokenizer(dir.path()); },
                                {"not a valid tokenizer.json"});
}

TEST(Tokenizer, GgufWithAnUnknownPreTokenizerIsAClearError) {
  // The same file with tokenizer.ggml.pre renamed: the string has the same length, so only
  // its bytes change.
  std::string bytes = test::read_file(kTokenizerFixtures / "qwen2.gguf");
  const auto at = bytes.find("qwen2");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "zzzzz");
  test::TempDir dir;
  test::write_file(dir / "odd.gguf", bytes);
  test::expect_error_containing([&] { find_tokenizer(dir / "odd.gguf"); },
                                {"tokenizer.ggml.pre \"zzzzz\"", "llama-bpe"});
}

}  // namespace
}  // namespace kvlab

namespace kvlab {
namespace {

// SmolLM2's template, as its GGUF carries it.
constexpr const char* kSmolLm2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}";

TEST(ChatTemplate, ChatMlWithTheTemplatesDefaultSystemMessage) {
  const ChatTemplate chat = ChatTemplate::detect(kSmolLm2Template, "test");
  EXPECT_EQ(chat.format(), ChatFormat::chatml);
  EXPECT_EQ(chat.default_system(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  const auto t = open_tokenizer_json(kTokenizerFixtures / "smollm.tokenizer.json");
  const std::vector<ChatMessage> user = {{"user", "Hi there"}};
  EXPECT_EQ(t->decode(chat.render(user, *t)),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n");
  const std::vector<ChatMessage> with_system = {{"system", "Be brief."}, {"user", "Hi"}};
  const auto ids = chat.render(with_system, *t);
  EXPECT_EQ(t->decode(ids),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(ids.front(), *t->token_id("<|im_start|>"));  // a special token, not its spelling
  EXPECT_EQ(chat.end_of_turn(*t), *t->token_id("<|im_end|>"));
}

TEST(ChatTemplate, QwenStyleTemplateWithEscapesAndAnExpression) {
  // Qwen2's template writes the system message from messages[0] when there is one, and a
  // default literal (with a Jinja \n escape) otherwise.
  const std::string qwen =
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
      "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are "
      "a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
  const ChatTemplate chat = ChatTemplate::detect(qwen, "test");
  EXPECT_EQ(chat.format(), ChatFormat::chatml);
  EXPECT_EQ(chat.default_system(), "You are a helpful assistant.");
}

// A template that uses ChatML's tokens in another layout would be rendered wrongly as ChatML:
// refused, naming what the standard layout has and it lacks.
TEST(ChatTemplate, ChatMlTokensInAnotherLayoutAreRefused) {
  test::expect_error_containing(
      [] {
        ChatTemplate::detect(
            "{{ '<|im_start|>' + message['role'] + ': ' + message['content'] }}"
            "{{ '<|im_start|>bot: ' }}",
            "odd.gguf");
      },
      {"odd.gguf", "looks like ChatML but lacks \"<|im_end|>\""});
  test::expect_error_containing(
      [] {
        ChatTemplate::detect(
            "{{ '<|im_start|>' + role + content + '<|im_end|>' }}{{ "
            "'<|im_start|>assistant: ' }}",
            "odd.gguf");
      },
      {"lacks \"<|im_start|>assistant\" and a newline"});
  test::expect_error_containing(
      [] { ChatTemplate::detect("{{ '<|start_header_id|>' + role }}", "x"); },
      {"looks like Llama-3 but lacks \"<|end_header_id|>\""});
}

TEST(ChatTemplate, InvalidUtf8IsNamedInItsMessage) {
  const ChatTemplate chat = ChatTemplate::detect(kSmolLm2Template, "smollm2");
  const auto t = open_tokenizer_json(kTokenizerFixtures / "smollm.tokenizer.json");
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "caf\xC3"}};
  test::expect_error_containing([&] { chat.render(messages, *t); },
                                {"chat message 2 (user): its text is not valid UTF-8 at byte 3"});
}

TEST(ChatTemplate, Llama2RendersInstBlocksWithBos) {
  test::TempDir dir;
  train_sentencepiece(dir);
  const auto t = find_tokenizer(dir.path()).tokenizer;
  const ChatTemplate chat =
      ChatTemplate::detect("{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}", "test");
  EXPECT_EQ(chat.format(), ChatFormat::llama2);
  const std::vector<ChatMessage> messages = {{"system", "be kind"}, {"user", "the cat"}};
  const auto ids = chat.render(messages, *t);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), *t->bos_id());
  const auto body = t->encode("[INST] <<SYS>>\nbe kind\n<</SYS>>\n\nthe cat [/INST]");
  EXPECT_EQ(std::vector<std::int32_t>(ids.begin() + 1, ids.end()), body);
  EXPECT_EQ(chat.end_of_turn(*t), *t->eos_id());
}

TEST(ChatTemplate, Llama3NeedsItsHeaderTokens) {
  const ChatTemplate chat = ChatTemplate::detect(
      "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
      "message['content'] + '<|eot_id|>' }}",
      "test");
  EXPECT_EQ(chat.format(), ChatFormat::llama3);
  // The small llama3 fixture has <|begin_of_text|> but no header tokens: a clear error.
  const auto t = open_tokenizer_json(kTokenizerFixtures / "llama3.tokenizer.json");
  const std::vector<ChatMessage> user = {{"user", "Hi"}};
  test::expect_error_containing([&] { chat.render(user, *t); },
                                {"special token <|start_header_id|>"});
}

TEST(ChatTemplate, AnUnknownTemplateIsAClearError) {
  test::expect_error_containing(
      [] { ChatTemplate::detect("{% for m in messages %}### {{ m.content }}{% endfor %}", "M"); },
      {"M: the chat template is not ChatML, Llama-3 or Llama-2", "--prompt"});
  test::expect_error_containing([] { ChatTemplate::detect("", "M"); },
                                {"M has no chat template", "--prompt"});
}

// A GGUF of tokenizer.ggml.model "llama" (tests/fixtures/gguf/make_spm_fixture.py): SentencePiece
// BPE by score (pieces 259.. are ▁ a b ▁a ab ▁ab c), no space prefix, bytes for what no piece
// covers, BOS first from encode_prompt.
TEST(GgufTokenizer, SentencePieceMergesByScoreAndFallsBackToBytes) {
  const TokenizerLookup lookup = find_tokenizer(std::filesystem::path(KVLAB_FIXTURES_DIR) / "gguf" /
                                                "tokenizer_sentencepiece.gguf");
  ASSERT_NE(lookup.tokenizer, nullptr) << lookup.why_not;
  const Tokenizer& t = *lookup.tokenizer;
  // "ab a" = a b ▁ a: ▁a (-0.5) merges before ab (-0.7); ab▁a is no piece.
  EXPECT_EQ(t.encode("ab a"), (std::vector<std::int32_t>{263, 262}));
  EXPECT_EQ(t.encode(" ab"), (std::vector<std::int32_t>{264}));  // no prefix added: ▁ab
  // é (C3 A9) and d are no piece: their bytes, <0xC3> <0xA9> <0x64>, ids 3 + byte.
  EXPECT_EQ(t.encode("éd"), (std::vector<std::int32_t>{3 + 0xC3, 3 + 0xA9, 3 + 0x64}));
  EXPECT_EQ(t.decode(t.encode("ab a éd c")), "ab a éd c");
  EXPECT_EQ(t.encode_prompt("c"), (std::vector<std::int32_t>{1, 265}));
  EXPECT_EQ(t.vocab_size(), 266);
  EXPECT_EQ(t.token_id("\u2581ab"), 264);
}

}  // namespace
}  // namespace kvlab
