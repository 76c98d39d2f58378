// Prompt sets (data/prompts: MT-Bench, Vicuna bench, GSM8K): each prompt's text through the
// model's tokenizer (and chat template); answers end at EOS, or at a cap.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "kvlab/data_sets.hpp"
#include "kvlab/error.hpp"
#include "kvlab/workload/real_workloads.hpp"
#include "replay.hpp"
#include "sources.hpp"

namespace kvlab {

std::vector<std::string> load_prompt_texts(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(
        fmt::format("cannot read prompt set {}{}", path.string(), data_set_hint(path.string())));
  std::vector<std::string> texts;
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto fail = [&](const std::string& why) {
      return Error(fmt::format("{}:{}: {}", path.string(), line_number, why));
    };
    nlohmann::json object;
    try {
      object = detail::parse_json_object(line);
    } catch (const Error& e) {
      throw fail(e.what());
    }
    const nlohmann::json* text = nullptr;
    if (object.contains("turns") && object["turns"].is_array() && !object["turns"].empty())
      text = &object["turns"][0];
    for (const char* key : {"question", "prompt", "text"})
      if (text == nullptr && object.contains(key)) text = &object[key];
    if (text == nullptr || !text->is_string() || text->get<std::string>().empty())
      throw fail("no prompt text (\"turns\"[0], \"question\", \"prompt\" or \"text\")");
    texts.push_back(text->get<std::string>());
  }
  if (texts.empty()) throw Error(fmt::format("prompt set {} holds no prompts", path.string()));
  return texts;
}

RealWorkload prompt_set_workload(
    const std::vector<std::string>& texts,
    const std::function<std::vector<std::int32_t>(const std::string&)>& encode,
    const PromptSetOptions& o) {
  if (texts.empty()) throw Error("the prompt set is empty");
  if (o.requests < 0 || o.max_tokens < 1)
    throw Error(fmt::format("prompt set: requests must be >= 0 and max_tokens >= 1, got {} and {}",
                            o.requests, o.max_tokens));
  const std::int64_t count = o.requests > 0 ? o.requests : static_cast<std::int64_t>(texts.size());
  const std::vector<double> arrivals = arrival_times(o.arrival, count, o.seed);
  RealWorkload out;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::size_t which = static_cast<std::size_t>(i) % texts.size();
    WorkloadRequest r;
    r.id = i;
    r.arrival_s = arrivals[static_cast<std::size_t>(i)];
    r.prompt = encode(texts[which]);
    const auto prompt = static_cast<std::int64_t>(r.prompt.size());
    if (prompt < 1 || (o.context > 0 && prompt >= o.context))
      throw Error(
          fmt::format("prompt {} (\"{:.40}...\") is {} tokens: no room to answer in the "
                      "{}-token context",
                      which, texts[which], prompt, o.context));
    std::int64_t kept_prompt = prompt, cap = o.max_tokens;  // the prompt fits: only cap is cut
    out.clipped += detail::clip_to_context(kept_prompt, cap, o.context);
    r.output_tokens = cap;
    r.sampling = o.sampling;
    r.sampling.max_tokens = static_cast<std::int32_t>(cap);
    r.sampling.ignore_eos = false;
    r.sampling.seed = o.seed * 1000003ULL + static_cast<std::uint64_t>(i);
    out.requests.push_back(std::move(r));
    out.prompt_texts.push_back(texts[which]);
  }
  out.description = fmt::format(
      "{} prompts of a {}-prompt set, answers end at EOS or {} tokens "
      "({} caps cut to the context)",
      count, texts.size(), o.max_tokens, out.clipped);
  return out;
}

namespace detail {

RealWorkload load_prompt_source(const WorkloadInput& input) {
  if (!input.encode)
    throw Error(
        fmt::format("prompt set {}: no tokenizer to encode its texts", input.file.string()));
  PromptSetOptions options;
  options.requests = input.prompt_requests;
  options.max_tokens = input.prompt_max_tokens;
  options.context = input.context;
  options.arrival = input.synthetic.arrival;
  options.seed = input.seed;
  options.sampling = input.sampling;
  return prompt_set_workload(load_prompt_texts(input.file), input.encode, options);
}

}  // namespace detail

}  // namespace kvlab
