// Stage 2 (the requests): a trace, the Azure trace, a prompt set through the model's tokenizer
// and chat template, or the synthetic workload.
#include <fmt/format.h>

#include <filesystem>

#include "kvlab/error.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/model/chat_template.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

// A prompt set's requests: each text through the model's tokenizer, and its chat template
// when the experiment asks for one (workload.prompts.chat).
RealWorkload prompt_requests(const ExperimentConfig& c, const ModelConfig& model,
                             std::unique_ptr<Tokenizer>& tokenizer_out) {
  const ModelSource source = resolve_model(c.model);
  if (source.is_preset())
    throw Error(
        fmt::format("workload.prompts needs a real model with a tokenizer; \"{}\" is a "
                    "preset (random weights, no tokenizer)",
                    c.model));
  TokenizerLookup lookup = find_tokenizer(source.directory, model.vocab_size);
  if (!lookup.tokenizer) throw Error(fmt::format("workload.prompts: {}", lookup.why_not));
  const Tokenizer& tokenizer = *lookup.tokenizer;
  std::optional<ChatTemplate> chat;
  if (c.prompt_chat) chat = ChatTemplate::detect(lookup.chat_template, source.directory.string());
  PromptSetOptions options;
  options.requests = c.prompt_requests;
  options.max_tokens = c.prompt_max_tokens;
  options.context = model.max_position_embeddings;
  options.arrival = c.workload.arrival;
  options.seed = c.seed;
  options.sampling = workload_sampling(c.workload);
  auto encode = [&](const std::string& text) {
    if (!chat) return tokenizer.encode_prompt(text);
    const std::vector<ChatMessage> messages = {{"user", text}};
    return chat->render(messages, tokenizer);
  };
  RealWorkload workload = prompt_set_workload(load_prompt_texts(c.prompt_set), encode, options);
  tokenizer_out = std::move(lookup.tokenizer);
  return workload;
}

// A recorded trace's replay options (window, scales: from the file) with what the run decides:
// the model's context and vocabulary, the seed, the workload's sampling.
template <typename TraceReplayOptions>
TraceReplayOptions for_run(TraceReplayOptions options, const ExperimentConfig& c,
                           const ModelConfig& model) {
  options.context = model.max_position_embeddings;
  options.vocab_size = model.vocab_size;
  options.seed = c.seed;
  options.sampling = workload_sampling(c.workload);
  return options;
}

// The trace, the Azure trace, the prompt set, or the synthetic workload; greedy everywhere for
// `check`.
RealWorkload make_requests(const ExperimentConfig& c, const ModelConfig& model, bool check,
                           std::unique_ptr<Tokenizer>& tokenizer) {
  RealWorkload w;
  if (!c.trace.empty() && is_mooncake_trace(c.trace)) {
    w = load_mooncake_trace(c.trace, for_run(c.replay, c, model));
  } else if (!c.trace.empty()) {
    if (c.replay_given)
      throw Error(
          fmt::format("[workload.replay] is for a Mooncake trace (rows with hash_ids); {} "
                      "is kvlab's own trace format",
                      c.trace));
    TraceOptions options;
    options.vocab_size = model.vocab_size;
    options.seed = c.seed;
    options.sampling = workload_sampling(c.workload);
    options.sampling.ignore_eos = c.workload.ignore_eos;
    w.requests = load_trace(c.trace, options);
  } else if (!c.azure_trace.empty()) {
    w = load_azure_trace(c.azure_trace, for_run(c.azure, c, model));
  } else if (!c.prompt_set.empty()) {
    w = prompt_requests(c, model, tokenizer);
  } else {
    SyntheticWorkload spec = c.workload;
    spec.vocab_size = model.vocab_size;
    w.requests = generate_workload(spec);
  }
  check_arrival_times(w.requests, !c.trace.empty()         ? c.trace
                                  : !c.azure_trace.empty() ? c.azure_trace
                                  : !c.prompt_set.empty()  ? std::string("workload.prompts")
                                                           : "the workload's arrival process");
  assign_tenants(w.requests, c.tenants, c.slo, c.seed);
  if (check)
    for (auto& r : w.requests) r.sampling.temperature = 0;  // check compares greedy tokens
  return w;
}

}  // namespace

// make_requests, with running out of memory reported as the workload's: which input, how big.
RealWorkload make_requests_or_say_why(const ExperimentConfig& c, const ModelConfig& model,
                                      bool check, std::unique_ptr<Tokenizer>& tokenizer) {
  try {
    return make_requests(c, model, check, tokenizer);
  } catch (const std::bad_alloc&) {
    const std::string file = !c.trace.empty() ? c.trace : c.azure_trace;
    std::error_code ec;
    throw Error(
        file.empty()
            ? fmt::format("out of memory making the workload: workload.requests {} (prompts of "
                          "up to {} tokens); lower them",
                          c.workload.requests, c.workload.prompt_tokens.max)
            : fmt::format(
                  "out of memory reading the trace {} ({:.1f} MiB): replay a part of it "
                  "(workload.requests, [workload.replay] duration_s or length_scale, or the "
                  "Azure trace's duration_s)",
                  file, static_cast<double>(std::filesystem::file_size(file, ec)) / (1 << 20)));
  }
}

}  // namespace kvlab
