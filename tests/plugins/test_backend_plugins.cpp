// Every backend is a plugin made by one factory (PluginRegistry::create<PluginKind::backend>)
// from the core's ModelWeightsView: the cpu plugin computes bit for bit what CpuBackend computes
// on the same weights, bringing host storage to a bookkeeping pool; the simulated plugin picks
// SimulatedBackend's tokens; a backend without what it needs says so.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "cpu_reference/test_models.hpp"
#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/model_weights.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "plugin_registry.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

const cpu::LlamaWeights& tiny_weights() {
  static const cpu::LlamaWeights w = test::scaled_random_weights(model_preset("tiny"), 5);
  return w;
}

KvPoolShape pool_shape(const ModelConfig& c, std::int64_t slots) {
  return {c.num_hidden_layers, c.num_key_value_heads, c.head_dim, slots};
}

// Two entries: a 5-token prefill in slots [0, 5) and a 1-token step at position 3 of a sequence
// whose earlier 3 tokens sit in slots [8, 11) (zeros: the pools start zeroed).
struct TwoEntries {
  std::vector<std::int32_t> prompt{3, 1, 4, 1, 5};
  std::vector<std::int32_t> decode{9};
  std::vector<BatchEntry> batch;
  TwoEntries() {
    batch.push_back({prompt, 0, KvView{{{0, 5}}, 0, {}}});
    batch.push_back({decode, 3, KvView{{{8, 4}}, 0, {}}});
  }
};

std::vector<float> logits_of(const ForwardResult& result) {
  return {result.logits.begin(), result.logits.end()};
}

TEST(BackendPlugins, CpuPluginComputesWhatTheCpuBackendComputes) {
  const cpu::LlamaWeights& w = tiny_weights();
  const ModelConfig& c = w.config;
  const ModelWeightsView view = cpu::weights_view(w);
  KvPool plugin_pool(pool_shape(c, 16), KvStorage::none);  // as the serving stack makes it
  PluginContext context;
  context.model = &c;
  context.pool = &plugin_pool;
  context.weights = &view;
  PluginObject<Backend> plugin = test::plugin_registry().create<PluginKind::backend>(
      "cpu", {{"weights", std::string("f32")}}, context);
  EXPECT_TRUE(plugin_pool.has_storage());  // the plugin brought host storage
  EXPECT_EQ(plugin->vocab_size(), c.vocab_size);
  EXPECT_EQ(plugin->description(), "f32");

  KvPool direct_pool(pool_shape(c, 16));
  cpu::CpuBackend direct(w, direct_pool, std::nullopt);
  const TwoEntries entries;
  const std::vector<float> from_plugin = logits_of(plugin->forward(entries.batch, {}));
  const std::vector<float> from_direct = logits_of(direct.forward(entries.batch, {}));
  ASSERT_EQ(from_plugin.size(), static_cast<std::size_t>(2 * c.vocab_size));
  EXPECT_EQ(from_plugin, from_direct);  // the same code on the same values: bit for bit
  std::vector<float> plugin_row(static_cast<std::size_t>(c.kv_dim())), direct_row = plugin_row;
  for (std::int64_t slot : {0, 4, 11}) {  // K/V written where the views say, in both pools
    plugin_pool.read_row(c.num_hidden_layers - 1, slot, true, plugin_row.data());
    direct_pool.read_row(c.num_hidden_layers - 1, slot, true, direct_row.data());
    EXPECT_EQ(plugin_row, direct_row) << "slot " << slot;
  }
  plugin_pool.read_row(0, 0, false, plugin_row.data());
  EXPECT_NE(plugin_row, std::vector<float>(plugin_row.size(), 0.0f));
}

TEST(BackendPlugins, CpuPluginParametersChooseTheFormats) {
  const cpu::LlamaWeights& w = tiny_weights();
  const ModelWeightsView view = cpu::weights_view(w);
  KvPool pool(pool_shape(w.config, 16), KvStorage::none);
  PluginContext context;
  context.model = &w.config;
  context.pool = &pool;
  context.weights = &view;
  const auto q8 = test::plugin_registry().create<PluginKind::backend>(
      "cpu", {{"weights", std::string("q8_0")}, {"activations", std::string("q8")}}, context);
  EXPECT_NE(q8->description().find("q8_0"), std::string::npos) << q8->description();
  EXPECT_NE(q8->description().find("8-bit activations"), std::string::npos) << q8->description();
  test::expect_error_containing(
      [&] {
        (void)test::plugin_registry().create<PluginKind::backend>(
            "cpu", {{"weights", std::string("q5_k")}}, context);
      },
      {"cpu", "unknown weight format \"q5_k\"", "q4_1"});
}

TEST(BackendPlugins, SimulatedPluginPicksTheSimulatedBackendsTokens) {
  ModelConfig c = model_preset("tiny");
  c.eos_token_ids = {2};
  KvPool pool(pool_shape(c, 16), KvStorage::none);
  PluginContext context;
  context.model = &c;
  context.pool = &pool;  // no weights: the simulated backend computes nothing
  PluginObject<Backend> plugin =
      test::plugin_registry().create<PluginKind::backend>("simulated", {}, context);
  EXPECT_FALSE(pool.has_storage());
  SimulatedBackend direct(c.vocab_size, c.eos_token_ids);
  const TwoEntries entries;
  const ForwardResult result = plugin->forward(entries.batch, {});
  ASSERT_EQ(result.tokens.size(), 2u);
  EXPECT_TRUE(result.logits.empty());
  EXPECT_EQ(result.tokens[0], direct.token_after(5, 4));
  EXPECT_EQ(result.tokens[1], direct.token_after(9, 3));
}

TEST(BackendPlugins, ABackendWithoutWhatItNeedsSaysSo) {
  const ModelConfig c = model_preset("tiny");
  KvPool pool(pool_shape(c, 16), KvStorage::none);
  PluginContext context;
  context.model = &c;
  context.pool = &pool;
  test::expect_error_containing(
      [&] { (void)test::plugin_registry().create<PluginKind::backend>("cpu", {}, context); },
      {"backend plugin \"cpu\"", "needs the model weights"});
  PluginContext no_model;
  test::expect_error_containing(
      [&] { (void)test::plugin_registry().create<PluginKind::backend>("simulated", {}, no_model); },
      {"simulated backend: needs the model"});
}

}  // namespace
}  // namespace kvlab
