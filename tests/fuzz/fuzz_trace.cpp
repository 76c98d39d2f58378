// libFuzzer: every workload source that reads a file (kvlab/workload/formats.hpp: the Mooncake
// trace, the Azure trace, kvlab's CSV and JSONL, prompt sets), and speculation's accept trace
// CSV. The first input byte picks which, modulo 2 x the file sources + 1: each source read from
// a .csv, then each from a .jsonl, then the accept trace. Every source's recognizes() sees every
// input. A new row of the table is fuzzed with no change here.
#include <string_view>
#include <vector>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/speculation/speculation.hpp"
#include "kvlab/workload/formats.hpp"

namespace {

std::vector<const kvlab::WorkloadFormat*> file_sources() {
  std::vector<const kvlab::WorkloadFormat*> sources;
  for (const kvlab::WorkloadFormat& format : kvlab::workload_formats())
    if (std::string_view(format.name) != "synthetic") sources.push_back(&format);
  return sources;
}

// Bounded as a run would be: a small vocabulary and context, at most 1000 requests, and a
// Mooncake trace's lengths scaled down (2^24 / 64 tokens a prompt at most).
kvlab::WorkloadInput bounded_input(const std::filesystem::path& file,
                                   const kvlab::WorkloadFormat& format) {
  kvlab::WorkloadInput input;
  input.file = file;
  input.vocab_size = 512;
  input.context = 2048;
  input.window.max_requests = 1000;
  if (std::string_view(format.name) == "mooncake") input.window.length_scale = 1.0 / 64;
  input.synthetic.requests = 1000;
  input.encode = [](const std::string& text) {
    std::vector<std::int32_t> ids;
    for (const char c : text) ids.push_back(static_cast<unsigned char>(c) % 512);
    return ids;
  };
  return input;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::vector<const kvlab::WorkloadFormat*> sources = file_sources();
  if (size == 0) return 0;
  const std::size_t n = sources.size(), choice = data[0] % (2 * n + 1);
  const auto path = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data + 1, size - 1),
                                             choice >= n && choice < 2 * n ? ".jsonl" : ".csv");
  try {
    for (const kvlab::WorkloadFormat* format : sources)
      if (format->recognizes != nullptr) (void)format->recognizes(path);
    if (choice == 2 * n) {
      (void)kvlab::load_accept_trace(path);
    } else {
      const kvlab::WorkloadFormat& format = *sources[choice % n];
      (void)format.load(bounded_input(path, format));
    }
  } catch (const kvlab::Error&) {
  }
  return 0;
}
