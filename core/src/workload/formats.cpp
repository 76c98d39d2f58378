#include "kvlab/workload/formats.hpp"

#include <fmt/format.h>

#include <array>

#include "kvlab/error.hpp"
#include "sources.hpp"

namespace kvlab {
namespace {

// Sniffed in this order: the formats with a header or fields of their own before kvlab's
// (any .csv or .jsonl file).
constexpr std::array kFormats = {
    WorkloadFormat{"synthetic", "requests drawn from [workload]'s arrival process and lengths",
                   nullptr, detail::load_synthetic_source},
    WorkloadFormat{"mooncake",
                   "a Mooncake FAST'25 trace (JSONL: timestamp, input_length, output_length, "
                   "hash_ids)",
                   is_mooncake_trace, detail::load_mooncake_source},
    WorkloadFormat{"azure",
                   "the Azure LLM inference trace 2023 (CSV: TIMESTAMP, ContextTokens, "
                   "GeneratedTokens)",
                   detail::is_azure_trace, detail::load_azure_source},
    WorkloadFormat{"kvlab",
                   "kvlab's trace (CSV with a header, or JSONL: arrival_s, prompt_len or "
                   "prompt_ids, output_len, priority, tenant)",
                   detail::is_kvlab_trace, detail::load_kvlab_source},
    WorkloadFormat{"prompts",
                   "a prompt set (JSONL: \"turns\"[0], \"question\", \"prompt\" or \"text\"), "
                   "answers ending at EOS",
                   nullptr, detail::load_prompt_source},
};

}  // namespace

std::span<const WorkloadFormat> workload_formats() {
  return kFormats;
}

const WorkloadFormat& workload_format(std::string_view name) {
  std::string names;
  for (const WorkloadFormat& format : kFormats) {
    if (format.name == name) return format;
    names += std::string(names.empty() ? "" : ", ") + format.name;
  }
  throw Error(fmt::format("unknown workload source \"{}\" (there are: {})", name, names));
}

const WorkloadFormat& trace_format(const std::filesystem::path& file) {
  for (const WorkloadFormat& format : kFormats)
    if (format.recognizes != nullptr && format.recognizes(file)) return format;
  throw Error(fmt::format(
      "trace {}: not a trace kvlab reads (a Mooncake JSONL trace, the Azure trace's CSV, or "
      "kvlab's .csv or .jsonl)",
      file.string()));
}

}  // namespace kvlab
