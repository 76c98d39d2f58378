#include "kvlab/engine/kv_policy_runner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "kvlab/engine/plugin_call.hpp"
#include "kvlab/error.hpp"
#include "kvlab/kv/kv_groups.hpp"

namespace kvlab {

void KvPolicyRunner::ask_scores(std::span<BatchEntry> requests, std::span<const ScheduledWork> work,
                                const RequestTable& table) {
  masks_.resize(requests.size());
  for (std::size_t e = 0; e < requests.size(); ++e) {
    BatchEntry& entry = requests[e];
    entry.scored_queries = policy_.scored_queries();
    const RequestId id = work[e].id;
    const auto kept = kept_.find(id);
    if (kept == kept_.end()) continue;
    if (const auto was = preemptions_.find(id);
        was == preemptions_.end() || was->second != table.timeline(id).preemptions) {
      kept_.erase(kept);  // its KV was rebuilt since the selection: nothing of it is masked
      continue;
    }
    positions_.resize(static_cast<std::size_t>(entry.view.length()));
    for (std::int64_t i = 0; i < entry.view.length(); ++i)
      positions_[static_cast<std::size_t>(i)] = entry.view.position_at(i);
    key_mask_for(kept->second, positions_, entry.start_position, masks_[e]);
    entry.key_mask = masks_[e];
  }
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
    total += static_cast<std::size_t>(layers_ * kv_heads_ * entry.view.length());
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
      forget(work.id);
      continue;
    }
    const std::int64_t preempted = table.timeline(work.id).preemptions;
    if (auto [it, added] = preemptions_.try_emplace(work.id, preempted);
        !added && it->second != preempted) {  // its KV was rebuilt since: a new sequence
      policy_.forget(work.id);
      kept_.erase(work.id);
      it->second = preempted;
    }
    const std::size_t end = e + 1 < offsets_.size() ? offsets_[e + 1] : scores_.size();
    const std::span<const float> scores =
        scores_.empty() ? std::span<const float>()
                        : std::span<const float>(scores_).subspan(offsets_[e], end - offsets_[e]);
    select_one(work.id, work, scores, kv);
  }
}

// The policy sees the sequence's positions now (this step's new ones last); what no head keeps
// is dropped, what some heads keep is masked for the others. The scores were given for the view
// as the forward read it; since then only a sliding window may have released its oldest
// positions, so each head's are its last ones.
void KvPolicyRunner::select_one(RequestId id, const ScheduledWork& work,
                                std::span<const float> scores, KvAllocator& kv) {
  const KvView view = kv.view(id);
  const auto n = static_cast<std::size_t>(view.length());
  positions_.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    positions_[i] = view.position_at(static_cast<std::int64_t>(i));
  const auto heads = static_cast<std::size_t>(layers_ * kv_heads_);
  head_scores_.clear();  // each head's scores of the positions held now
  if (!scores.empty()) {
    const std::size_t scored = scores.size() / heads;
    if (scored * heads != scores.size() || scored < n)
      throw Error(fmt::format("internal: request {} holds {} positions, its forward scored {}", id,
                              n, scored));
    head_scores_.resize(heads * n);
    for (std::size_t h = 0; h < heads; ++h)
      std::copy_n(scores.begin() + static_cast<long>(h * scored + scored - n), n,
                  head_scores_.begin() + static_cast<long>(h * n));
  }
  keep_.assign(heads * n, 0);
  const KvKeep keep{keep_, layers_, kv_heads_, static_cast<std::int64_t>(n)};
  visible_.clear();  // what each head still sees: the last selection's, new positions seen
  if (const auto was = kept_.find(id); was != kept_.end())
    key_mask_for(was->second, positions_, std::numeric_limits<std::int64_t>::max(), visible_);
  hide_outside_windows(layer_windows_, kv_heads_, positions_, visible_);
  const KvPolicyStep step{id,      positions_, head_scores_, visible_,
                          layers_, kv_heads_,  work.tokens,  work.samples && !work.decode};
  HeadSelection kept =
      kept_by_policy(policy_, policy_name_, step, keep, policy_.select(step, keep));
  const double held = drop_unkept(id, kept, kv);
  if (kept.cells < static_cast<std::int64_t>(heads * n))
    stats_.add(kept, positions_.back() + 1, held);  // the full cache: every position so far
  if (kept.visible.empty())
    kept_.erase(id);
  else
    kept_.insert_or_assign(id, std::move(kept));
}

double KvPolicyRunner::drop_unkept(RequestId id, const HeadSelection& kept, KvAllocator& kv) const {
  const KvAllocatorFeatures features = kv.features();
  const KvLayerGroups* groups =
      features.groups != nullptr ? &features.groups->layer_groups() : nullptr;
  bool dropped = true;
  if (groups != nullptr && !groups->uniform() && features.group_dropping != nullptr)
    dropped = features.group_dropping->evict_groups(
        id, kept_per_group(kept, groups->group_of_layer, groups->count()));
  else if (kept.held() < kv.view(id).length())
    dropped = features.dropping != nullptr && features.dropping->evict(id, kept.positions);
  if (!dropped)
    throw Error(
        fmt::format("{} cannot drop positions for KV policy \"{}\" (request {}): a KV policy needs "
                    "kv_cache.allocator = \"paged\" with prefix_caching = false",
                    allocator_name_, policy_name_, id));
  if (groups == nullptr || groups->uniform()) return static_cast<double>(kept.held());
  double held = 0;
  for (std::int64_t g = 0; g < groups->count(); ++g)
    held += static_cast<double>(features.groups->group_view(id, g).length());
  return held / static_cast<double>(groups->count());
}

}  // namespace kvlab
