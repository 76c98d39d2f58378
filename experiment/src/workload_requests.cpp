// Stage 2 (the requests): a trace, the Azure trace, a prompt set through the model's tokenizer
// and chat template, or the synthetic workload, each a row of the workload sources' table
// (kvlab/workload/formats.hpp).
#include <fmt/format.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <string_view>

#include "kvlab/error.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/workload/formats.hpp"
#include "stages.hpp"

namespace kvlab {
namespace {

// A prompt set's encoder: each text through the model's tokenizer, and its chat template when
// the experiment asks for one (workload.prompts.chat). The tokenizer is kept in `tokenizer`.
std::function<std::vector<std::int32_t>(const std::string&)> prompt_encoder(
    const ExperimentConfig& c, const ModelConfig& model, std::unique_ptr<Tokenizer>& tokenizer) {
  const ModelSource source = resolve_model(c.model);
  if (source.is_preset())
    throw Error(
        fmt::format("workload.prompts needs a real model with a tokenizer; \"{}\" is a "
                    "preset (random weights, no tokenizer)",
                    c.model));
  TokenizerLookup lookup = find_tokenizer(source.directory, model.vocab_size);
  if (!lookup.tokenizer) throw Error(fmt::format("workload.prompts: {}", lookup.why_not));
  tokenizer = std::move(lookup.tokenizer);
  std::optional<ChatTemplate> chat;
  if (c.prompt_chat) chat = ChatTemplate::detect(lookup.chat_template, source.directory.string());
  return [&tokenizer = *tokenizer, chat](const std::string& text) {
    if (!chat) return tokenizer.encode_prompt(text);
    const std::vector<ChatMessage> messages = {{"user", text}};
    return chat->render(messages, tokenizer);
  };
}

// Which source reads the requests (kvlab/workload/formats.hpp), and what it reads: the trace (its
// format told by the file), the Azure trace, the prompt set, or the synthetic workload.
const WorkloadFormat& source_of(const ExperimentConfig& c, WorkloadInput& input) {
  if (!c.trace.empty()) {
    input.file = c.trace;
    const WorkloadFormat& format = trace_format(c.trace);
    if (c.replay_given && std::string_view(format.name) != "mooncake")
      throw Error(
          fmt::format("[workload.replay] is for a Mooncake trace (rows with hash_ids); {} "
                      "is {}",
                      c.trace, format.what));
    input.window = c.replay;
    return format;
  }
  if (!c.azure_trace.empty()) {
    input.file = c.azure_trace;
    input.window = c.azure;
    return workload_format("azure");
  }
  if (!c.prompt_set.empty()) {
    input.file = c.prompt_set;
    return workload_format("prompts");
  }
  return workload_format("synthetic");
}

// The requests of the experiment's source; greedy everywhere for `check`.
RealWorkload make_requests(const ExperimentConfig& c, const ModelConfig& model, bool check,
                           std::unique_ptr<Tokenizer>& tokenizer) {
  WorkloadInput input;
  const WorkloadFormat& format = source_of(c, input);
  input.synthetic = c.workload;
  input.context = model.max_position_embeddings;
  input.vocab_size = model.vocab_size;
  input.seed = c.seed;
  input.sampling = workload_sampling(c.workload);
  input.prompt_requests = c.prompt_requests;
  input.prompt_max_tokens = c.prompt_max_tokens;
  if (std::string_view(format.name) == "prompts")
    input.encode = prompt_encoder(c, model, tokenizer);
  RealWorkload w = format.load(input);
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
