#include "kvlab/experiment/eval_task.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/model_source.hpp"

namespace kvlab {
namespace {

// A task's text around the filler, for one key.
struct TaskText {
  std::string header, needle, question, key;
};

TaskText task_text(const std::string& task, std::mt19937_64& rng) {
  static constexpr std::array<const char*, 16> kWords = {
      "guitar", "river",  "lantern", "orchid",  "falcon",  "harbor", "violet", "compass",
      "meadow", "copper", "glacier", "saffron", "thimble", "walnut", "beacon", "quartz"};
  TaskText t;
  if (task == "passkey") {
    t.key = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
    t.header =
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
        "it. I will quiz you about the important information there.\n\n";
    t.needle = fmt::format(" The pass key is {0}. Remember it. {0} is the pass key. ", t.key);
    t.question = "\n\nWhat is the pass key? The pass key is";
  } else {
    t.key = std::to_string(std::uniform_int_distribution<int>(1000000, 9999999)(rng));
    const char* word =
        kWords[std::uniform_int_distribution<std::size_t>(0, kWords.size() - 1)(rng)];
    t.header =
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the numbers afterwards.\n";
    t.needle = fmt::format(" One of the special magic numbers for {} is: {}. ", word, t.key);
    t.question = fmt::format(
        "\nWhat is the special magic number for {0} mentioned in the provided text? The special "
        "magic number for {0} mentioned in the provided text is",
        word);
  }
  return t;
}

// `tokens` tokens of filler from a random line start of `filler`.
std::vector<std::int32_t> filler_tokens(std::string_view filler, std::int64_t tokens,
                                        const Tokenizer& tokenizer, std::mt19937_64& rng) {
  const auto chars = static_cast<std::size_t>(tokens) * 8 + 256;  // well over a token's text
  if (filler.size() < 2 * chars)
    throw Error(fmt::format(
        "the eval filler has {} characters: {} filler tokens need about {} (use WikiText-2's "
        "test or train text)",
        filler.size(), tokens, 2 * chars));
  std::size_t start = std::uniform_int_distribution<std::size_t>(0, filler.size() - chars - 1)(rng);
  start = filler.find('\n', start);  // from a line's start
  start = start == std::string_view::npos ? 0 : start + 1;
  std::vector<std::int32_t> ids = tokenizer.encode(filler.substr(start, chars));
  if (static_cast<std::int64_t>(ids.size()) < tokens)
    throw Error(
        fmt::format("the eval filler gave {} tokens where {} were needed", ids.size(), tokens));
  ids.resize(static_cast<std::size_t>(tokens));
  return ids;
}

}  // namespace

std::vector<EvalPrompt> make_eval_prompts(const EvalSpec& spec, std::string_view filler,
                                          const Tokenizer& tokenizer, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<EvalPrompt> prompts;
  for (const std::int64_t length : spec.lengths)
    for (const double depth : spec.depths)
      for (std::int64_t s = 0; s < spec.samples; ++s) {
        const TaskText t = task_text(spec.task, rng);
        const auto own = static_cast<std::int64_t>(
            tokenizer.encode_prompt(t.header + t.needle + t.question).size());
        if (length - own < 16)
          throw Error(fmt::format(
              "eval length {} leaves no room for filler: the {} task's own text takes {} tokens",
              length, spec.task, own));
        const std::vector<std::int32_t> ids = filler_tokens(filler, length - own, tokenizer, rng);
        const auto cut =
            static_cast<std::size_t>(std::llround(depth * static_cast<double>(ids.size())));
        const std::span<const std::int32_t> all(ids);
        EvalPrompt p;
        p.text = t.header + tokenizer.decode(all.first(cut)) + t.needle +
                 tokenizer.decode(all.subspan(cut)) + t.question;
        p.key = t.key;
        p.length = length;
        p.depth = depth;
        p.tokens = static_cast<std::int64_t>(tokenizer.encode_prompt(p.text).size());
        prompts.push_back(std::move(p));
      }
  return prompts;
}

std::vector<EvalPrompt> write_eval_prompts(const ExperimentConfig& c,
                                           const std::filesystem::path& file) {
  const ModelSource source = resolve_model(c.model);
  if (source.is_preset())
    throw Error(
        fmt::format("kvlab eval needs a model with a tokenizer, not the preset \"{}\"", c.model));
  const TokenizerLookup lookup = find_tokenizer(source.directory, source.config.vocab_size);
  if (!lookup.tokenizer)
    throw Error(fmt::format("kvlab eval needs a tokenizer: {}", lookup.why_not));
  std::ifstream in(c.eval.filler, std::ios::binary);
  if (!in)
    throw Error(fmt::format("cannot read the eval filler {}{}", c.eval.filler,
                            data_set_hint(c.eval.filler)));
  const std::string filler((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<EvalPrompt> prompts = make_eval_prompts(c.eval, filler, *lookup.tokenizer, c.seed);
  std::ofstream out(file);
  for (const EvalPrompt& p : prompts) out << nlohmann::json{{"prompt", p.text}}.dump() << '\n';
  if (!out) throw Error(fmt::format("cannot write {}", file.string()));
  return prompts;
}

ExperimentConfig eval_serving_config(ExperimentConfig c, const std::filesystem::path& file) {
  c.prompt_set = file.string();
  c.prompt_chat = false;
  c.prompt_max_tokens = c.eval.answer_tokens;
  c.prompt_requests = 0;
  c.trace.clear();
  c.azure_trace.clear();
  c.workload.arrival = {};  // all at once
  c.workload_keys_given.clear();
  return c;
}

bool eval_answer_correct(std::string_view answer, std::string_view key) {
  return !key.empty() && answer.find(key) != std::string_view::npos;
}

std::vector<EvalCell> score_eval(const EvalSpec& spec, const std::vector<EvalPrompt>& prompts,
                                 const std::vector<std::string>& answers) {
  if (answers.size() != prompts.size())
    throw Error(fmt::format("eval: {} answers for {} prompts", answers.size(), prompts.size()));
  std::vector<EvalCell> cells;
  for (const std::int64_t length : spec.lengths)
    for (const double depth : spec.depths) cells.push_back({length, depth, 0, 0});
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    EvalCell& cell = cells[i / static_cast<std::size_t>(spec.samples)];
    ++cell.prompts;
    cell.correct += eval_answer_correct(answers[i], prompts[i].key);
  }
  return cells;
}

}  // namespace kvlab
