// kvlab generate: prompt ids in, generated ids (and text, log-probabilities) out, computed by
// the full-recompute reference.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli_common.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/tokenizer.hpp"

namespace kvlab::cli {
namespace {

struct GenerateOptions {
  std::string model;
  std::string preset;
  std::uint64_t weights_seed = 0;
  std::string prompt_ids;
  std::string prompt_text;
  bool use_prompt_ids = true;
  SamplingParams sampling;
  std::int32_t logprobs = 0;
  bool json = false;
  int threads = 0;
};

void run_generate(const GenerateOptions& o) {
  validate_sampling_params(o.sampling);
  if (o.logprobs < 0) throw Error(fmt::format("--logprobs must be >= 0, got {}", o.logprobs));
  if (o.threads < 0)
    throw Error(fmt::format("--threads must be >= 0 (0 = all cores), got {}", o.threads));
  if (o.threads > 0) cpu::set_num_threads(o.threads);

  const ModelSource source = resolve_model(o.model.empty() ? o.preset : o.model);
  if (!o.preset.empty() && !source.is_preset())
    throw Error(
        fmt::format("--preset takes a preset name; \"{}\" is a folder (use --model)", o.preset));
  std::optional<Tokenizer> tokenizer;
  if (!source.is_preset()) tokenizer = Tokenizer::open_if_present(source.directory);

  std::vector<std::int32_t> prompt;
  if (o.use_prompt_ids) {
    prompt = parse_token_ids(o.prompt_ids);
  } else {
    if (!tokenizer)
      throw Error(fmt::format(
          "--prompt needs a tokenizer.model in the model folder; {} has none: use --prompt-ids",
          source.is_preset() ? "a preset" : source.directory.string()));
    prompt = tokenizer->encode(o.prompt_text);
    prompt.insert(prompt.begin(), source.config.bos_token_id);
  }
  for (std::size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] >= source.config.vocab_size)
      throw Error(
          fmt::format("prompt token id {} (item {}) is outside the vocabulary of {} [0, {})",
                      prompt[i], i, source.config.name, source.config.vocab_size));
  if (static_cast<std::int64_t>(prompt.size()) >= source.config.max_position_embeddings)
    throw Error(fmt::format(
        "prompt of {} tokens leaves no room to generate in the context of {} ({} positions)",
        prompt.size(), source.config.name, source.config.max_position_embeddings));

  const auto load_start = std::chrono::steady_clock::now();
  cpu::ReferenceModel model(source.is_preset()
                                ? cpu::random_llama_weights(source.config, o.weights_seed)
                                : cpu::load_llama_weights(source.directory));
  const auto start = std::chrono::steady_clock::now();
  const cpu::GenerationResult result = cpu::generate(model, prompt, o.sampling, o.logprobs);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double load_seconds = std::chrono::duration<double>(start - load_start).count();

  std::vector<std::int32_t> ids;
  for (const auto& t : result.tokens) ids.push_back(t.token);
  auto piece = [&](std::int32_t id) {
    return tokenizer ? tokenizer->decode(std::span(&id, 1)) : std::string();
  };

  if (o.json) {
    for (std::size_t i = 0; i < result.tokens.size(); ++i) {
      const auto& t = result.tokens[i];
      nlohmann::json line = {{"index", i},
                             {"position", prompt.size() + i},
                             {"token", t.token},
                             {"logprob", t.logprob}};
      if (tokenizer) line["text"] = piece(t.token);
      if (o.logprobs > 0) {
        auto& top = line["top_logprobs"] = nlohmann::json::array();
        for (const auto& alt : t.top)
          top.push_back({{"token", alt.token}, {"logprob", alt.logprob}});
      }
      fmt::print("{}\n", line.dump());
    }
  } else {
    fmt::print("prompt:    [{}]\n", fmt::join(prompt, ", "));
    fmt::print("generated: [{}]\n", fmt::join(ids, ", "));
    if (tokenizer) fmt::print("text:      {}\n", tokenizer->decode(ids));
    if (o.logprobs > 0) {
      fmt::print("\n{:>5}  {:>7}  {:>9}  top-{} (token:logprob)\n", "index", "token", "logprob",
                 o.logprobs);
      for (std::size_t i = 0; i < result.tokens.size(); ++i) {
        const auto& t = result.tokens[i];
        std::string alternatives;
        for (const auto& alt : t.top)
          alternatives += fmt::format(" {}:{:.4f}", alt.token, alt.logprob);
        fmt::print("{:>5}  {:>7}  {:>9.4f} {}\n", i, t.token, t.logprob, alternatives);
      }
    }
  }
  fmt::print(stderr,
             "{}: {} tokens, finish={}, {:.2f} s ({:.1f} tok/s, full recompute, {} threads; load "
             "{:.2f} s)\n",
             source.config.name, result.tokens.size(),
             cpu::finish_reason_name(result.finish_reason), seconds,
             static_cast<double>(result.tokens.size()) / seconds, cpu::num_threads(), load_seconds);
}

}  // namespace

void register_generate(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  auto* sub =
      app.add_subcommand("generate", "Generate tokens with the full-recompute CPU reference");
  auto* model = sub->add_option("--model", options->model,
                                "Model folder (config.json + safetensors) or preset name");
  auto* preset = sub->add_option("--preset", options->preset,
                                 "Built-in preset with random weights (see --weights-seed)");
  model->excludes(preset);
  preset->excludes(model);
  sub->add_option("--weights-seed", options->weights_seed, "Seed of a preset's random weights")
      ->capture_default_str();
  auto* ids = sub->add_option("--prompt-ids", options->prompt_ids,
                              "Prompt token ids, comma-separated: 1,2,3");
  auto* text = sub->add_option("--prompt", options->prompt_text,
                               "Prompt text (needs tokenizer.model in the model folder)");
  ids->excludes(text);
  text->excludes(ids);
  sub->add_option("--max-tokens", options->sampling.max_tokens, "Tokens to generate at most")
      ->capture_default_str();
  sub->add_option("--temperature", options->sampling.temperature, "0 = greedy")
      ->capture_default_str();
  sub->add_option("--top-k", options->sampling.top_k, "Keep the k most likely tokens (0 = off)")
      ->capture_default_str();
  sub->add_option("--top-p", options->sampling.top_p, "Nucleus mass (1 = off)")
      ->capture_default_str();
  sub->add_option("--seed", options->sampling.seed, "Sampling seed of this request")
      ->capture_default_str();
  sub->add_flag("--ignore-eos", options->sampling.ignore_eos, "Do not stop at EOS");
  sub->add_option("--logprobs", options->logprobs,
                  "Also print the top-K log-probabilities of every position");
  sub->add_flag("--json", options->json, "One JSON object per generated position");
  sub->add_option("--threads", options->threads, "CPU threads (0 = all cores)")
      ->capture_default_str();
  sub->callback([options, model, preset, ids, text]() {
    if (model->count() == 0 && preset->count() == 0)
      throw CLI::RequiredError("--model or --preset");
    if (ids->count() == 0 && text->count() == 0)
      throw CLI::RequiredError("--prompt-ids or --prompt");
    options->use_prompt_ids = ids->count() > 0;
    run_generate(*options);
  });
}

}  // namespace kvlab::cli
