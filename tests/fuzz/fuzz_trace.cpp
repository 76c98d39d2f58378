// libFuzzer: workload traces: kvlab's CSV and JSONL, the Azure LLM inference trace CSV,
// prompt-set JSONL, the Mooncake trace JSONL and speculation's accept trace CSV (the first input
// byte picks which: 4 is Mooncake, 5 the accept trace, any other byte modulo 4 the rest).
#include "fuzz_input_file.hpp"
#include "kvlab/engine/real_workloads.hpp"
#include "kvlab/engine/workload.hpp"
#include "kvlab/error.hpp"
#include "kvlab/speculation/speculation.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int kind = data[0] == 4 || data[0] == 5 ? data[0] : data[0] % 4;
  const auto path =
      kvlab::fuzz::write_input(kvlab::fuzz::as_text(data + 1, size - 1),
                               (kind % 2 == 1 && kind != 5) || kind == 4 ? ".jsonl" : ".csv");
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
    } else if (kind == 3) {
      (void)kvlab::load_prompt_texts(path);
    } else if (kind == 5) {
      (void)kvlab::load_accept_trace(path);
    } else {
      kvlab::MooncakeTraceOptions options;
      options.vocab_size = 512;
      options.context = 2048;
      options.max_requests = 1000;
      options.length_scale = 1.0 / 64;  // bounded prompts: 2^24 / 64 tokens at most
      (void)kvlab::is_mooncake_trace(path);
      (void)kvlab::load_mooncake_trace(path, options);
    }
  } catch (const kvlab::Error&) {
  }
  return 0;
}
