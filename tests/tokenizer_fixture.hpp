#pragma once
// The tokenizer fixtures of tests/fixtures/tokenizer (made by make_fixtures.py with Hugging Face
// `tokenizers`): each line names a text (a prompt of data/prompts, or one of kExtraTexts) and
// the ids `tokenizers` gives it.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvlab::test {

// Kept identical to EXTRA_TEXTS in tests/fixtures/tokenizer/make_fixtures.py.
inline const std::vector<std::string> kExtraTexts = {
    "",
    "Hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "I'VE, you're, they'll, she'd, it's, DON'T",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1,000,000",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "cafe\u0301 (combining accent)",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u3053\u3093\u306b\u3061\u306f",
    "emoji \U0001F600\U0001F680 and \u2764\ufe0f",
    "code: def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "punctuation!!! ??? ... --- ((nested)) [brackets] {braces}",
    "\u0410\u0411\u0412 \u0433\u0434\u0435 \u03b1\u03b2\u03b3",
    "call <tool_call>{\"name\": \"f\"}</tool_call> done",
};

// Every text a fixture may name, by source key ("mt_bench:81:0", "vicuna:1:0", "gsm8k:17",
// "extra:3"), read from the vendored prompt sets under `data_dir` (data/prompts).
inline std::map<std::string, std::string> fixture_texts(const std::filesystem::path& data_dir) {
  std::map<std::string, std::string> texts;
  auto lines = [](const std::filesystem::path& file) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file.string());
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
  };
  for (const auto& [name, file] : {std::pair{"mt_bench", "mt_bench_questions.jsonl"},
                                   std::pair{"vicuna", "vicuna_bench_questions.jsonl"}})
    for (const auto& q : lines(data_dir / file))
      for (std::size_t turn = 0; turn < q["turns"].size(); ++turn)
        texts[std::string(name) + ":" + std::to_string(q["question_id"].get<int>()) + ":" +
              std::to_string(turn)] = q["turns"][turn].get<std::string>();
  const auto gsm8k = lines(data_dir / "gsm8k_test.jsonl");
  for (std::size_t i = 0; i < gsm8k.size(); ++i)
    texts["gsm8k:" + std::to_string(i)] = gsm8k[i]["question"].get<std::string>();
  for (std::size_t i = 0; i < kExtraTexts.size(); ++i)
    texts["extra:" + std::to_string(i)] = kExtraTexts[i];
  return texts;
}

struct FixtureCase {
  std::string source;
  std::vector<std::int32_t> ids;
};

inline std::vector<FixtureCase> fixture_cases(const std::filesystem::path& ids_jsonl) {
  std::ifstream in(ids_jsonl);
  if (!in) throw std::runtime_error("cannot read " + ids_jsonl.string());
  std::vector<FixtureCase> cases;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    cases.push_back({j["source"].get<std::string>(), j["ids"].get<std::vector<std::int32_t>>()});
  }
  return cases;
}

}  // namespace kvlab::test
