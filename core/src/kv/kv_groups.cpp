#include "kvlab/kv/kv_groups.hpp"

#include <fmt/format.h>

#include <algorithm>
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

AllocateRequest GroupedKvAllocator::group_request(const AllocateRequest& request,
                                                  std::int64_t group) const {
  AllocateRequest r = request;
  r.sequence = inner_id(request.sequence, group);
  r.prefix_hashes = nullptr;  // no prefix caching with groups (kv_groups.hpp)
  return r;
}

std::optional<AllocateResult> GroupedKvAllocator::allocate(const AllocateRequest& request) {
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    if (!inner_.allocate(group_request(request, g))) {
      for (std::int64_t done = 0; done < g; ++done) inner_.free(inner_id(request.sequence, done));
      return std::nullopt;
    }
  lengths_[request.sequence] = static_cast<std::int64_t>(request.prompt.size());
  return AllocateResult{};
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
      case PlannedOp::allocate:
        planned = inner_.plan_allocate(group_request(op.request, g));
        break;
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
  return plan_groups({PlannedOp::allocate, request, 0});
}

bool GroupedKvAllocator::plan_append(SequenceId sequence, std::int64_t tokens) const {
  PlannedOp op{PlannedOp::append, {}, tokens};
  op.request.sequence = sequence;
  return plan_groups(op);
}

std::int64_t GroupedKvAllocator::slots_to_allocate(const AllocateRequest& request) const {
  std::int64_t slots = 0;
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    slots += inner_.slots_to_allocate(group_request(request, g));
  return slots;
}

KvAllocatorStats GroupedKvAllocator::stats() const {
  KvAllocatorStats s = inner_.stats();
  s.live_sequences = static_cast<std::int64_t>(lengths_.size());
  return s;
}

KvAllocatorFeatures GroupedKvAllocator::features() {
  KvAllocatorFeatures f;
  if (inner_features_.dropping != nullptr) f.dropping = this;
  if (inner_features_.rollback != nullptr) f.rollback = this;
  if (inner_features_.drawing != nullptr) f.drawing = this;
  f.groups = this;
  return f;
}

void GroupedKvAllocator::release_before(SequenceId sequence, std::int64_t position) {
  for (std::int64_t g = 0; g < groups_.count(); ++g)
    inner_features_.dropping->release_before(inner_id(sequence, g), position);
}

void GroupedKvAllocator::pool_map(KvPoolMap& map) const {
  inner_features_.drawing->pool_map(map);
  for (KvSlotRun& run : map.runs)
    if (run.owner >= 0) run.owner = outer_id(run.owner).first;
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
