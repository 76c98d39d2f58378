// libFuzzer: the safetensors reader (header length, JSON header, dtypes, shapes, offsets).
// Every input must end in a file or one kvlab::Error; anything else (a crash, a sanitizer
// report, another exception) is a finding.
#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data, size), ".safetensors");
  try {
    const auto file = kvlab::SafetensorsFile::open(path);
    for (const auto& tensor : file.tensors()) {
      const auto bytes = file.bytes(tensor);  // must lie inside the mapping
      volatile std::size_t sink = bytes.empty() ? 0 : std::to_integer<std::size_t>(bytes.back());
      (void)sink;
    }
  } catch (const kvlab::Error&) {
  }
  return 0;
}
