#include "kvlab/plugin/allocator_conformance.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <unordered_map>

#include "kvlab/kv/kv_groups.hpp"

namespace kvlab {
namespace {

// Value of the token at `position` given the whole prefix: exact in fp32 (< 2^23).
float prefix_value(const std::vector<std::int32_t>& tokens, std::size_t position) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i <= position; ++i)
    h = (h ^ static_cast<std::uint64_t>(tokens[i] + 1)) * 1099511628211ULL;
  return static_cast<float>(h % (1u << 23));
}

// A group's value for the token at `position` (group 0's is prefix_value): exact in fp32.
float group_value(const std::vector<std::int32_t>& tokens, std::size_t position,
                  std::int64_t group) {
  const auto value = static_cast<std::uint64_t>(prefix_value(tokens, position));
  return static_cast<float>((value + static_cast<std::uint64_t>(group) * 1000003u) % (1u << 23));
}

// `groups` KV groups of one layer each: group 0 global, the others a window of 8.
KvLayerGroups conformance_groups(std::int64_t groups) {
  KvLayerGroups out;
  out.group_layers = 1;
  for (std::int64_t g = 0; g < groups; ++g) {
    out.groups.push_back({{g}, g == 0 ? std::nullopt : std::optional<std::int64_t>(8)});
    out.group_of_layer.push_back(g);
    out.pool_layer.push_back(0);
  }
  return out;
}

// One seed's run. Each operation returns "" or what broke the contract.
class ConformanceRun {
 public:
  ConformanceRun(const PluginRegistry& registry, std::string_view name,
                 const std::map<std::string, ParamValue, std::less<>>& params,
                 const ConformanceOptions& options, unsigned seed)
      : options_(options), pool_({1, 1, 1, options.slots}), rng_(seed) {
    PluginContext context;
    context.pool = &pool_;
    context.max_seq_len = options.max_seq_len;
    if (options.host_tier_bytes > 0 || options.disk_tier_bytes > 0) {
      policy_ = registry.create<PluginKind::tier_policy>(options.tier_policy, {}, context);
      tiers_ = {options.host_tier_bytes, options.disk_tier_bytes, nullptr, policy_.get()};
      context.tiers = &tiers_;
    }
    plugin_ = registry.create<PluginKind::kv_allocator>(name, params, context);
    allocator_ = plugin_.get();
    if (options.kv_groups > 1) {
      grouped_ =
          std::make_unique<GroupedKvAllocator>(*plugin_, conformance_groups(options.kv_groups));
      allocator_ = grouped_.get();
    }
    features_ = allocator_->features();
  }
  std::string run(ConformanceReport& report);

 private:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  std::map<SequenceId, std::vector<std::int32_t>>::iterator any_sequence() {
    return std::next(tokens_.begin(), uniform(0, static_cast<int>(tokens_.size()) - 1));
  }
  std::string missing_features() const;
  std::string admit();
  std::string append();
  std::string speculate();
  void fork();
  std::string evict_some(SequenceId id);
  void forget(SequenceId id) {
    tokens_.erase(id);
    kept_.erase(id);
  }
  std::string planned_step();
  void write_from(SequenceId id, std::int64_t from);
  void write_values(SequenceId id, std::int64_t from);
  std::string check_invariants() const;
  std::string check_pool_map(const KvAllocatorStats& stats,
                             const std::unordered_map<std::int64_t, int>& holders) const;
  std::string check_all_returned() const;

  const ConformanceOptions& options_;
  KvPool pool_;
  PluginObject<KvTierPolicy> policy_;  // with tiers
  KvTierSpec tiers_;
  PluginObject<KvAllocator> plugin_;
  std::unique_ptr<GroupedKvAllocator> grouped_;  // with kv_groups: over plugin_
  KvAllocator* allocator_ = nullptr;             // what runs: plugin_ or grouped_
  KvAllocatorFeatures features_;                 // allocator_'s
  std::int64_t groups() const { return grouped_ ? grouped_->layer_groups().count() : 1; }
  KvView view_in(SequenceId id, std::int64_t group) const {
    return grouped_ ? grouped_->group_view(id, group) : allocator_->view(id);
  }
  std::string check_views(SequenceId id, const std::vector<std::int32_t>& tokens,
                          std::unordered_map<std::int64_t, float>& value_of_slot,
                          std::unordered_map<std::int64_t, int>& holders) const;
  std::mt19937 rng_;
  std::map<SequenceId, std::vector<std::int32_t>> tokens_;
  // The positions an evicted sequence holds (sequences never evicted hold their whole view).
  std::map<SequenceId, std::vector<std::int64_t>> kept_;
  SequenceId next_id_ = 0;
  std::int64_t refusals_ = 0;
  std::int64_t evictions_ = 0;    // evict calls accepted
  std::int64_t rolled_back_ = 0;  // tokens truncate took back
};

