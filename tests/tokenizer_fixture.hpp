#pragma once
// The tokenizer fixtures of tests/fixtures/tokenizer (made by make_fixtures.py with Hugging Face
// `tokenizers`): each line names a text (a prompt of data/prompts, or an extra case that
// carries its own text) and the ids `tokenizers` gives it.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvlab::test {

// Every prompt a fixture may name, by source key ("mt_bench:81:0", "vicuna:1:0", "gsm8k:17"),
// read from the prompt sets under `data_dir` (data/prompts: scripts/get_data.sh prompts).
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
  return texts;
}

struct FixtureCase {
  std::string source;
  std::vector<std::int32_t> ids;
  std::optional<std::string> text;  // the extra cases' own text

  const std::string& text_in(const std::map<std::string, std::string>& prompts) const {
    return text ? *text : prompts.at(source);
  }
};

inline std::vector<FixtureCase> fixture_cases(const std::filesystem::path& ids_jsonl) {
  std::ifstream in(ids_jsonl);
  if (!in) throw std::runtime_error("cannot read " + ids_jsonl.string());
  std::vector<FixtureCase> cases;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    FixtureCase c{j["source"].get<std::string>(), j["ids"].get<std::vector<std::int32_t>>(), {}};
    if (j.contains("text")) c.text = j["text"].get<std::string>();
    cases.push_back(std::move(c));
  }
  return cases;
}

}  // namespace kvlab::test
