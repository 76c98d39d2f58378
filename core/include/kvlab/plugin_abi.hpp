#pragma once
// The plugin ABI fingerprint: a hash of the size, alignment and member offsets of every type
// that crosses the plugin boundary, plus the hand-kept ABI version. A plugin records the value
// its headers gave at build time; the loader refuses one whose fingerprint differs from its own
// (a field added to ModelConfig, RequestState or StepPlan changes it without anyone
// remembering to bump a number). Virtual interfaces are covered by kPluginAbiVersion.
#include <cstddef>
#include <cstdint>

#include "kvlab/attention_variant.hpp"
#include "kvlab/backend.hpp"
#include "kvlab/kv/block_table.hpp"
#include "kvlab/kv/kv_tiers.hpp"
#include "kvlab/kv_allocator.hpp"
#include "kvlab/kv_policy.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/model_weights.hpp"
#include "kvlab/plugin_params.hpp"
#include "kvlab/proposer.hpp"
#include "kvlab/router.hpp"
#include "kvlab/scheduler.hpp"

namespace kvlab {

// Bump on any change to the descriptor, PluginContext, or a plugin interface's vtable, and add
// the version's line to docs/writing-a-plugin.md#abi-history (what each version changed).
inline constexpr std::uint32_t kPluginAbiVersion = 23;

namespace detail {

struct Fnv1a {
  std::uint64_t hash = 14695981039346656037ull;
  constexpr Fnv1a& mix(std::uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xff;
      hash *= 1099511628211ull;
    }
    return *this;
  }
  template <typename T>
  constexpr Fnv1a& type() {
    return mix(sizeof(T)).mix(alignof(T));
  }
};

}  // namespace detail

#define KVLAB_ABI_MEMBER(T, M) mix(offsetof(T, M)).mix(sizeof(T::M))

// Evaluated in each plugin and in the host from the headers each was built with.
constexpr std::uint64_t plugin_abi_fingerprint() {
  detail::Fnv1a h;
  h.mix(kPluginAbiVersion);
#if defined(_GLIBCXX_USE_CXX11_ABI)
  h.mix(_GLIBCXX_USE_CXX11_ABI);  // std::string and std::list layouts
#endif
  h.type<ModelConfig>().type<RopeScaling>().type<ParamSpec>().type<PluginParams>();
  h.type<KvPoolShape>().type<KvPool>().type<KvExtent>().type<KvView>().type<BatchEntry>();
  h.type<AllocateRequest>().type<AllocateResult>().type<KvAllocatorStats>();
  h.type<RequestState>().type<SwapBuffer>().type<SchedulerInput>().type<StepPlan>();
  h.type<Preemption>().type<Work>().type<Deferral>();
  h.type<ReplicaLoad>().type<RouteRequest>().type<RouteDecision>().type<TokenChoice>();
  h.type<KvPolicyStep>().type<BackendCounters>().type<TokenLogprob>().type<ForwardResult>();
  h.type<ProposeAsk>();
  h.type<WeightMatrixView>().type<LayerWeightsView>().type<ModelWeightsView>();
  h.type<KvSlotRun>().type<KvPoolMap>().KVLAB_ABI_MEMBER(KvSlotRun, group);
  h.KVLAB_ABI_MEMBER(KvAllocatorStats, capacity).KVLAB_ABI_MEMBER(KvAllocatorStats, used);
  h.KVLAB_ABI_MEMBER(KvAllocatorStats, free).KVLAB_ABI_MEMBER(KvAllocatorStats, live_sequences);
  h.KVLAB_ABI_MEMBER(KvAllocatorStats, host_hit_tokens);
  h.KVLAB_ABI_MEMBER(KvAllocatorStats, tier_copy_seconds);
  h.type<KvTierSpec>().type<KvTierBlockFacts>().type<KvTierHit>().type<KvTierCounters>();
  h.type<BlockHashIndex>().type<BlockPool>();  // the core's paged-cache parts plugins embed
  h.type<BlockTable>().type<PagedBlocks>().type<KvAllocatorFeatures>();
  h.type<EvictionQueue>().type<OrderedTierPolicy>();
  h.KVLAB_ABI_MEMBER(Work, id).KVLAB_ABI_MEMBER(Work, new_tokens);
  h.KVLAB_ABI_MEMBER(Preemption, id).KVLAB_ABI_MEMBER(Preemption, mode);
  h.KVLAB_ABI_MEMBER(AllocateRequest, prompt).KVLAB_ABI_MEMBER(AllocateRequest, max_total_tokens);
  h.KVLAB_ABI_MEMBER(AllocateRequest, prefix_hashes).type<PrefixHashCache>();
  h.KVLAB_ABI_MEMBER(KvPoolShape, layers).KVLAB_ABI_MEMBER(KvPoolShape, slots);
  h.KVLAB_ABI_MEMBER(SchedulerInput, running).KVLAB_ABI_MEMBER(SchedulerInput, kv);
  h.KVLAB_ABI_MEMBER(StepPlan, deferred).KVLAB_ABI_MEMBER(StepPlan, pad_finished);
  h.KVLAB_ABI_MEMBER(TokenChoice, uniform).KVLAB_ABI_MEMBER(TokenChoice, top_k);
  h.KVLAB_ABI_MEMBER(TokenChoice, logprobs).KVLAB_ABI_MEMBER(TokenLogprob, logprob);
  h.KVLAB_ABI_MEMBER(BackendCounters, graph_replays);
  h.KVLAB_ABI_MEMBER(ForwardResult, tokens).KVLAB_ABI_MEMBER(ForwardResult, logprob_width);
  h.KVLAB_ABI_MEMBER(LayerWeightsView, mlp_post_norm).KVLAB_ABI_MEMBER(ModelWeightsView, source);
  return h.hash;
}

#undef KVLAB_ABI_MEMBER

}  // namespace kvlab