std::string ConformanceRun::run(ConformanceReport& report) {
  if (std::string missing = missing_features(); !missing.empty()) return missing;
  for (int op = 0; op < options_.operations; ++op) {
    const int kind = uniform(0, 9);
    std::string failure;
    if (kind <= 2 || tokens_.empty()) {
      failure = admit();
    } else if (kind <= 5) {
      failure = options_.rollback && kind == 5 ? speculate() : append();
    } else if (kind <= 7) {  // finish a random sequence
      const SequenceId id = any_sequence()->first;
      allocator_->free(id);
      forget(id);
    } else if (kind == 8) {
      fork();
    } else {
      failure = planned_step();
    }
    if (failure.empty()) failure = check_invariants();
    ++report.operations;
    if (!failure.empty()) return fmt::format("operation {}: {}", op, failure);
  }
  report.full_pool_refusals += refusals_;
  report.rolled_back_tokens += rolled_back_;
  const KvAllocatorStats stats = allocator_->stats();
  report.tier_hit_tokens += stats.host_hit_tokens + stats.disk_hit_tokens;
  if (refusals_ == 0) return "the workload never filled the pool (use fewer slots)";
  if (options_.evict && evictions_ == 0) return "evict never accepted a drop";
  if (options_.rollback && rolled_back_ == 0) return "truncate never rolled a token back";
  for (const auto& [id, tokens] : tokens_) allocator_->free(id);
  tokens_.clear();
  kept_.clear();
  return check_all_returned();
}

// The features the options exercise must be offered (KvAllocatorFeatures).
std::string ConformanceRun::missing_features() const {
  if ((options_.release_window || options_.evict) && features_.dropping == nullptr)
    return "asked to drop positions (release_before, evict), but the allocator offers no "
           "KvPositionDropping";
  if (options_.rollback && features_.rollback == nullptr)
    return "asked to roll speculative tokens back, but the allocator offers no KvRollback";
  return "";
}

