// libFuzzer: a step's shape as text (kvlab cost --step, kvlab/sim/step_spec.hpp). A step that
// parses must be priced operator by operator, and the operators must add up to the step
// (CostModel::breakdown): never NaN, negative, or apart by more than a rounding.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kvlab/error.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/sim/cost_model.hpp"
#include "kvlab/sim/hardware_profile.hpp"
#include "kvlab/sim/step_spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const kvlab::CostModel cost(kvlab::model_preset("stories15m"),
                                     kvlab::load_hardware_profile("h200"), 2);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<kvlab::EntryShape> step;
  try {
    step = kvlab::parse_step_spec(text);
  } catch (const kvlab::Error&) {
    return 0;  // refused with a message: fine
  }
  if (step.empty() || step.size() > static_cast<std::size_t>(kvlab::kMaxStepSequences))
    std::abort();
  const kvlab::StepBreakdown b = cost.breakdown(step);
  double sum = 0;
  for (const kvlab::OperatorCost& op : b.operators) {
    if (!(op.seconds >= 0) || op.runs < 0) std::abort();
    sum += op.seconds * static_cast<double>(op.runs);
  }
  const double total = b.cost.total();
  if (!std::isfinite(total) || total < 0 || std::abs(sum - total) > 1e-9 * total) std::abort();
  return 0;
}
