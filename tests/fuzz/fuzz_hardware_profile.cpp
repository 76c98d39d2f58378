// libFuzzer: hardware profile files (TOML: device peaks, efficiencies, kernel regimes,
// overheads, memory, the swap link). A profile that loads must also price steps and swaps, and
// round-trip through hardware_profile_to_toml.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto file = kvlab::fuzz::write_input(kvlab::fuzz::as_text(data, size), ".toml");
  try {
    const kvlab::HardwareProfile profile = kvlab::load_hardware_profile_file(file);
    const kvlab::CostModel cost(kvlab::model_preset("stories15m"), profile);
    const std::vector<kvlab::EntryShape> step{{16, 0, 0}, {1, 40, 0}};
    const std::vector<kvlab::EntryShape> decodes(9, {1, 40, 0});  // past the usual regime rows
    const double seconds =
        cost.step(step).total() + cost.step(decodes).total() + cost.swap_seconds(1 << 20, 2);
    if (std::isnan(seconds) || seconds < 0) std::abort();  // a loaded profile prices sanely
    (void)cost.kv_capacity_tokens();
    const auto again = kvlab::fuzz::write_input(kvlab::hardware_profile_to_toml(profile), ".toml");
    const kvlab::HardwareProfile reloaded = kvlab::load_hardware_profile_file(again);
    if (reloaded.swap_gb_per_s != profile.swap_gb_per_s ||
        reloaded.gemm_regimes.size() != profile.gemm_regimes.size() ||
        reloaded.decode_attention_regimes.size() != profile.decode_attention_regimes.size())
      std::abort();
  } catch (const kvlab::Error&) {
  }
  return 0;
}
