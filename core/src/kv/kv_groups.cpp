#include "kvlab/kv/kv_groups.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "kvlab/error.hpp"

namespace kvlab {

std::int64_t KvLayerGroups::padding_layers() const {
  std::int64_t used = 0;
  for (const KvLayerGroup& g : groups) used += static_cast<std::int64_t>(g.layers.size());
  return count() * group_layers - used;
}

std::int64_t KvLayerGroups::slots_held(std::int64_t tokens, std::int64_t block) const {
  std::int64_t slots = 0;
  for (const KvLayerGroup& g : groups)
    slots += g.window ? std::min(tokens, *g.window + block) : tokens;
  return slots;
}

std::int64_t KvLayerGroups::slots_for_bytes_of(std::int64_t uniform_slots,
                                               std::int64_t model_layers) const {
  if (uniform() || uniform_slots <= 0) return uniform_slots;
  // Whole blocks as the uniform count has them: a multiple of its largest power-of-two divisor
  // up to 256 (a block size that divides it divides the result).
  std::int64_t unit = 1;
  while (unit < 256 && uniform_slots % (2 * unit) == 0) unit *= 2;
  return std::max<std::int64_t>(unit, uniform_slots * model_layers / group_layers / unit * unit);
}

KvLayerGroups kv_layer_groups(const ModelConfig& model, bool per_kind) {
  const std::int64_t layers = model.num_hidden_layers;
  // The layers of each kind, by window (nullopt first: the global ones), in layer order.
  std::map<std::optional<std::int64_t>, std::vector<std::int64_t>> kinds;
  for (std::int64_t l = 0; l < layers; ++l) kinds[model.layer_window(l)].push_back(l);
  KvLayerGroups out;
  if (!per_kind || kinds.size() < 2) {
    KvLayerGroup all{{}, model.layer_window(0)};
    for (std::int64_t l = 0; l < layers; ++l) all.layers.push_back(l);
    if (kinds.size() > 1) all.window = std::nullopt;  // layers of two kinds share slots
    out.groups.push_back(std::move(all));
    out.group_layers = layers;
  } else {
    out.group_layers = layers;
    for (const auto& [window, kind] : kinds)
      out.group_layers = std::min(out.group_layers, static_cast<std::int64_t>(kind.size()));
    for (const auto& [window, kind] : kinds)
      for (std::size_t first = 0; first < kind.size();
           first += static_cast<std::size_t>(out.group_layers)) {
        const std::size_t end =
            std::min(kind.size(), first + static_cast<std::size_t>(out.group_layers));
        out.groups.push_back(
            {{kind.begin() + static_cast<long>(first), kind.begin() + static_cast<long>(end)},
             window});
      }
  }
  out.group_of_layer.assign(static_cast<std::size_t>(layers), 0);
  out.pool_layer.assign(static_cast<std::size_t>(layers), 0);
  for (std::size_t g = 0; g < out.groups.size(); ++g)
    for (std::size_t j = 0; j < out.groups[g].layers.size(); ++j) {
      const auto l = static_cast<std::size_t>(out.groups[g].layers[j]);
      out.group_of_layer[l] = static_cast<std::int64_t>(g);
      out.pool_layer[l] = static_cast<std::int64_t>(j);
    }
  return out;
}

GroupedKvAllocator::GroupedKvAllocator(KvAllocator& inner, KvLayerGroups groups)
    : inner_(inner), groups_(std::move(groups)), inner_features_(inner.features()) {
  if (groups_.groups.empty() || groups_.groups[0].window)
    throw Error("internal: KV groups must start with a global group (the sequence's view)");
}

namespace {

// Group `group`'s chain start: the request's salt for group 0, a salt of its own for every other
// (no token id is negative, so the marker block is no prompt's).
std::uint64_t group_salt(std::uint64_t request_salt, std::int64_t group) {
  if (group == 0) return request_salt;
  const std::int32_t marker[] = {-1 - static_cast<std::int32_t>(group)};
  return chain_block_hash(request_salt, marker);
}

// The chain start of a plan's lookups: no block is cached under it.
std::uint64_t no_hit_salt() {
  const std::int32_t marker[] = {std::numeric_limits<std::int32_t>::min()};
  return chain_block_hash(0, marker);
}

}  // namespace

std::vector<PrefixHashCache> GroupedKvAllocator::group_hashes(
    const AllocateRequest& request) const {
  const std::uint64_t salt = request.prefix_hashes != nullptr ? request.prefix_hashes->salt : 0;
  std::vector<PrefixHashCache> hashes(static_cast<std::size_t>(groups_.count()));
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    hashes[static_cast<std::size_t>(g)].salt = group_salt(salt, g);
  return hashes;
}

AllocateRequest GroupedKvAllocator::group_request(const AllocateRequest& request,
                                                  std::int64_t group,
                                                  std::vector<PrefixHashCache>& hashes) const {
  AllocateRequest r = request;
  r.sequence = inner_id(request.sequence, group);
  if (group > 0 || r.prefix_hashes == nullptr)
    r.prefix_hashes = &hashes[static_cast<std::size_t>(group)];
  return r;
}

// Each group's cached prefix now (0 each when the plugin looks nothing up).
std::vector<std::int64_t> GroupedKvAllocator::group_hits(
    const AllocateRequest& request, std::vector<PrefixHashCache>& hashes) const {
  std::vector<std::int64_t> hits(static_cast<std::size_t>(groups_.count()), 0);
  if (inner_features_.prefix_lookup != nullptr)
    for (std::int64_t g = 0; g < groups_.count(); ++g)
      hits[static_cast<std::size_t>(g)] =
          inner_features_.prefix_lookup->cached_prefix_tokens(group_request(request, g, hashes));
  return hits;
}

// The prompt's hit is what every group holds: the least of the groups' hits, each group's blocks
// of it held first (a group's fresh block would otherwise reuse a free cached block another
// group's hit counted on). Admitted only when every group could hold the prompt without a hit,
// as plan_allocate promises (a plan cannot know which hits the groups will share once the step's
// earlier operations ran).
std::optional<AllocateResult> GroupedKvAllocator::allocate(const AllocateRequest& request) {
  std::vector<PrefixHashCache> hashes = group_hashes(request);
  const std::vector<std::int64_t> hits = group_hits(request, hashes);
  const std::int64_t hit = *std::min_element(hits.begin(), hits.end());
  if (*std::max_element(hits.begin(), hits.end()) > 0 &&
      slots_without_hits(request) > inner_.stats().free)
    return std::nullopt;
  KvPrefixLookup* lookup = inner_features_.prefix_lookup;
  for (std::int64_t g = 0; hit > 0 && g < groups_.count(); ++g)
    lookup->hold_prefix(group_request(request, g, hashes), hit);
  const std::optional<std::int64_t> held = allocate_groups(request, hashes, hits, hit);
  for (std::int64_t g = 0; hit > 0 && g < groups_.count(); ++g)
    lookup->release_prefix(group_request(request, g, hashes), hit);
  if (!held) return std::nullopt;
  if (*held != hit)
    throw Error(
        fmt::format("internal: a KV group of sequence {} found {} of the {} cached tokens "
                    "every group held",
                    request.sequence, *held, hit));
  lengths_[request.sequence] = static_cast<std::int64_t>(request.prompt.size());
  prefix_query_tokens_ += static_cast<std::int64_t>(request.prompt.size());
  prefix_hit_tokens_ += hit;
  return AllocateResult{hit};
}

// Every group's allocation, its hit cut to `hit`: a group that holds more (hits[g] > hit) starts
// from the prompt's first hit + 1 tokens, whose lookup can find no more, and appends the rest.
// Returns the least hit a group got; nullopt, nothing held, when a group did not fit.
std::optional<std::int64_t> GroupedKvAllocator::allocate_groups(
    const AllocateRequest& request, std::vector<PrefixHashCache>& hashes,
    std::span<const std::int64_t> hits, std::int64_t hit) {
  std::int64_t least = hit;
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    AllocateRequest r = group_request(request, g, hashes);
    const bool cut = hits[static_cast<std::size_t>(g)] > hit;  // then hit + 1 < prompt size
    if (cut) r.prompt = request.prompt.first(static_cast<std::size_t>(hit + 1));
    std::optional<AllocateResult> got = inner_.allocate(r);
    if (got && cut &&
        !inner_.append(r.sequence, request.prompt.subspan(static_cast<std::size_t>(hit + 1)))) {
      inner_.free(r.sequence);
      got.reset();
    }
    if (!got) {
      for (std::int64_t done = 0; done < g; ++done) inner_.free(inner_id(request.sequence, done));
      return std::nullopt;
    }
    least = std::min(least, got->cached_tokens);
  }
  return least;
}

