#pragma once
// What the runs of one process share, computed once: the checkpoint a sweep serves at every
// point, and the reference's greedy tokens for a sequence (kvlab check asks for the same
// sequences at every allocator x scheduler point). Both are pure functions of their keys, so a
// memoized answer is the answer. Thread-safe.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvlab/cpu_reference/llama_weights.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/engine/sampling.hpp"
#include "kvlab/experiment/logit_agreement.hpp"
#include "kvlab/experiment/model_source.hpp"

namespace kvlab {

// The checkpoint of `source` (a preset's random weights for `weights_seed`); the last one
// loaded is kept. Its key names it for reference_argmax.
struct LoadedCheckpoint {
  std::shared_ptr<const cpu::LlamaWeights> weights;
  std::string key;
};
LoadedCheckpoint load_checkpoint(const ModelSource& source, std::uint64_t weights_seed);

// The reference's (positions, vocab) logits over all but the last token of `sequence`: the
// full-recompute forward with `window`; row t scores the token after position t.
cpu::RowMatrix reference_logits(const cpu::ReferenceModel& reference,
                                std::optional<std::int64_t> window,
                                std::span<const std::int32_t> sequence);

// What the reference makes of the token that follows position t of `sequence`: its argmax, the
// gap between its largest logit and the logit of sequence[t + 1] (0 when that token is the
// argmax), its five most likely tokens, and log-probabilities (kvlab check of workload.logprobs).
struct ReferenceChoice {
  std::int32_t argmax = 0;
  float gap = 0;
  TopTokens top{};
  GeneratedLogprobs logprobs;  // sequence[t + 1]'s log-probability and the top kMaxLogprobs
};
// For positions first <= t < size - 1 of `sequence`, from its reference_logits.
std::vector<ReferenceChoice> choices_from_logits(const cpu::RowMatrix& logits,
                                                 std::span<const std::int32_t> sequence,
                                                 std::size_t first);
// The same, memoized: `reference` gives the model when the answer is not known yet;
// `weights_key` must name its weights exactly (checkpoint key and K/V head conversion).
std::vector<ReferenceChoice> reference_choices(
    const std::function<const cpu::ReferenceModel&()>& reference, const std::string& weights_key,
    std::optional<std::int64_t> window, std::span<const std::int32_t> sequence, std::size_t first);

}  // namespace kvlab
