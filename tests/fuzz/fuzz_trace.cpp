// libFuzzer: workload traces, CSV and JSONL (the first input byte picks the format).
#include "fuzz_input_file.hpp"
#include "kvlab/engine/workload.hpp"
#include "kvlab/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool jsonl = (data[0] & 1) != 0;
  const auto path =
      kvlab::fuzz::write_input(kvlab::fuzz::as_text(data + 1, size - 1), jsonl ? ".jsonl" : ".csv");
  try {
    kvlab::TraceOptions options;
    options.vocab_size = 512;
    (void)kvlab::load_trace(path, options);
  } catch (const kvlab::Error&) {
  }
  return 0;
}
