// kvlab generate: a prompt (ids, raw text, or a chat message rendered with the model's chat
// template) in; generated ids, text (streamed as it comes with --chat / --stream) and
// log-probabilities out, computed by the full-recompute reference or by the engine with a KV
// cache (--compute).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli_common.hpp"
#include "kvlab/cpu_reference/batch_generator.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/model/tokenizer.hpp"

namespace kvlab::cli {
namespace {

struct GenerateOptions {
  std::string model;
  std::string preset;
  std::uint64_t weights_seed = 0;
  std::string prompt_ids;
  std::string prompt_text;
  std::string chat;
  std::string system;
  bool has_system = false;
  bool has_chat = false;          // --chat was given (an empty message is a message)
  bool max_tokens_given = false;  // --max-tokens was given (else a chat answers up to its stop)
  SamplingParams sampling;
  std::int32_t logprobs = 0;
  bool json = false;
  bool stream = false;
  std::string compute;  // "reference" | "engine"; empty: engine with --chat, else reference
  std::string weights = "stored";   // the engine's weight format (cpu::select_compute_weights)
  std::string activations = "f32";  // q8/bf16: reduced-precision activations (ActivationFormat)
  int threads = 0;
};

// The prompt the options ask for, and the token that ends a chat answer (when --chat).
struct Prompt {
  std::vector<std::int32_t> ids;
  std::optional<std::int32_t> end_of_turn;
};

Prompt build_prompt(const GenerateOptions& o, const ModelSource& source,
                    const TokenizerLookup& lookup) {
  if (!o.prompt_ids.empty()) return {parse_token_ids(o.prompt_ids), std::nullopt};
  if (!lookup.tokenizer)
    throw Error(fmt::format("{} needs the model's tokenizer: {}; use --prompt-ids",
                            o.has_chat ? "--chat" : "--prompt",
                            source.is_preset() ? "a preset has none" : lookup.why_not));
  if (!o.has_chat) return {lookup.tokenizer->encode_prompt(o.prompt_text), std::nullopt};
  const ChatTemplate chat = ChatTemplate::detect(lookup.chat_template, source.directory.string());
  std::vector<ChatMessage> messages;
  if (o.has_system) messages.push_back({"system", o.system});
  messages.push_back({"user", o.chat});
  return {chat.render(messages, *lookup.tokenizer), chat.end_of_turn(*lookup.tokenizer)};
}

void check_prompt(const std::vector<std::int32_t>& prompt, const ModelConfig& config) {
  for (std::size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] >= config.vocab_size)
      throw Error(
          fmt::format("prompt token id {} (item {}) is outside the vocabulary of {} [0, {})",
                      prompt[i], i, config.name, config.vocab_size));
  if (prompt.empty()) throw Error("the prompt is empty: nothing to generate from");
  if (static_cast<std::int64_t>(prompt.size()) >= config.max_position_embeddings)
    throw Error(fmt::format(
        "prompt of {} tokens leaves no room to generate in the context of {} ({} positions)",
        prompt.size(), config.name, config.max_position_embeddings));
}

void print_json(const cpu::GenerationResult& result, std::size_t prompt_size,
                const Tokenizer* tokenizer, std::int32_t logprobs) {
  for (std::size_t i = 0; i < result.tokens.size(); ++i) {
    const auto& t = result.tokens[i];
    nlohmann::json line = {
        {"index", i}, {"position", prompt_size + i}, {"token", t.token}, {"logprob", t.logprob}};
    if (tokenizer) line["text"] = tokenizer->decode(std::span(&t.token, 1));
    if (logprobs > 0) {
      auto& top = line["top_logprobs"] = nlohmann::json::array();
      for (const auto& alt : t.top) top.push_back({{"token", alt.token}, {"logprob", alt.logprob}});
    }
    fmt::print("{}\n", line.dump());
  }
}

void print_table(const cpu::GenerationResult& result, const std::vector<std::int32_t>& prompt,
                 const Tokenizer* tokenizer, std::int32_t logprobs) {
  std::vector<std::int32_t> ids;
  for (const auto& t : result.tokens) ids.push_back(t.token);
  fmt::print("prompt:    [{}]\n", fmt::join(prompt, ", "));
  fmt::print("generated: [{}]\n", fmt::join(ids, ", "));
  if (tokenizer) fmt::print("text:      {}\n", tokenizer->decode(ids));
  if (logprobs <= 0) return;
  fmt::print("\n{:>5}  {:>7}  {:>9}  top-{} (token:logprob)\n", "index", "token", "logprob",
             logprobs);
  for (std::size_t i = 0; i < result.tokens.size(); ++i) {
    const auto& t = result.tokens[i];
    std::string alternatives;
    for (const auto& alt : t.top) alternatives += fmt::format(" {}:{:.4f}", alt.token, alt.logprob);
    fmt::print("{:>5}  {:>7}  {:>9.4f} {}\n", i, t.token, t.logprob, alternatives);
  }
}

using TokenCallback = std::function<void(std::int32_t)>;

// Prints text to the terminal as tokens arrive; the stop token itself is not shown.
TokenCallback streamer(StreamingDecoder& decoder, const ModelConfig& config,
                       const SamplingParams& sampling) {
  return [&decoder, &config, &sampling](std::int32_t token) {
    if (!sampling.ignore_eos && config.is_eos(token)) return;
    fmt::print("{}", decoder.push(token));
    std::fflush(stdout);
  };
}

// The same generation through the engine: a paged KV cache and the batched CPU backend (the
// tokens kvlab check holds equal to the reference's), with the engine's logprobs (computed as
// each token is picked; no row of logits is kept).
cpu::GenerationResult generate_with_engine(const cpu::LlamaWeights& weights,
                                           const GenerateOptions& o, const ModelSource& source,
                                           const std::vector<std::int32_t>& prompt,
                                           const TokenCallback& on_token,
                                           const std::function<void()>& on_start) {
  SamplingParams sampling = o.sampling;
  sampling.logprobs = o.logprobs;  // the chosen token's always; the top o.logprobs when > 0
  const PluginRegistry registry(PluginRegistry::default_search_path());
  cpu::BatchSetup setup;  // paged blocks of 16, the checkpoint's own K/V heads
  setup.weights = o.weights;
  setup.activations = o.activations;
  setup.source = source.directory;
  const auto needed = static_cast<std::int64_t>(prompt.size()) + sampling.max_tokens;
  setup.pool_slots = std::min(needed, weights.config.max_position_embeddings) / 16 * 16 + 16;
  cpu::BatchGenerator generator(weights, registry, setup);
  cpu::BatchOptions options;
  if (on_token) options.on_token = [&](std::size_t, std::int32_t token) { on_token(token); };
  on_start();  // the engine is set up (plugins loaded, pool allocated): generation starts
  const cpu::BatchResult batch = generator.run({{prompt, sampling, 0}}, options).front();
  cpu::GenerationResult result;
  result.finish_reason = batch.finish_reason;
  if (batch.logprobs.size() != batch.tokens.size())
    throw Error(fmt::format("the engine returned {} logprobs for {} tokens", batch.logprobs.size(),
                            batch.tokens.size()));
  for (std::size_t i = 0; i < batch.tokens.size(); ++i) {
    GeneratedLogprobs chosen = batch.logprobs[i];
    result.tokens.push_back({batch.tokens[i], chosen.logprob, std::move(chosen.top)});
  }
  return result;
}

// Options that need no model: sampling, --logprobs, --threads.
void check_options(const GenerateOptions& o) {
  validate_sampling_params(o.sampling);
  if (o.logprobs < 0) throw Error(fmt::format("--logprobs must be >= 0, got {}", o.logprobs));
  if (o.threads < 0)
    throw Error(fmt::format("--threads must be >= 0 (0 = all cores), got {}", o.threads));
}

// Whether the engine computes (--compute engine, or a chat by default), with the options only
// it takes checked.
bool uses_engine(const GenerateOptions& o) {
  const bool engine = o.compute == "engine" || (o.compute.empty() && o.has_chat);
  if (!engine && o.weights != "stored")
    throw Error(fmt::format("--weights {} needs --compute engine: the reference computes in fp32",
                            o.weights));
  if (!engine && o.activations != "f32")
    throw Error(fmt::format(
        "--activations {} needs --compute engine: the reference computes in fp32", o.activations));
  if (engine && o.logprobs > kMaxLogprobs)
    throw Error(
        fmt::format("--logprobs {}: the engine returns at most {} (vLLM's max_logprobs); --compute "
                    "reference returns any number",
                    o.logprobs, kMaxLogprobs));
  return engine;
}

// The weights to generate with: a preset's random ones or the folder's; a chat answer also ends
// at its end-of-turn token.
cpu::LlamaWeights generation_weights(const GenerateOptions& o, const ModelSource& source,
                                     const Prompt& prompt) {
  cpu::LlamaWeights weights = source.is_preset()
                                  ? cpu::random_llama_weights(source.config, o.weights_seed)
                                  : cpu::load_llama_weights(source.directory);
  auto& eos = weights.config.eos_token_ids;
  if (prompt.end_of_turn && std::find(eos.begin(), eos.end(), *prompt.end_of_turn) == eos.end())
    eos.push_back(*prompt.end_of_turn);
  return weights;
}

// A chat answer runs to the model's own stop: without --max-tokens its cap is kChatMaxTokens or
// what the context leaves, whichever is less (the sampling default, 16, would cut it short).
constexpr std::int32_t kChatMaxTokens = 2048;

void cap_chat_answer(GenerateOptions& o, std::int64_t prompt_tokens, const ModelConfig& config) {
  if (!o.has_chat || o.max_tokens_given) return;
  const std::int64_t room = config.max_position_embeddings - prompt_tokens;
  o.sampling.max_tokens =
      static_cast<std::int32_t>(std::clamp<std::int64_t>(room, 1, kChatMaxTokens));
}

// llama.cpp's two lines: the prompt's rate up to the first token (its time to first token),
// then the decode rate of the tokens after it.
void print_rates(std::size_t prompt_tokens, std::size_t generated, double first_token_s,
                 double seconds) {
  fmt::print(stderr, "prompt: {} tokens in {:.3f} s ({:.1f} tok/s; time to first token)\n",
             prompt_tokens, first_token_s, static_cast<double>(prompt_tokens) / first_token_s);
  if (generated > 1)
    fmt::print(stderr, "decode: {} tokens in {:.3f} s ({:.1f} tok/s)\n", generated - 1,
               seconds - first_token_s,
               static_cast<double>(generated - 1) / (seconds - first_token_s));
}

void run_generate(GenerateOptions o) {
  check_options(o);
  if (o.threads > 0) cpu::set_num_threads(o.threads);
  const ModelSource source = resolve_model(o.model.empty() ? o.preset : o.model);
  if (!o.preset.empty() && !source.is_preset())
    throw Error(
        fmt::format("--preset takes a preset name; \"{}\" is a folder (use --model)", o.preset));
  TokenizerLookup lookup;
  if (!source.is_preset()) lookup = find_tokenizer(source.directory, source.config.vocab_size);
  const Tokenizer* tokenizer = lookup.tokenizer.get();
  const Prompt prompt = build_prompt(o, source, lookup);
  check_prompt(prompt.ids, source.config);
  const bool engine = uses_engine(o);
  cap_chat_answer(o, static_cast<std::int64_t>(prompt.ids.size()), source.config);
  const auto load_start = std::chrono::steady_clock::now();
  cpu::LlamaWeights weights = generation_weights(o, source, prompt);
  const ModelConfig config = weights.config;
  const bool streaming = tokenizer && !o.json && (o.stream || o.has_chat);
  std::optional<StreamingDecoder> decoder;
  if (streaming) decoder.emplace(*tokenizer);
  const TokenCallback show = streaming ? streamer(*decoder, config, o.sampling) : nullptr;
  auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> first_token;
  const TokenCallback on_token = [&](std::int32_t token) {
    if (!first_token) first_token = std::chrono::steady_clock::now();
    if (show) show(token);
  };
  const cpu::GenerationResult result =
      engine ? generate_with_engine(weights, o, source, prompt.ids, on_token,
                                    [&] { start = std::chrono::steady_clock::now(); })
             : cpu::generate(cpu::ReferenceModel(std::move(weights)), prompt.ids, o.sampling,
                             o.logprobs, [&](const cpu::GeneratedToken& t) {
                               if (on_token) on_token(t.token);
                             });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double load_seconds = std::chrono::duration<double>(start - load_start).count();
  const double first_token_s =
      first_token ? std::chrono::duration<double>(*first_token - start).count() : seconds;

  if (streaming)
    fmt::print("{}\n", decoder->finish());
  else if (o.json)
    print_json(result, prompt.ids.size(), tokenizer, o.logprobs);
  else
    print_table(result, prompt.ids, tokenizer, o.logprobs);
  std::fflush(stdout);
  fmt::print(stderr,
             "{}: {} prompt tokens, {} generated, finish={}, {:.2f} s ({:.1f} tok/s, {}, {} "
             "threads; load {:.2f} s)\n",
             source.config.name, prompt.ids.size(), result.tokens.size(),
             cpu::finish_reason_name(result.finish_reason), seconds,
             static_cast<double>(result.tokens.size()) / seconds,
             engine ? "engine with a paged KV cache" : "full recompute", cpu::num_threads(),
             load_seconds);
  print_rates(prompt.ids.size(), result.tokens.size(), first_token_s, seconds);
}

}  // namespace