// A new sequence, often with a shared prefix: plan_allocate predicts allocate, allocate takes
// slots_to_allocate, a refusal changes nothing.
std::string ConformanceRun::admit() {
  static const std::vector<std::vector<std::int32_t>> prefixes{
      {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
  std::vector<std::int32_t> prompt;
  if (uniform(0, 1)) prompt = prefixes[static_cast<std::size_t>(uniform(0, 1))];
  const int extra = uniform(1, 20);
  for (int i = 0; i < extra; ++i) prompt.push_back(uniform(0, 3));
  const AllocateRequest request{next_id_, prompt, static_cast<std::int64_t>(prompt.size()) + 10};
  const KvAllocatorStats before = allocator_->stats();
  const std::int64_t planned = allocator_->slots_to_allocate(request);
  allocator_->plan_reset();
  const bool promised = allocator_->plan_allocate(request);
  const auto result = allocator_->allocate(request);
  if (promised != result.has_value())
    return fmt::format("plan_allocate said {}, allocate {}", promised, result.has_value());
  if (!result) {
    ++refusals_;
    const KvAllocatorStats after = allocator_->stats();
    return after.used == before.used && after.free == before.free
               ? ""
               : "a refused allocate changed the pool";
  }
  if (result->cached_tokens > static_cast<std::int64_t>(prompt.size()) - 1)
    return fmt::format("{} cached tokens of a {}-token prompt (the last is always computed)",
                       result->cached_tokens, prompt.size());
  if (const std::int64_t taken = before.free - allocator_->stats().free; taken != planned)
    return fmt::format("slots_to_allocate said {}, allocate took {}", planned, taken);
  tokens_[next_id_] = prompt;
  write_from(next_id_, result->cached_tokens);
  ++next_id_;
  return "";
}

// 1-3 tokens onto a random sequence: plan_append predicts append.
std::string ConformanceRun::append() {
  const auto it = any_sequence();
  std::vector<std::int32_t> more(static_cast<std::size_t>(uniform(1, 3)));
  for (auto& t : more) t = uniform(0, 3);
  const auto count = static_cast<std::int64_t>(more.size());
  const std::int64_t old_length = static_cast<std::int64_t>(it->second.size());
  allocator_->plan_reset();
  const bool promised = allocator_->plan_append(it->first, count);
  const bool done = allocator_->append(it->first, more);
  if (promised != done) return fmt::format("plan_append said {}, append {}", promised, done);
  if (!done) {
    ++refusals_;
    return "";
  }
  it->second.insert(it->second.end(), more.begin(), more.end());
  write_from(it->first, old_length);
  if (options_.release_window && uniform(0, 1)) {
    features_.dropping->release_before(it->first, old_length - 8);
    if (auto kept = kept_.find(it->first); kept != kept_.end()) {  // it may free them or not
      const KvView view = allocator_->view(it->first);
      for (std::int64_t p : kept->second)
        if (p >= old_length - 8 && view.index_at_or_after(p) == view.length())
          return fmt::format("sequence {}: release_before dropped position {}", it->first, p);
      kept->second.clear();  // (a view without holes lists no positions)
      for (std::int64_t i = 0; i < view.length(); ++i) kept->second.push_back(view.position_at(i));
    }
  }
  if (options_.evict && uniform(0, 2) == 0) return evict_some(it->first);
  return "";
}

// Speculative decoding on a random sequence: 1-4 proposed tokens appended and written (the
// target's verify step), the first `accepted` marked computed and the rest rolled back. truncate
// must accept (after dropped positions too: the rolled-back ones are the newest), free exactly
// the rolled-back slots (they were the sequence's own), and refuse a length past the end
// without changing anything.
std::string ConformanceRun::speculate() {
  const auto it = any_sequence();
  std::vector<std::int32_t> proposed(static_cast<std::size_t>(uniform(1, 4)));
  for (auto& t : proposed) t = uniform(0, 3);
  const auto count = static_cast<std::int64_t>(proposed.size());
  const auto old_length = static_cast<std::int64_t>(it->second.size());
  allocator_->plan_reset();
  const bool promised = allocator_->plan_append(it->first, count);
  if (promised != allocator_->append(it->first, proposed))
    return fmt::format("plan_append said {}, a speculative append did not", promised);
  if (!promised) {
    ++refusals_;
    return "";
  }
  it->second.insert(it->second.end(), proposed.begin(), proposed.end());
  write_values(it->first, old_length);
  const std::int64_t keep = old_length + uniform(0, static_cast<int>(count));
  allocator_->mark_computed(it->first, keep);
  const KvAllocatorStats before = allocator_->stats();
  if (features_.rollback->truncate(it->first, old_length + count + 1))
    return fmt::format("sequence {}: truncate past its end accepted", it->first);
  if (!features_.rollback->truncate(it->first, keep))
    return fmt::format("sequence {}: truncate to {} of {} refused after a speculative append",
                       it->first, keep, old_length + count);
  it->second.resize(static_cast<std::size_t>(keep));
  if (auto kept = kept_.find(it->first); kept != kept_.end())
    std::erase_if(kept->second, [keep](std::int64_t p) { return p >= keep; });
  rolled_back_ += old_length + count - keep;
  const std::int64_t freed = before.used - allocator_->stats().used;
  if (freed != (old_length + count - keep) * groups())
    return fmt::format("sequence {}: rolling back {} tokens freed {} used slots", it->first,
                       old_length + count - keep, freed);
  return "";
}

// Drops about half the sequence's positions (its newest always stays): evict must accept.
std::string ConformanceRun::evict_some(SequenceId id) {
  const KvView view = allocator_->view(id);
  std::vector<std::int64_t> kept;
  for (std::int64_t i = 0; i < view.length(); ++i)
    if (i + 1 == view.length() || uniform(0, 1)) kept.push_back(view.position_at(i));
  const KvAllocatorStats before = allocator_->stats();
  bool accepted = false;
  if (grouped_ && uniform(0, 1)) {  // each group a subset of group 0's (a per-layer policy's)
    std::vector<std::vector<std::int64_t>> groups(static_cast<std::size_t>(this->groups()), kept);
    for (std::size_t g = 1; g < groups.size(); ++g)
      std::erase_if(groups[g], [&](std::int64_t p) { return p != kept.back() && uniform(0, 1); });
    accepted = grouped_->evict_groups(id, groups);
  } else {
    accepted = features_.dropping->evict(id, kept);
  }
  if (!accepted) {  // allowed (e.g. no room to unshare a fork's blocks)
    const bool unchanged =
        allocator_->view(id).length() == view.length() && allocator_->stats().free == before.free;
    return unchanged ? "" : fmt::format("sequence {}: a refused evict changed it or the pool", id);
  }
  ++evictions_;
  kept_[id] = std::move(kept);
  return "";
}

// A whole step planned, then committed in the same order (as a scheduler and apply_plan do):
// one or two sequences freed, then appends to others and new sequences, each tried on the
// planner; every operation the planner accepted must commit.
std::string ConformanceRun::planned_step() {
  std::vector<SequenceId> frees;
  for (int i = uniform(0, 2); i > 0 && tokens_.size() > frees.size() + 1; --i) {
    const SequenceId id = any_sequence()->first;
    if (std::find(frees.begin(), frees.end(), id) == frees.end()) frees.push_back(id);
  }
  struct Op {
    SequenceId id;
    std::vector<std::int32_t> tokens;  // appended, or the new sequence's prompt
    bool allocate;
  };
  std::vector<Op> ops;
  for (const auto& [id, tokens] : tokens_)
    if (std::find(frees.begin(), frees.end(), id) == frees.end() && uniform(0, 2) == 0)
      ops.push_back(
          {id, std::vector<std::int32_t>(static_cast<std::size_t>(uniform(1, 2)), 1), false});
  for (int i = uniform(0, 3); i > 0; --i)
    ops.push_back(
        {next_id_++, std::vector<std::int32_t>(static_cast<std::size_t>(uniform(1, 24)), 2), true});
  allocator_->plan_reset();
  for (SequenceId id : frees) allocator_->plan_free(id);
  std::vector<bool> promised;
  for (const Op& op : ops)
    promised.push_back(
        op.allocate ? allocator_->plan_allocate(
                          {op.id, op.tokens, static_cast<std::int64_t>(op.tokens.size()) + 10})
                    : allocator_->plan_append(op.id, static_cast<std::int64_t>(op.tokens.size())));
  for (SequenceId id : frees) {
    allocator_->free(id);
    forget(id);
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (!promised[i]) {
      ++refusals_;
      continue;
    }
    const Op& op = ops[i];
    if (op.allocate) {
      const auto result = allocator_->allocate(
          {op.id, op.tokens, static_cast<std::int64_t>(op.tokens.size()) + 10});
      if (!result)
        return fmt::format(
            "a planned step: allocate of sequence {} refused after plan_allocate accepted it",
            op.id);
      tokens_[op.id] = op.tokens;
      write_from(op.id, result->cached_tokens);
    } else {
      auto& tokens = tokens_[op.id];
      const auto old_length = static_cast<std::int64_t>(tokens.size());
      if (!allocator_->append(op.id, op.tokens))
        return fmt::format(
            "a planned step: append to sequence {} refused after plan_append accepted it", op.id);
      tokens.insert(tokens.end(), op.tokens.begin(), op.tokens.end());
      write_from(op.id, old_length);
    }
  }
  return "";
}

// Parallel sampling: a fork shares the parent's KV (or is refused).
void ConformanceRun::fork() {
  const auto it = any_sequence();
  if (allocator_->view(it->first).first_position > 0) return;  // released prefix: nothing to share
  if (features_.forking != nullptr && features_.forking->fork(it->first, next_id_)) {
    tokens_[next_id_] = tokens_[it->first];
    if (auto kept = kept_.find(it->first); kept != kept_.end()) kept_[next_id_] = kept->second;
  }
  ++next_id_;
}

void ConformanceRun::write_from(SequenceId id, std::int64_t from) {
  write_values(id, from);
  allocator_->mark_computed(id, static_cast<std::int64_t>(tokens_[id].size()));
}

// The shadow backend's writes for positions from `from` on (kept positions noted).
void ConformanceRun::write_values(SequenceId id, std::int64_t from) {
  const auto& tokens = tokens_[id];
  for (std::int64_t g = 0; g < groups(); ++g) {
    const KvView view = view_in(id, g);
    for (std::int64_t i = view.index_at_or_after(from); i < view.length(); ++i)
      *pool_.key(0, view.slot_at(i)) =
          group_value(tokens, static_cast<std::size_t>(view.position_at(i)), g);
  }
  if (auto kept = kept_.find(id); kept != kept_.end())
    for (auto p = static_cast<std::int64_t>(from); p < static_cast<std::int64_t>(tokens.size());
         ++p)
      kept->second.push_back(p);
}

// Whether the view's positions are `positions` (an evict that dropped nothing may leave a view
// without a positions list).
bool holds_exactly(const KvView& view, std::span<const std::int64_t> positions) {
  if (view.length() != static_cast<std::int64_t>(positions.size())) return false;
  for (std::int64_t i = 0; i < view.length(); ++i)
    if (view.position_at(i) != positions[static_cast<std::size_t>(i)]) return false;
  return true;
}

// The stats add up; every live sequence reads its own prefix back; a shared slot holds one
// prefix; `used` counts each live slot once.
std::string ConformanceRun::check_invariants() const {
  const KvAllocatorStats s = allocator_->stats();
  if (s.used + s.reserved_unused + s.last_block_slack + s.free != s.capacity)
    return fmt::format("used {} + reserved {} + slack {} + free {} != capacity {}", s.used,
                       s.reserved_unused, s.last_block_slack, s.free, s.capacity);
  if (s.unusable_free < 0 || s.unusable_free > s.free)
    return fmt::format("unusable_free {} outside [0, free {}]", s.unusable_free, s.free);
  if (s.live_sequences != static_cast<std::int64_t>(tokens_.size()))
    return fmt::format("live_sequences {} for {} live", s.live_sequences, tokens_.size());
  std::unordered_map<std::int64_t, float> value_of_slot;
  std::unordered_map<std::int64_t, int> holders;  // live slot -> sequences whose view holds it
  for (const auto& [id, tokens] : tokens_) {
    const KvView view = allocator_->view(id);
    if (view.end_position() != static_cast<std::int64_t>(tokens.size()))
      return fmt::format("sequence {}: view ends at {}, it has {} tokens", id, view.end_position(),
                         tokens.size());
    if (auto kept = kept_.find(id);
        kept != kept_.end() && (view.length() != static_cast<std::int64_t>(kept->second.size()) ||
                                !holds_exactly(view, kept->second)))
      return fmt::format("sequence {}: the view holds {} positions, not the {} it kept", id,
                         view.length(), kept->second.size());
    if (const KvView shape = allocator_->positions_view(id);
        shape.first_position != view.first_position || shape.positions != view.positions ||
        shape.length() != view.length())
      return fmt::format(
          "sequence {}: positions_view (first {}, {} tokens) is not view's "
          "(first {}, {} tokens)",
          id, shape.first_position, shape.length(), view.first_position, view.length());
    if (std::string failure = check_views(id, tokens, value_of_slot, holders); !failure.empty())
      return failure;
  }
  if (s.used != static_cast<std::int64_t>(value_of_slot.size()))
    return fmt::format("used {} but {} distinct live slots", s.used, value_of_slot.size());
  return check_pool_map(s, holders);
}

// Every group's view of the sequence reads that group's values back (a sliding group's from its
// first position on); a slot in several views holds one value (a shared prefix, one group's).
std::string ConformanceRun::check_views(SequenceId id, const std::vector<std::int32_t>& tokens,
                                        std::unordered_map<std::int64_t, float>& value_of_slot,
                                        std::unordered_map<std::int64_t, int>& holders) const {
  for (std::int64_t g = 0; g < groups(); ++g) {
    const KvView view = view_in(id, g);
    if (g > 0 && view.end_position() != static_cast<std::int64_t>(tokens.size()))
      return fmt::format("sequence {} group {}: view ends at {}, it has {} tokens", id, g,
                         view.end_position(), tokens.size());
    for (std::int64_t i = 0; i < view.length(); ++i) {
      const std::int64_t p = view.position_at(i), slot = view.slot_at(i);
      if (slot < 0 || slot >= options_.slots)
        return fmt::format("sequence {} position {}: slot {} outside the pool", id, p, slot);
      const float expected = group_value(tokens, static_cast<std::size_t>(p), g);
      if (*pool_.key(0, slot) != expected)
        return fmt::format("sequence {} group {} position {} slot {}: KV overwritten", id, g, p,
                           slot);
      ++holders[slot];
      const auto [it, inserted] = value_of_slot.try_emplace(slot, expected);
      if (!inserted && it->second != expected)
        return fmt::format("slot {} shared by different prefixes (or groups)", slot);
    }
  }
  return "";
}

// The pool map (kvlab view's) agrees with the stats and the views: runs in order inside the
// pool; live KV (used, shared, copied) adds up to `used` and covers every view's slots, a slot
// in several views drawn shared; reserved, slack and cached add up to their stats.
std::string ConformanceRun::check_pool_map(
    const KvAllocatorStats& s, const std::unordered_map<std::int64_t, int>& holders) const {
  if (features_.drawing == nullptr) return "";
  KvPoolMap map;
  features_.drawing->pool_map(map);
  std::int64_t end = 0, live = 0;
  std::int64_t by_state[6] = {};
  std::unordered_map<std::int64_t, KvSlotState> state_of_slot;
  for (const KvSlotRun& run : map.runs) {
    if (run.start < end || run.length <= 0 || run.start + run.length > s.capacity)
      return fmt::format("pool_map: run [{}, +{}) out of order, empty or outside the pool",
                         run.start, run.length);
    end = run.start + run.length;
    by_state[static_cast<int>(run.state)] += run.length;
    const bool holds_live = run.state == KvSlotState::used || run.state == KvSlotState::shared ||
                            run.state == KvSlotState::copied;
    if (holds_live && !tokens_.count(run.owner))
      return fmt::format("pool_map: {} run at slot {} owned by {}, not a live sequence",
                         slot_state_name(run.state), run.start, run.owner);
    if (holds_live) {
      live += run.length;
      for (std::int64_t slot = run.start; slot < end; ++slot) state_of_slot[slot] = run.state;
    }
  }
  auto total = [&](KvSlotState st) { return by_state[static_cast<int>(st)]; };
  if (live != s.used || total(KvSlotState::reserved) != s.reserved_unused ||
      total(KvSlotState::slack) != s.last_block_slack ||
      total(KvSlotState::cached) != s.cached_free)
    return fmt::format(
        "pool_map draws live {} reserved {} slack {} cached {}; the stats say used {} reserved "
        "{} slack {} cached {}",
        live, total(KvSlotState::reserved), total(KvSlotState::slack), total(KvSlotState::cached),
        s.used, s.reserved_unused, s.last_block_slack, s.cached_free);
  for (const auto& [slot, count] : holders) {
    const auto it = state_of_slot.find(slot);
    if (it == state_of_slot.end())
      return fmt::format("pool_map: live slot {} is not drawn as live KV", slot);
    if (count > 1 && it->second != KvSlotState::shared)
      return fmt::format("pool_map: slot {} is in {} views but drawn {}", slot, count,
                         slot_state_name(it->second));
  }
  return "";
}

// Everything freed: every slot and reference count returns, free runs coalesce.
std::string ConformanceRun::check_all_returned() const {
  const KvAllocatorStats s = allocator_->stats();
  if (s.used != 0 || s.free != s.capacity || s.live_sequences != 0)
    return fmt::format("after freeing everything: used {}, free {} of {}, {} live", s.used, s.free,
                       s.capacity, s.live_sequences);
  if (s.unusable_free != 0)
    return fmt::format("after freeing everything: {} unusable free slots (runs not coalesced)",
                       s.unusable_free);
  return "";
}

}  // namespace

ConformanceReport check_allocator_conformance(
    const PluginRegistry& registry, std::string_view allocator,
    const std::map<std::string, ParamValue, std::less<>>& params,
    const ConformanceOptions& options) {
  ConformanceReport report;
  for (unsigned seed : options.seeds) {
    ConformanceRun run(registry, allocator, params, options, seed);
    if (std::string failure = run.run(report); !failure.empty())
      report.failures.push_back(fmt::format("seed {}: {}", seed, failure));
  }
  return report;
}

}  // namespace kvlab
