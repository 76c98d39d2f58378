#pragma once
// KV groups: a model's layers grouped by attention kind, each kind's layers in groups of the
// same size, so that one pool slot holds one token's K and V in the layers of one group,
// whatever the group (vLLM v1's hybrid KV cache manager: one block table per group over one
// block pool). A sequence holds slots in every group: a global group every position, a sliding
// group only the positions its window still reads (an allocator that drops positions frees the
// rest, KvPositionDropping). Gemma 3 270M: its 3 global layers are one group and its 15 local
// layers (window 512) five groups of 3, so a 32K-token sequence holds 32,768 + 5 x ~530 slots of
// 3 layers instead of 32,768 slots of 18: about 5x the sequences in the same bytes.
//
// GroupedKvAllocator runs any allocator plugin over such a pool: each (sequence, group) is a
// sequence of its own to the plugin, so every allocator handles groups unchanged; the sliding
// groups give back their old positions through the plugin's release_before (paged frees whole
// blocks; static and dynamic keep what they reserved). Prefix caching: each group's blocks hash
// under a salt of the group's own (a block of one group holds other layers than another's block
// of the same tokens), and a prompt's hit is the longest prefix every group still holds from its
// first block (KvPrefixLookup): a sliding group's old blocks stay cached after its window
// passed, until the pool reuses them; a group that holds more starts from that common hit. What
// it does not do yet: forks, swapping and handing KV to another replica; kvlab::validate refuses
// those with groups. A KV policy drops positions group by group (KvGroupDropping): a group frees
// what none of its layers keeps, group 0 (the global layers) what no layer keeps.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvlab/kv/prefix_hash.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {

struct KvLayerGroup {
  std::vector<std::int64_t> layers;    // model layers, ascending; at most group_layers of them
  std::optional<std::int64_t> window;  // the layers' window; nullopt: global
};

struct KvLayerGroups {
  std::int64_t group_layers = 0;  // layers one pool slot holds (KvPoolShape::layers)
  std::vector<KvLayerGroup> groups;
  std::vector<std::int64_t> group_of_layer;  // (model layers): each layer's group
  std::vector<std::int64_t> pool_layer;      // (model layers): its layer within the pool slot

  bool uniform() const { return groups.size() == 1; }
  std::int64_t count() const { return static_cast<std::int64_t>(groups.size()); }
  // Pool layers no model layer uses: a kind whose layer count is not a multiple of
  // group_layers leaves its last group short (bytes held, never written).
  std::int64_t padding_layers() const;
  // Pool slots a sequence of `tokens` positions holds at most while it decodes, blocks of
  // `block` slots: every position in a global group, min(tokens, window + block) in a sliding
  // group (its window and the block being filled; a prefill chunk more while it prefills).
  std::int64_t slots_held(std::int64_t tokens, std::int64_t block) const;
  // Slots of group_layers layers in the bytes of `uniform_slots` slots of every model layer,
  // rounded down to whole blocks of the largest power of two (up to 256) dividing uniform_slots.
  std::int64_t slots_for_bytes_of(std::int64_t uniform_slots, std::int64_t model_layers) const;
};

// One group of every layer (the uniform table) unless `per_kind` and the model has layers of
// two kinds (ModelConfig::layer_window): then the global layers and each window's layers form
// groups of the smaller kind's layer count (Gemma 3 270M: 3 global, 15 local -> 6 groups of 3;
// Gemma 3 27B: 10 global, 52 local -> 7 groups of 10, 8 pool layers of padding).
KvLayerGroups kv_layer_groups(const ModelConfig& model, bool per_kind);

