// KV groups (kvlab/kv/kv_groups.hpp): how a local:global model's layers share pool slots, and
// the grouped allocator's bookkeeping over a real allocator plugin (its contracts: the
// conformance suite under groups, tests/plugins/allocators/).
#include <gtest/gtest.h>

#include "kvlab/kv/kv_groups.hpp"
#include "kvlab/model_config.hpp"

namespace kvlab {
namespace {

// Gemma 3 27B: 10 global layers (5, 11, ..., 59) in one group, 52 local ones in six groups of
// 10, the last of them 8 layers short; layer -> (group, pool layer) both ways.
TEST(KvLayerGroups, Gemma3LayersGroupByKindInGroupsOfTheSmallerKind) {
  const ModelConfig m = model_preset("gemma3-27b");
  const KvLayerGroups g = kv_layer_groups(m, true);
  EXPECT_EQ(g.group_layers, 10);
  ASSERT_EQ(g.count(), 7);
  EXPECT_EQ(g.padding_layers(), 8);
  EXPECT_EQ(g.groups[0].window, std::nullopt);
  EXPECT_EQ(g.groups[0].layers, (std::vector<std::int64_t>{5, 11, 17, 23, 29, 35, 41, 47, 53, 59}));
  for (std::size_t i = 1; i < 7; ++i) EXPECT_EQ(g.groups[i].window, 1024) << i;
  EXPECT_EQ(g.groups[6].layers.size(), 2u);
  for (std::int64_t l = 0; l < m.num_hidden_layers; ++l) {
    const auto& group =
        g.groups[static_cast<std::size_t>(g.group_of_layer[static_cast<std::size_t>(l)])];
    EXPECT_EQ(group.layers[static_cast<std::size_t>(g.pool_layer[static_cast<std::size_t>(l)])], l);
    EXPECT_EQ(group.window, m.layer_window(l)) << l;
  }
  // The same bytes: 155,648 slots of 62 layers are 965,017.6 slots of 10, whole blocks of 256.
  EXPECT_EQ(g.slots_for_bytes_of(155648, 62), 964864);
}

// One group of every layer unless asked, and for a model of one kind whatever is asked.
TEST(KvLayerGroups, UniformUnlessAskedAndTwoKindsExist) {
  const KvLayerGroups tiny = kv_layer_groups(model_preset("gemma3-tiny"), true);
  EXPECT_EQ(tiny.group_layers, 1);
  EXPECT_EQ(tiny.count(), 6);
  EXPECT_EQ(tiny.slots_for_bytes_of(2048, 6), 12288);
  const KvLayerGroups uniform = kv_layer_groups(model_preset("gemma3-tiny"), false);
  EXPECT_TRUE(uniform.uniform());
  EXPECT_EQ(uniform.group_layers, 6);
  EXPECT_EQ(uniform.groups[0].window, std::nullopt);  // layers of two kinds share its slots
  EXPECT_EQ(uniform.slots_for_bytes_of(2048, 6), 2048);
  EXPECT_TRUE(kv_layer_groups(model_preset("llama2-7b"), true).uniform());
  const KvLayerGroups mistral = kv_layer_groups(model_preset("mistral-7b"), true);
  EXPECT_TRUE(mistral.uniform());
  EXPECT_EQ(mistral.groups[0].window, 4096);
}

}  // namespace
}  // namespace kvlab
