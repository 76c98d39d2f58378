#include "run_memo.hpp"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <tuple>

namespace kvlab {

LoadedCheckpoint load_checkpoint(const ModelSource& source, std::uint64_t weights_seed) {
  static std::mutex mutex;
  static LoadedCheckpoint last;
  const std::string key = source.is_preset()
                              ? fmt::format("preset {} seed {}", source.config.name, weights_seed)
                              : fmt::format("file {}", source.directory.string());
  std::lock_guard lock(mutex);
  if (last.weights && last.key == key) return last;
  last = {};  // free the previous checkpoint before loading the next
  last.weights = std::make_shared<const cpu::LlamaWeights>(
      source.is_preset() ? cpu::random_llama_weights(source.config, weights_seed)
                         : cpu::load_llama_weights(source.directory));
  last.key = key;
  return last;
}

cpu::RowMatrix reference_logits(const cpu::ReferenceModel& reference,
                                std::optional<std::int64_t> window,
                                std::span<const std::int32_t> sequence) {
  if (sequence.size() < 2) return {};
  cpu::ForwardOptions forward;
  forward.sliding_window = window;
  return reference.forward(sequence.first(sequence.size() - 1), forward);
}

std::vector<ReferenceChoice> choices_from_logits(const cpu::RowMatrix& logits,
                                                 std::span<const std::int32_t> sequence,
                                                 std::size_t first) {
  std::vector<ReferenceChoice> choices;
  for (auto t = static_cast<Eigen::Index>(first); t < logits.rows(); ++t) {
    Eigen::Index best = 0;
    const float max = logits.row(t).maxCoeff(&best);
    const std::int32_t token = sequence[static_cast<std::size_t>(t) + 1];
    const std::span<const float> row(logits.row(t).data(), static_cast<std::size_t>(logits.cols()));
    choices.push_back({static_cast<std::int32_t>(best), max - logits(t, token), top_tokens(row),
                       generated_logprobs(row, token, kMaxLogprobs)});
  }
  return choices;
}

std::vector<ReferenceChoice> reference_choices(
    const std::function<const cpu::ReferenceModel&()>& reference, const std::string& weights_key,
    std::optional<std::int64_t> window, std::span<const std::int32_t> sequence, std::size_t first) {
  using Key =
      std::tuple<std::string, std::optional<std::int64_t>, std::vector<std::int32_t>, std::size_t>;
  static std::mutex mutex;
  static std::map<Key, std::vector<ReferenceChoice>> memo;
  Key key{weights_key, window, {sequence.begin(), sequence.end()}, first};
  {
    std::lock_guard lock(mutex);
    if (const auto found = memo.find(key); found != memo.end()) return found->second;
  }
  std::vector<ReferenceChoice> choices =
      choices_from_logits(reference_logits(reference(), window, sequence), sequence, first);
  std::lock_guard lock(mutex);
  return memo.emplace(std::move(key), std::move(choices)).first->second;
}

}  // namespace kvlab