// A sliding group's positions before length - window are read by no query from here on (this
// step's first query is at `length`): its plugin may free them (paged: whole blocks).
void GroupedKvAllocator::release_window(SequenceId sequence, std::int64_t length) {
  if (inner_features_.dropping == nullptr) return;
  for (std::int64_t g = 1; g < groups_.count(); ++g)
    if (const auto window = groups_.groups[static_cast<std::size_t>(g)].window;
        window && length - *window > 0)
      inner_features_.dropping->release_before(inner_id(sequence, g), length - *window);
}

bool GroupedKvAllocator::append(SequenceId sequence, std::span<const std::int32_t> tokens) {
  const auto it = lengths_.find(sequence);
  if (it == lengths_.end()) return false;
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    if (inner_.append(inner_id(sequence, g), tokens)) continue;
    if (g > 0 && inner_features_.rollback == nullptr)
      throw Error(
          fmt::format("internal: group {} of sequence {} had no room for a planned append and the "
                      "allocator cannot roll the other groups back",
                      g, sequence));
    for (std::int64_t done = 0; done < g; ++done)
      inner_features_.rollback->truncate(inner_id(sequence, done), it->second);
    return false;
  }
  // After the appends, so that they meet the state plan_append saw: the freed blocks serve the
  // step's later operations (their plans saw them held: conservative, never a broken promise).
  release_window(sequence, it->second);
  it->second += static_cast<std::int64_t>(tokens.size());
  return true;
}