void register_generate(CLI::App& app) {
  auto options = std::make_shared<GenerateOptions>();
  auto* sub =
      app.add_subcommand("generate", "Generate tokens with the full-recompute CPU reference");
  auto* model = sub->add_option("--model", options->model,
                                "Model: a folder (config.json + safetensors), a .gguf file, or a "
                                "preset name");
  auto* preset = sub->add_option("--preset", options->preset,
                                 "Built-in preset with random weights (see --weights-seed)");
  model->excludes(preset);
  preset->excludes(model);
  sub->add_option("--weights-seed", options->weights_seed, "Seed of a preset's random weights")
      ->capture_default_str();
  auto* ids = sub->add_option("--prompt-ids", options->prompt_ids,
                              "Prompt token ids, comma-separated: 1,2,3");
  auto* text = sub->add_option("--prompt", options->prompt_text,
                               "Prompt text, as it is (needs the model's tokenizer)");
  auto* chat = sub->add_option("--chat", options->chat,
                               "A user message, rendered with the model's chat template (ChatML, "
                               "Llama-3, Llama-2); the answer streams to the terminal");
  auto* system = sub->add_option("--system", options->system,
                                 "With --chat: the system message (replaces the template's "
                                 "default)");
  system->needs(chat);
  for (auto* a : {ids, text, chat})
    for (auto* b : {ids, text, chat})
      if (a != b) a->excludes(b);
  auto* max_tokens = sub->add_option("--max-tokens", options->sampling.max_tokens,
                                     "Tokens to generate at most (with --chat: until the model's "
                                     "own stop, at most 2048 or what the context leaves)");
  max_tokens->capture_default_str();
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
  sub->add_flag("--stream", options->stream,
                "Print the text as it is generated (the default with --chat)");
  sub->add_option("--compute", options->compute,
                  "reference: the full-recompute reference (the truth, O(S^2)); engine: the "
                  "engine with a paged KV cache (same tokens, much faster). Default: engine "
                  "with --chat, else reference")
      ->check(CLI::IsMember({"reference", "engine"}));
  auto* weights = sub->add_option(
      "--weights", options->weights,
      "With --compute engine: the format the engine multiplies in: stored (a GGUF file's own "
      "types; f32 otherwise), f32, f16, bf16, q8_0, q4_0, q4_1");
  weights->capture_default_str()->check(CLI::IsMember(
      std::vector<std::string>(cpu::kWeightChoices.begin(), cpu::kWeightChoices.end())));
  sub->add_option("--activations", options->activations,
                  "With --compute engine: f32; q8 (Q4/Q8 weights multiplied with activations "
                  "rounded to 8-bit blocks) or bf16 (bf16 weights with bf16 activations), as "
                  "llama.cpp does: faster, no longer the reference's function")
      ->capture_default_str()
      ->check(CLI::IsMember(std::vector<std::string>(cpu::kActivationChoices.begin(),
                                                     cpu::kActivationChoices.end())));
  sub->add_option("--threads", options->threads, "CPU threads (0 = all cores)")
      ->capture_default_str();
  sub->callback([options, model, preset, ids, text, chat, system, max_tokens]() {
    if (model->count() == 0 && preset->count() == 0)
      throw CLI::RequiredError("--model or --preset");
    if (ids->count() == 0 && text->count() == 0 && chat->count() == 0)
      throw CLI::RequiredError("--prompt-ids, --prompt or --chat");
    if (ids->count() > 0 && options->prompt_ids.empty())
      throw Error("--prompt-ids is empty: give at least one token id");
    options->has_system = system->count() > 0;
    options->has_chat = chat->count() > 0;
    options->max_tokens_given = max_tokens->count() > 0;
    run_generate(*options);
  });
}

}  // namespace kvlab::cli
