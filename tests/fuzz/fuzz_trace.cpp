// libFuzzer: workload traces: kvlab's CSV and JSONL, the Azure LLM inference trace CSV, and
// prompt-set JSONL (the first input byte picks which).
#include "fuzz_input_file.hpp"
#include "kvlab/engine/real_workloads.hpp"
#include "kvlab/engine/workload.hpp"
#include "kvlab/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int kind = data[0] % 4;
  const auto path = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data + 1, size - 1),
                                             kind == 1 || kind == 3 ? ".jsonl" : ".csv");
  try {
    if (kind <= 1) {
      kvlab::TraceOptions options;
      options.vocab_size = 512;
      (void)kvlab::load_trace(path, options);
    } else if (kind == 2) {
      kvlab::AzureTraceOptions options;
      options.vocab_size = 512;
      options.context = 2048;
      options.max_requests = 1000;
      (void)kvlab::load_azure_trace(path, options);
    } else {
      (void)kvlab::load_prompt_texts(path);
    }
  } catch (const kvlab::Error&) {
  }
  return 0;
}