void GroupedKvAllocator::mark_computed(SequenceId sequence, std::int64_t computed_tokens) {
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    inner_.mark_computed(inner_id(sequence, g), computed_tokens);
}

void GroupedKvAllocator::free(SequenceId sequence) {
  for (std::int64_t g = 0; g < groups_.count(); ++g) inner_.free(inner_id(sequence, g));
  lengths_.erase(sequence);
}

void GroupedKvAllocator::plan_reset() const {
  inner_.plan_reset();
  plan_.clear();
}

// Plans the op in every group; when a group refuses, the plugin's scratch is rebuilt from what
// was planned before (plan_* that fail change nothing, but the earlier groups' succeeded).
bool GroupedKvAllocator::plan_groups(const PlannedOp& op) const {
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    bool planned = true;
    switch (op.kind) {
      case PlannedOp::free:
        inner_.plan_free(inner_id(op.request.sequence, g));
        break;
      case PlannedOp::allocate: {
        AllocateRequest r = op.request;
        r.sequence = inner_id(op.request.sequence, g);
        r.prefix_hashes = op.no_hits.get();
        planned = inner_.plan_allocate(r);
        break;
      }
      case PlannedOp::append:
        planned = inner_.plan_append(inner_id(op.request.sequence, g), op.tokens);
        break;
    }
    if (!planned) {
      if (g > 0) replay_plan();
      return false;
    }
  }
  plan_.push_back(op);
  return true;
}

void GroupedKvAllocator::replay_plan() const {
  std::vector<PlannedOp> ops;
  ops.swap(plan_);
  inner_.plan_reset();
  for (const PlannedOp& op : ops)
    if (!plan_groups(op)) throw Error("internal: a replayed KV group plan was refused");
}

void GroupedKvAllocator::plan_free(SequenceId sequence) const {
  PlannedOp op{PlannedOp::free, {}, 0};
  op.request.sequence = sequence;
  plan_groups(op);
}

bool GroupedKvAllocator::plan_allocate(const AllocateRequest& request) const {
  auto no_hits = std::make_shared<PrefixHashCache>();
  no_hits->salt = no_hit_salt();
  return plan_groups({PlannedOp::allocate, request, 0, std::move(no_hits)});
}

bool GroupedKvAllocator::plan_append(SequenceId sequence, std::int64_t tokens) const {
  PlannedOp op{PlannedOp::append, {}, tokens};
  op.request.sequence = sequence;
  return plan_groups(op);
}

// The slots every group's allocation would take if nothing were cached.
std::int64_t GroupedKvAllocator::slots_without_hits(const AllocateRequest& request) const {
  PrefixHashCache none;
  none.salt = no_hit_salt();
  std::int64_t slots = 0;
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    AllocateRequest r = request;
    r.sequence = inner_id(request.sequence, g);
    r.prefix_hashes = &none;
    slots += inner_.slots_to_allocate(r);
  }
  return slots;
}

