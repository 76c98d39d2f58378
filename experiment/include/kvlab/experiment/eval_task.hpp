#pragma once
// kvlab eval's retrieval tasks, built as RULER builds its synthetic ones (Hsieh et al., 2024,
// "RULER: What's the Real Context Size of Your Long-Context Language Models?"): filler text
// (WikiText-2) of a given length in tokens with a key hidden at a given depth, then a question
// that asks for it; an answer is right when it contains the key (RULER's string match).
//   passkey: "The pass key is 68204. Remember it. 68204 is the pass key." (Mohtashami and
//            Jaggi, 2023), asked "What is the pass key? The pass key is".
//   needle:  "One of the special magic numbers for <word> is: 4711583." (RULER's niah_single),
//            asked for <word>'s number.
// The prompts end with the question, so a policy that compresses the prompt once with its last
// tokens as the observation window (snapkv one_shot) sees the question when it chooses.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/experiment/experiment.hpp"
#include "kvlab/model/tokenizer.hpp"

namespace kvlab {

struct EvalPrompt {
  std::string text;         // the whole prompt (the tokenizer adds its BOS)
  std::string key;          // what the answer must contain
  std::int64_t length = 0;  // the grid's length (tokens) ...
  double depth = 0;         // ... and depth
  std::int64_t tokens = 0;  // the prompt's tokens as the tokenizer encodes it (BOS included)
};

// samples prompts per (length, depth) of `spec`, length-major, their filler from `filler` at
// offsets and keys drawn from `seed`. Throws kvlab::Error when a length leaves no room for
// filler beside the task's own text, or when the filler text is too short.
std::vector<EvalPrompt> make_eval_prompts(const EvalSpec& spec, std::string_view filler,
                                          const Tokenizer& tokenizer, std::uint64_t seed);

// The prompts of c's [eval] through its model's tokenizer (keys and filler offsets from c.seed),
// also written to `file` as a prompt set (JSONL) the engine reads. Throws kvlab::Error for a
// preset (no tokenizer), a missing filler file, or as make_eval_prompts.
std::vector<EvalPrompt> write_eval_prompts(const ExperimentConfig& c,
                                           const std::filesystem::path& file);

// c serving the prompt set `file` as kvlab eval does: the prompts all at once, as raw text (the
// task's own wording; no chat template), each answer cut at [eval] answer_tokens; the file's
// own workload is replaced.
ExperimentConfig eval_serving_config(ExperimentConfig c, const std::filesystem::path& file);

// RULER's string match: the answer contains the key.
bool eval_answer_correct(std::string_view answer, std::string_view key);

// One cell of the length x depth grid.
struct EvalCell {
  std::int64_t length = 0;
  double depth = 0;
  std::int64_t prompts = 0, correct = 0;
  double accuracy() const {
    return prompts == 0 ? 0 : static_cast<double>(correct) / static_cast<double>(prompts);
  }
};

// The grid's cells (length-major, as the prompts) scored from each prompt's answer.
std::vector<EvalCell> score_eval(const EvalSpec& spec, const std::vector<EvalPrompt>& prompts,
                                 const std::vector<std::string>& answers);

}  // namespace kvlab
