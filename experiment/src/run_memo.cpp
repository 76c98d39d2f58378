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

std::vector<std::int32_t> reference_argmax(
    const std::function<const cpu::ReferenceModel&()>& reference, const std::string& weights_key,
    std::optional<std::int64_t> window, std::span<const std::int32_t> sequence) {
  using Key = std::tuple<std::string, std::optional<std::int64_t>, std::vector<std::int32_t>>;
  static std::mutex mutex;
  static std::map<Key, std::vector<std::int32_t>> memo;
  Key key{weights_key, window, {sequence.begin(), sequence.end()}};
  {
    std::lock_guard lock(mutex);
    if (const auto found = memo.find(key); found != memo.end()) return found->second;
  }
  cpu::ForwardOptions forward;
  forward.sliding_window = window;
  const cpu::RowMatrix logits = reference().forward(sequence, forward);  // (positions, vocab)
  std::vector<std::int32_t> argmax(sequence.size());
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    Eigen::Index best = 0;
    logits.row(t).maxCoeff(&best);
    argmax[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(best);
  }
  std::lock_guard lock(mutex);
  return memo.emplace(std::move(key), std::move(argmax)).first->second;
}

}  // namespace kvlab