// What allocate takes: each group's slots with its hit cut to the common one (a cut group: its
// first hit + 1 tokens with their hits, and the rest as fresh slots, what the plugin takes for
// the prompt without hits less what it takes for those tokens without hits).
std::int64_t GroupedKvAllocator::slots_to_allocate(const AllocateRequest& request) const {
  std::vector<PrefixHashCache> hashes = group_hashes(request);
  const std::vector<std::int64_t> hits = group_hits(request, hashes);
  const std::int64_t hit = *std::min_element(hits.begin(), hits.end());
  PrefixHashCache none;
  none.salt = no_hit_salt();
  std::int64_t slots = 0;
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    AllocateRequest r = group_request(request, g, hashes);
    if (hits[static_cast<std::size_t>(g)] <= hit) {
      slots += inner_.slots_to_allocate(r);
      continue;
    }
    AllocateRequest capped = r;
    capped.prompt = request.prompt.first(static_cast<std::size_t>(hit + 1));
    slots += inner_.slots_to_allocate(capped);
    r.prefix_hashes = capped.prefix_hashes = &none;
    slots += inner_.slots_to_allocate(r) - inner_.slots_to_allocate(capped);
  }
  return slots;
}

KvAllocatorStats GroupedKvAllocator::stats() const {
  KvAllocatorStats s = inner_.stats();
  s.live_sequences = static_cast<std::int64_t>(lengths_.size());
  // A request's prompt once, its hit the one every group holds (the plugin counts each group's
  // lookups, cut ones and retries included); none when the plugin caches no prefix.
  if (s.prefix_query_tokens > 0) {
    s.prefix_query_tokens = prefix_query_tokens_;
    s.prefix_hit_tokens = prefix_hit_tokens_;
  }
  return s;
}

KvAllocatorFeatures GroupedKvAllocator::features() {
  KvAllocatorFeatures f;
  if (inner_features_.dropping != nullptr) {
    f.dropping = this;
    f.group_dropping = this;
  }
  if (inner_features_.rollback != nullptr) f.rollback = this;
  if (inner_features_.drawing != nullptr) f.drawing = this;
  f.groups = this;
  return f;
}

void GroupedKvAllocator::release_before(SequenceId sequence, std::int64_t position) {
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    inner_features_.dropping->release_before(inner_id(sequence, g), position);
}

bool GroupedKvAllocator::evict(SequenceId sequence, std::span<const std::int64_t> kept) {
  const std::vector<std::vector<std::int64_t>> groups(
      static_cast<std::size_t>(groups_.count()),
      std::vector<std::int64_t>(kept.begin(), kept.end()));
  return evict_groups(sequence, groups);
}

bool GroupedKvAllocator::evict_groups(SequenceId sequence,
                                      std::span<const std::vector<std::int64_t>> kept) {
  if (inner_features_.dropping == nullptr || !lengths_.contains(sequence)) return false;
  if (static_cast<std::int64_t>(kept.size()) != groups_.count())
    throw Error(fmt::format("internal: {} kept lists for sequence {} of {} KV groups", kept.size(),
                            sequence, groups_.count()));
  std::vector<std::int64_t> held;  // group g's kept positions that its view holds
  for (std::int64_t g = 0; g < groups_.count(); ++g) {
    const KvView view = group_view(sequence, g);
    const std::int64_t length = view.length();
    held.clear();
    std::int64_t i = 0;  // both increasing: one walk
    for (const std::int64_t position : kept[static_cast<std::size_t>(g)]) {
      while (i < length && view.position_at(i) < position) ++i;
      if (i < length && view.position_at(i) == position) held.push_back(position);
    }
    if (static_cast<std::int64_t>(held.size()) == length) continue;  // nothing dropped
    if (inner_features_.dropping->evict(inner_id(sequence, g), held)) continue;
    if (g > 0)
      throw Error(
          fmt::format("internal: KV group {} of sequence {} refused an eviction its group 0 took",
                      g, sequence));
    return false;
  }
  return true;
}

void GroupedKvAllocator::pool_map(KvPoolMap& map) const {
  inner_features_.drawing->pool_map(map);
  for (KvSlotRun& run : map.runs) {
    if (run.owner < 0) continue;
    const auto [sequence, group] = outer_id(run.owner);
    run.owner = sequence;
    run.group = static_cast<std::int32_t>(group);
  }
}

bool GroupedKvAllocator::truncate(SequenceId sequence, std::int64_t length) {
  const auto it = lengths_.find(sequence);
  if (it == lengths_.end() || length > it->second) return false;
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    if (!inner_features_.rollback->truncate(inner_id(sequence, g), length)) {
      if (g > 0)
        throw Error(fmt::format(
            "internal: KV group {} of sequence {} refused a truncation its group 0 took", g,
            sequence));
      return false;
    }
  it->second = length;
  return true;
}

}  // namespace kvlab
