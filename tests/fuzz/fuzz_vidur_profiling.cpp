// libFuzzer: Vidur's profiling CSV files (kvlab calibrate --vidur). The input is up to three
// files split at lines of "===": an mlp.csv, an attention_excerpt.csv and an all_reduce.csv,
// laid out as Vidur's folders. Data that loads must also be priced, every measurement sanely.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/sim/vidur_fit.hpp"

namespace {

namespace fs = std::filesystem;

void write(const fs::path& file, std::string_view text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary | std::ios::trunc)
      .write(text.data(), static_cast<std::streamsize>(text.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text = kvlab::fuzz::as_text(data, size);
  const fs::path root =
      fs::temp_directory_path() / ("kvlab_fuzz_vidur_" + std::to_string(getpid()));
  std::error_code ec;
  fs::remove_all(root, ec);
  const fs::path model = root / "compute" / "a100" / "org" / "m";
  const fs::path files[] = {model / "mlp.csv", model / "attention_excerpt.csv",
                            root / "network" / "a100_dgx" / "all_reduce.csv"};
  std::size_t begin = 0;
  for (const fs::path& file : files) {
    if (begin > text.size()) break;
    const std::size_t end = text.find("\n===\n", begin);
    write(file, text.substr(begin, end == std::string_view::npos ? text.npos : end - begin));
    begin = end == std::string_view::npos ? text.size() + 1 : end + 5;
  }
  try {
    const kvlab::VidurData vidur = kvlab::load_vidur_data(root, "a100");
    kvlab::HardwareProfile p;
    p.name = "fuzz";
    p.peak_tflops = 312;
    p.memory_gb_per_s = 2039;
    p.memory_gib = 80;
    p.allreduce_gb_per_s = 240;
    p.allreduce_latency_s = 8e-6;
    for (const kvlab::VidurPoint& point : kvlab::vidur_validation(vidur, p, {{"m"}, "m"}))
      if (!(point.predicted_s >= 0) || !std::isfinite(point.measured_s)) std::abort();
  } catch (const kvlab::Error&) {
  }
  return 0;
}
