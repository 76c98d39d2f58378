#include "kvlab/cpu_reference/batch_generator.hpp"

#include <fmt/format.h>

#include <limits>

#include "kvlab/error.hpp"

namespace kvlab::cpu {
namespace {

PluginObject<AttentionVariant> make_attention(const PluginRegistry& registry,
                                              const BatchSetup& setup, const ModelConfig& model) {
  PluginContext context;
  context.model = &model;
  auto attention = registry.create<PluginKind::attention_variant>(setup.attention,
                                                                  setup.attention_params, context);
  if (const std::string problem = attention->check(model); !problem.empty())
    throw Error(
        fmt::format("attention \"{}\" cannot run {}: {}", setup.attention, model.name, problem));
  return attention;
}

KvPoolShape pool_shape(const ModelConfig& c, std::int64_t slots) {
  return {c.num_hidden_layers, c.num_key_value_heads, c.head_dim, slots};
}

}  // namespace

BatchGenerator::BatchGenerator(const LlamaWeights& checkpoint, const PluginRegistry& registry,
                               const BatchSetup& setup)
    : attention_(make_attention(registry, setup, checkpoint.config)),
      weights_(convert_kv_heads(checkpoint, attention_->kv_heads(checkpoint.config))),
      pool_(pool_shape(weights_.config, setup.pool_slots)),
      backend_(weights_, pool_, attention_->window()),
      max_seq_len_(setup.max_seq_len > 0 ? setup.max_seq_len
                                         : weights_.config.max_position_embeddings) {
  PluginContext context;
  context.pool = &pool_;
  context.model = &weights_.config;
  context.max_seq_len = max_seq_len_;
  allocator_ =
      registry.create<PluginKind::kv_allocator>(setup.allocator, setup.allocator_params, context);
}

std::vector<BatchResult> BatchGenerator::run(const std::vector<BatchRequest>& requests,
                                             const BatchOptions& options) {
  struct Active {
    std::size_t request;
    SequenceId sequence;
    std::vector<std::int32_t> tokens;  // prompt + generated
    std::int64_t computed = 0;         // tokens whose KV is in the pool
    Sampler sampler;
    bool recompute = false;  // no-cache variant: redo the whole sequence before the next token
  };
  const bool caches = attention_->caches_kv();
  const auto window = attention_->window();
  std::vector<BatchResult> results(requests.size());
  std::vector<Active> active;
  std::size_t finished = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    validate_sampling_params(requests[i].sampling);
    if (requests[i].arrival_step < 0)
      throw Error(fmt::format("request {}: arrival_step must be >= 0", i));
  }

  for (std::int64_t step = 0; finished < requests.size(); ++step) {
    // Admit arrivals (requests are taken in order of arrival_step, then index).
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const BatchRequest& r = requests[i];
      if (r.arrival_step != step) continue;
      const std::int64_t max_total =
          static_cast<std::int64_t>(r.prompt.size()) + r.sampling.max_tokens;
      if (r.prompt.empty()) throw Error(fmt::format("request {}: empty prompt", i));
      if (max_total > max_seq_len_)
        throw Error(fmt::format("request {}: prompt {} + max_tokens {} exceeds max_seq_len {}", i,
                                r.prompt.size(), r.sampling.max_tokens, max_seq_len_));
      const SequenceId id = next_sequence_++;
      const auto allocation = allocator_->allocate({id, r.prompt, max_total});
      if (!allocation)
        throw Error(
            fmt::format("request {}: the {}-token prompt does not fit in the KV pool ({} slots)", i,
                        r.prompt.size(), pool_.shape().slots));
      results[i].cached_prompt_tokens = allocation->cached_tokens;
      active.push_back({i, id, r.prompt, allocation->cached_tokens, Sampler(r.sampling)});
    }
    if (active.empty()) {  // idle: jump to the next arrival
      std::int64_t next = std::numeric_limits<std::int64_t>::max();
      for (const auto& r : requests)
        if (r.arrival_step > step) next = std::min(next, r.arrival_step);
      step = next - 1;
      continue;
    }

    // Plan this step's entries: the rest of a prompt (or a chunk of it), or the newest token.
    std::vector<BatchEntry> batch;
    std::vector<bool> samples;  // does the entry's last token produce the next token?
    for (Active& a : active) {
      const auto length = static_cast<std::int64_t>(a.tokens.size());
      if (a.recompute) {  // no cache: throw the KV away and redo the whole sequence
        allocator_->free(a.sequence);
        if (!allocator_->allocate({a.sequence, a.tokens, length}))
          throw Error(fmt::format("request {}: no room to recompute {} tokens", a.request, length));
        a.computed = 0;
        a.recompute = false;
      }
      std::int64_t count = length - a.computed;
      if (options.prefill_chunk > 0) count = std::min(count, options.prefill_chunk);
      BatchEntry entry;
      entry.tokens = std::span<const std::int32_t>(a.tokens).subspan(
          static_cast<std::size_t>(a.computed), static_cast<std::size_t>(count));
      entry.start_position = a.computed;
      entry.view = allocator_->view(a.sequence);
      batch.push_back(std::move(entry));
      samples.push_back(a.computed + count == length);
    }
    const RowMatrix& logits = backend_.run(batch);  // (entries, vocab)

    // Sample, append, stop, free.
    for (std::size_t e = 0; e < active.size(); ++e) {
      Active& a = active[e];
      a.computed += static_cast<std::int64_t>(batch[e].tokens.size());
      if (caches)
        allocator_->mark_computed(a.sequence, a.computed);  // nothing outlives a recompute step
      if (!samples[e]) continue;
      const std::span<const float> row(logits.row(static_cast<Eigen::Index>(e)).data(),
                                       static_cast<std::size_t>(logits.cols()));
      BatchResult& result = results[a.request];
      if (auto bad = first_non_finite(row))
        throw Error(fmt::format("batch generator: request {}: logits hold {} at token id {}",
                                a.request, row[*bad], *bad));
      const std::int32_t token = a.sampler.sample(row);
      result.tokens.push_back(token);
      if (options.record_logits) result.logits.emplace_back(row.begin(), row.end());
      a.tokens.push_back(token);
      const auto& sampling = requests[a.request].sampling;
      const bool eos = !sampling.ignore_eos && weights_.config.is_eos(token);
      const bool full =
          static_cast<std::int64_t>(a.tokens.size()) >= weights_.config.max_position_embeddings;
      if (eos || static_cast<std::int32_t>(result.tokens.size()) >= sampling.max_tokens || full) {
        result.finish_reason = eos    ? FinishReason::eos
                               : full ? FinishReason::context_full
                                      : FinishReason::max_tokens;
        allocator_->free(a.sequence);
        a.sequence = -1;
        ++finished;
        continue;
      }
      a.recompute = !caches;
      if (caches) {
        if (!allocator_->append(a.sequence, std::span<const std::int32_t>(&token, 1)))
          throw Error(fmt::format("request {}: the KV pool is full ({} slots) at {} tokens",
                                  a.request, pool_.shape().slots, a.tokens.size()));
        if (window)
          allocator_->release_before(a.sequence,
                                     static_cast<std::int64_t>(a.tokens.size()) - *window);
      }
    }
    std::erase_if(active, [](const Active& a) { return a.sequence < 0; });
  }
  return results;
}

}  // namespace kvlab::cpu
