#include "kvlab/engine/kv_policy_runner.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"

namespace kvlab {

void KvPolicyRunner::ask_scores(std::span<BatchEntry> requests) const {
  for (BatchEntry& entry : requests) entry.scored_queries = policy_.scored_queries();
}

void KvPolicyRunner::after_update(StepState& step, std::span<const RequestId> held) {
  (void)held;
  plugin_call<PluginErrors::non_kvlab>(policy_name_, step.step,
                                       [&] { select(*step.applied, step.table, step.allocator); });
}

void KvPolicyRunner::take_scores(std::span<const BatchEntry> requests,
                                 const ForwardResult& result) {
  offsets_.clear();
  std::size_t total = 0;
  for (const BatchEntry& entry : requests) {
    offsets_.push_back(total);
    total += static_cast<std::size_t>(entry.view.length());
  }
  if (policy_.scored_queries() <= 0 || requests.empty()) return scores_.clear();
  if (result.key_scores.size() < total)
    throw Error(fmt::format(
        "KV policy \"{}\" reads attention scores, and {} reported none: use backend \"cpu\"",
        policy_name_, backend_name_));
  scores_.assign(result.key_scores.begin(), result.key_scores.begin() + static_cast<long>(total));
}

void KvPolicyRunner::select(const AppliedPlan& applied, const RequestTable& table,
                            KvAllocator& kv) {
  for (std::size_t e = 0; e < applied.batch.size(); ++e) {
    const ScheduledWork& work = applied.batch[e];
    const RequestState& r = table.at(work.id);
    if (r.status != RequestStatus::running) {  // finished (or handed off): its KV is gone
      policy_.forget(work.id);
      preemptions_.erase(work.id);
      continue;
    }
    const std::int64_t preempted = table.timeline(work.id).preemptions;
    if (auto [it, added] = preemptions_.try_emplace(work.id, preempted);
        !added && it->second != preempted) {  // its KV was rebuilt since: a new sequence
      policy_.forget(work.id);
      it->second = preempted;
    }
    const std::size_t end = e + 1 < offsets_.size() ? offsets_[e + 1] : scores_.size();
    const std::span<const float> scores =
        scores_.empty() ? std::span<const float>()
                        : std::span<const float>(scores_).subspan(offsets_[e], end - offsets_[e]);
    select_one(work.id, work, scores, kv);
  }
}

// The policy sees the sequence's positions now (this step's new ones last); what it does not
// keep is dropped. The scores were given for the view as the forward read it; since then only a
// sliding window may have released its oldest positions, so they are the last ones' scores.
void KvPolicyRunner::select_one(RequestId id, const ScheduledWork& work,
                                std::span<const float> scores, KvAllocator& kv) {
  const KvView view = kv.view(id);
  positions_.resize(static_cast<std::size_t>(view.length()));
  for (std::int64_t i = 0; i < view.length(); ++i)
    positions_[static_cast<std::size_t>(i)] = view.position_at(i);
  if (scores.size() > positions_.size()) scores = scores.last(positions_.size());
  if (!scores.empty() && scores.size() != positions_.size())
    throw Error(fmt::format("internal: request {} holds {} positions, its forward scored {}", id,
                            positions_.size(), scores.size()));
  kept_.resize(positions_.size());
  const std::int64_t count =
      policy_.select({id, positions_, scores, work.tokens, work.samples && !work.decode}, kept_);
  const auto held = static_cast<std::int64_t>(positions_.size());
  const bool increasing =
      std::is_sorted(kept_.begin(), kept_.begin() + count) &&
      std::adjacent_find(kept_.begin(), kept_.begin() + count) == kept_.begin() + count;
  if (count < 1 || count > held || (held > policy_.budget() && count > policy_.budget()) ||
      !increasing ||
      !std::includes(positions_.begin(), positions_.end(), kept_.begin(), kept_.begin() + count))
    throw Error(fmt::format(
        "KV policy \"{}\" kept {} of request {}'s {} positions (budget {}): a policy keeps at "
        "least one, at most its budget once over it, in increasing order, each one held",
        policy_name_, count, id, held, policy_.budget()));
  if (count == held) return;
  KvPositionDropping* dropping = kv.features().dropping;
  if (dropping == nullptr || !dropping->evict(id, std::span<const std::int64_t>(kept_).first(
                                                      static_cast<std::size_t>(count))))
    throw Error(
        fmt::format("{} cannot drop positions for KV policy \"{}\" (request {}): a KV policy needs "
                    "kv_cache.allocator = \"paged\" with prefix_caching = false",
                    allocator_name_, policy_name_, id));
}

}  // namespace kvlab