class GroupedKvAllocator final : public KvAllocator,
                                 public KvGroupViewing,
                                 public KvPositionDropping,
                                 public KvGroupDropping,
                                 public KvRollback,
                                 public KvPoolDrawing {
 public:
  // `inner` (not owned) allocates over a pool of groups.group_layers layers.
  GroupedKvAllocator(KvAllocator& inner, KvLayerGroups groups);

  std::optional<AllocateResult> allocate(const AllocateRequest& request) override;
  bool append(SequenceId sequence, std::span<const std::int32_t> tokens) override;
  void mark_computed(SequenceId sequence, std::int64_t computed_tokens) override;
  void free(SequenceId sequence) override;

  void plan_reset() const override;
  void plan_free(SequenceId sequence) const override;
  bool plan_allocate(const AllocateRequest& request) const override;
  bool plan_append(SequenceId sequence, std::int64_t tokens) const override;

  std::int64_t slots_to_allocate(const AllocateRequest& request) const override;
  KvView view(SequenceId sequence) const override { return group_view(sequence, 0); }
  KvView positions_view(SequenceId sequence) const override {
    return inner_.positions_view(inner_id(sequence, 0));
  }
  KvAllocatorStats stats() const override;
  KvAllocatorFeatures features() override;

  const KvLayerGroups& layer_groups() const override { return groups_; }
  KvView group_view(SequenceId sequence, std::int64_t group) const override {
    return inner_.view(inner_id(sequence, group));
  }

  // Every group drops positions before `position` (an attention variant's window over every
  // layer).
  void release_before(SequenceId sequence, std::int64_t position) override;
  // A KV policy that keeps the same positions in every layer: every group keeps `kept`.
  bool evict(SequenceId sequence, std::span<const std::int64_t> kept) override;
  // A KV policy whose layers keep different positions: each group keeps those of its list its
  // view holds (a sliding group has let older ones go), group 0 first (the one that may refuse;
  // the others hold no prefix-cached or shared block it does not).
  bool evict_groups(SequenceId sequence, std::span<const std::vector<std::int64_t>> kept) override;
  bool truncate(SequenceId sequence, std::int64_t length) override;
  // The plugin's map, each run's owner the sequence (not the group's plugin id): kvlab view
  // colours a request's groups alike, each group's runs where its slots are.
  void pool_map(KvPoolMap& map) const override;

  // The plugin's id for `sequence`'s slots in `group`, and back.
  SequenceId inner_id(SequenceId sequence, std::int64_t group) const {
    return sequence * groups_.count() + group;
  }
  std::pair<SequenceId, std::int64_t> outer_id(SequenceId inner) const {
    return {inner / groups_.count(), inner % groups_.count()};
  }

 private:
  struct PlannedOp {
    enum Kind { free, allocate, append } kind;
    AllocateRequest request;  // allocate: the outer request
    std::int64_t tokens = 0;  // append
    // allocate: prompt hashes under a salt no block is cached with, shared by the groups' plans:
    // a plan counts no prefix hit (the commit's hits, cut to what every group holds, take fewer
    // blocks, never more).
    std::shared_ptr<PrefixHashCache> no_hits = nullptr;
  };
  // Each group's prompt hashes (its salt: group 0 the request's, the others their own), and the
  // request as group `group`'s plugin sequence with them (group 0: the request's own cache when
  // it has one).
  std::vector<PrefixHashCache> group_hashes(const AllocateRequest& request) const;
  AllocateRequest group_request(const AllocateRequest& request, std::int64_t group,
                                std::vector<PrefixHashCache>& hashes) const;
  std::vector<std::int64_t> group_hits(const AllocateRequest& request,
                                       std::vector<PrefixHashCache>& hashes) const;
  std::int64_t slots_without_hits(const AllocateRequest& request) const;
  std::optional<std::int64_t> allocate_groups(const AllocateRequest& request,
                                              std::vector<PrefixHashCache>& hashes,
                                              std::span<const std::int64_t> hits, std::int64_t hit);
  bool plan_groups(const PlannedOp& op) const;
  void replay_plan() const;
  void release_window(SequenceId sequence, std::int64_t length);

  KvAllocator& inner_;
  KvLayerGroups groups_;
  KvAllocatorFeatures inner_features_;
  std::unordered_map<SequenceId, std::int64_t> lengths_;          // each live sequence's positions
  std::int64_t prefix_query_tokens_ = 0, prefix_hit_tokens_ = 0;  // KvAllocatorStats' own
  mutable std::vector<PlannedOp> plan_;  // since plan_reset, what succeeded
};

}  // namespace kvlab
