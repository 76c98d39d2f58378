#include "kvlab/engine/admission.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace kvlab {

std::string AdmissionCheck::never_fits(const RequestState& r,
                                       std::span<StepExtension* const> extensions,
                                       const KvAllocator& kv) {
  const std::int64_t total = r.prompt_tokens + r.max_new_tokens;
  if (r.prompt_tokens == 0) return "empty prompt";
  if (total > rules_.context)
    return fmt::format("prompt {} + max tokens {} exceed the context of {}", r.prompt_tokens,
                       r.max_new_tokens, rules_.context);
  std::int64_t held = total;  // with a window or an extension's bound: what it keeps, a new token
  if (rules_.window) held = std::min(held, std::max(r.prompt_tokens, *rules_.window + 1));
  for (const StepExtension* extension : extensions) held = extension->max_held(r, held);
  if (unmatched_tokens_.size() < static_cast<std::size_t>(held))
    unmatched_tokens_.resize(static_cast<std::size_t>(held), -1);  // no prefix hits
  const std::span<const std::int32_t> tokens(unmatched_tokens_.data(),
                                             static_cast<std::size_t>(held));
  const std::int64_t capacity = kv.stats().capacity;
  if (kv.slots_to_allocate({r.id, tokens, held}) <= capacity) return {};
  if (held <= capacity)  // the pool would hold them: the allocator's own limit refuses them
    return fmt::format(
        "prompt {} + max tokens {} fit the pool ({} slots), but {} refuses a sequence this long "
        "(its own limit, e.g. the static allocator's max_seq_len)",
        r.prompt_tokens, r.max_new_tokens, capacity, allocator_name_);
  return fmt::format("prompt {} + max tokens {} need more KV than the pool holds ({} slots)",
                     r.prompt_tokens, r.max_new_tokens, capacity);
}

bool admission_blocked_by_fragmentation(const StepPlan& plan, const RequestTable& table,
                                        const KvAllocator& kv) {
  std::optional<KvAllocatorStats> stats;  // read only when a request was refused for memory
  for (const Deferral& d : plan.deferred) {
    const RequestState& r = table.at(d.id);
    if (d.reason != "kv_full" || !r.is_waiting()) continue;
    if (!stats) stats = kv.stats();
    if (stats->unusable_free == 0) return false;
    const AllocateRequest request{r.id, r.tokens, r.length() + r.remaining_output(),
                                  &r.prefix_hashes};
    if (kv.slots_to_allocate(request) <= stats->free) return true;
  }
  return false;
}

ReplicaLoad replica_load(const RequestTable* table, const KvAllocator& kv) {
  ReplicaLoad load;
  const KvAllocatorStats stats = kv.stats();
  load.kv_used = stats.used;
  load.kv_capacity = stats.capacity;
  if (table == nullptr) return load;
  auto pending = [](const RequestState& r) {
    return std::max<std::int64_t>(0, r.length() - r.computed) + r.remaining_output();
  };
  for (const RequestState* r : table->waiting()) {
    load.queued_tokens += pending(*r);
    load.queued_prefill_tokens += std::max<std::int64_t>(0, r->length() - r->computed);
  }
  for (const RequestState* r : table->running()) load.queued_tokens += pending(*r);
  for (const RequestId id : table->not_arrived()) {  // routed here, not arrived yet
    const RequestState& r = table->at(id);
    load.queued_tokens += r.prompt_tokens + r.max_new_tokens;
    load.queued_prefill_tokens += r.prompt_tokens;
  }
  load.waiting = static_cast<std::int64_t>(table->waiting().size() + table->not_arrived().size());
  load.running = static_cast<std::int64_t>(table->running().size());
  return load;
}

}  // namespace kvlab
