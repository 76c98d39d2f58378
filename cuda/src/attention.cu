// Attention over the device KV pool, read through each sequence's block table (any allocator:
// paged blocks, or contiguous extents as one large block; block_table.hpp), with GQA/MQA head
// mapping and a sliding window.
//   decode  (one query): split-K flash-decoding, one block per (query heads of a K/V head, entry,
//           key split), partials combined by a second kernel. bf16 on tensor cores: the up to 16
//           query heads sharing a K/V head are the rows of mma.sync m16n8k16, so each K/V row is
//           read once for its whole group, and 32-key tiles stream through shared memory with
//           asynchronous copies, the next in flight while one is computed. Otherwise (fp32, the
//           check path; head_dim 256; unaligned pools; tensor_cores off; fp8 and int8 pools,
//           KvFormat) on CUDA cores: where a K/V row (compute or fp8) is a power of two 16-byte
//           chunks and the pool is 16-byte aligned, the
//           vectorized kernel (lanes of a warp split into groups of up to 32 lanes per key, each
//           lane loads whole 16-byte chunks, every warp keeps several keys in flight); else the
//           scalar kernel (a key per warp, a lane per element).
//   prefill (a chunk of queries): bf16 on tensor cores (FlashAttention-2 on mma.sync
//           m16n8k16, 64 queries x 64-key tiles per block); otherwise one warp per query, key
//           tiles staged in shared memory (quantized rows dequantized as they are staged);
//           causal, online softmax; earlier chunks' keys come from the cache like any other
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.cuh"

namespace kvlab::cuda {
namespace detail {

// An fp8 e4m3 pool element, so the vectorized decode kernel lays fp8 rows out by their size.
struct Fp8Bits {
  std::uint8_t bits;
};
// What a pool of KvFormat F over compute type T holds per element (int8 rows: not vectorized).
template <typename T, KvFormat F>
using KvElement = std::conditional_t<F == KvFormat::fp8_e4m3, Fp8Bits, T>;

// How the vectorized decode kernel lays a K/V row of HD elements of T over the lanes.
template <typename T, int HD>
struct VectorLayout {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  static constexpr int kChunks = HD * static_cast<int>(sizeof(T)) / 16;
  static constexpr bool kApplies = HD * sizeof(T) % 16 == 0 && kChunks > 0 &&
                                   (kChunks & (kChunks - 1)) == 0;
  static constexpr int kLanesPerKey = kChunks < 32 ? kChunks : 32;
  static constexpr int kLoads = kApplies ? kChunks / kLanesPerKey : 1;  // chunks per lane
  static constexpr int kElements = kLoads * kVec;                       // elements per lane
  static constexpr int kKeysPerWarp = kApplies ? 32 / kLanesPerKey : 1;
  // Query heads one block serves: q and the accumulators stay in registers (2 x QPB x
  // kElements floats per lane), at most 64 of them.
  static constexpr int kMaxQueriesPerBlock = kElements >= 16 ? 2 : kElements >= 8 ? 4 : 8;
};

__device__ __forceinline__ float to_float(Fp8Bits x) {
  return fp8_e4m3_to_float(x.bits);
}

}  // namespace detail

namespace {

// The slot holding `position` of entry e's sequence (AttentionEntry): its block's start slot
// plus the offset in the block.
__device__ __forceinline__ std::int64_t slot_of(const AttentionParams& p, const AttentionEntry& e,
                                                int position) {
  const int v = position - e.first_position + e.lead;
  return p.block_table[e.table_offset + (v >> e.block_shift)] + (v & ((1 << e.block_shift) - 1));
}

using detail::VectorLayout;

constexpr int kDecodeWarps = 4;
constexpr int kPrefillWarps = 8;
constexpr std::int32_t kMaxEntries = 65535;  // the decode grid's y dimension

// Keys an entry's query at `position` sees: [lo, position].
__device__ __forceinline__ int first_key(const AttentionEntry& e, int position,
                                         std::int64_t window) {
  int lo = e.first_position;
  if (window > 0) lo = max(lo, position - static_cast<int>(window) + 1);
  return lo;
}

template <typename T, int HD>
__device__ __forceinline__ void load_row(const T* row, float (&out)[(HD + 31) / 32], int lane) {
#pragma unroll
  for (int i = 0; i < (HD + 31) / 32; ++i) {
    const int d = i * 32 + lane;
    out[i] = d < HD ? to_float(row[d]) : 0.0f;
  }
}

// One K or V head row of the pool (KvFormat): its bytes, its start, and its elements as fp32.
template <typename T, KvFormat F, int HD>
constexpr std::int64_t kKvRowBytes = F == KvFormat::compute    ? HD* std::int64_t{sizeof(T)}
                                     : F == KvFormat::fp8_e4m3 ? HD
                                                               : 4 + HD;
template <typename T, KvFormat F, int HD>
__device__ __forceinline__ const char* kv_row(const void* pool, std::int64_t slot,
                                              std::int64_t kv_heads, int kv_head) {
  return static_cast<const char*>(pool) + (slot * kv_heads + kv_head) * kKvRowBytes<T, F, HD>;
}
// An int8 row's scale (its first 4 bytes); 1 for the others.
template <KvFormat F>
__device__ __forceinline__ float kv_row_scale(const char* row) {
  float scale = 1.0f;
  if constexpr (F == KvFormat::int8) std::memcpy(&scale, row, sizeof scale);
  return scale;
}
template <typename T, KvFormat F>
__device__ __forceinline__ float kv_element(const char* row, int d, float scale) {
  if constexpr (F == KvFormat::compute) {
    return to_float(reinterpret_cast<const T*>(row)[d]);
  } else if constexpr (F == KvFormat::fp8_e4m3) {
    return fp8_e4m3_to_float(static_cast<std::uint8_t>(row[d]));
  } else {
    return static_cast<float>(static_cast<signed char>(row[4 + d])) * scale;
  }
}
template <typename T, KvFormat F, int HD>
__device__ __forceinline__ void load_kv_row(const char* row, float (&out)[(HD + 31) / 32],
                                            int lane) {
  const float scale = kv_row_scale<F>(row);
#pragma unroll
  for (int i = 0; i < (HD + 31) / 32; ++i) {
    const int d = i * 32 + lane;
    out[i] = d < HD ? kv_element<T, F>(row, d, scale) : 0.0f;
  }
}

// Workspace per (entry, head, split): [m, l, acc[HD]].
__device__ __forceinline__ float* partial_of(float* workspace, int entry, int head, int split,
                                             int heads, int max_splits, int head_dim) {
  return workspace +
         ((static_cast<std::int64_t>(entry) * heads + head) * max_splits + split) * (head_dim + 2);
}

// What one decode block (grid x: query-head chunk of a K/V head, y: entry, z: key split) works
// on: its entry, K/V head, first of its QPB query heads and keys [begin, end). False when the
// block has nothing to do (not a decode entry, or a split past the last key; the combine kernel
// counts an entry's splits the same way).
struct DecodeSplit {
  AttentionEntry e;
  int entry, kv_head, head0, begin, end;
};
__device__ __forceinline__ bool decode_split(const AttentionParams& p, int queries_per_block,
                                             DecodeSplit& d) {
  d.entry = blockIdx.y;
  d.e = p.entries[d.entry];
  if (d.e.queries != 1) return false;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int chunks = (group + queries_per_block - 1) / queries_per_block;
  d.kv_head = blockIdx.x / chunks;
  d.head0 = d.kv_head * group + (blockIdx.x % chunks) * queries_per_block;
  const int position = d.e.start_position;
  d.begin = first_key(d.e, position, p.window) + static_cast<int>(blockIdx.z) * p.split_keys;
  if (d.begin > position) return false;
  d.end = min(position + 1, d.begin + p.split_keys);
  return true;
}

// Merges the warps' partial softmaxes (in shared memory) into the block's workspace partial
// [m, l, acc[HD]] for each of its QPB query heads.
template <int HD, int QPB>
__device__ __forceinline__ void write_block_partial(const AttentionParams& p, int max_splits,
                                                    int entry, int head0,
                                                    const float (&s_m)[kDecodeWarps][QPB],
                                                    const float (&s_l)[kDecodeWarps][QPB],
                                                    const float (&s_acc)[kDecodeWarps][QPB][HD]) {
  for (int index = threadIdx.x; index < QPB * (HD + 2); index += blockDim.x) {
    const int h = index / (HD + 2), d = index % (HD + 2);
    float total_m = -FLT_MAX;
    for (int w = 0; w < kDecodeWarps; ++w) total_m = fmaxf(total_m, s_m[w][h]);
    float value = 0.0f;
    if (d == 0) {
      value = total_m;
    } else {
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float factor = s_l[w][h] > 0.0f ? __expf(s_m[w][h] - total_m) : 0.0f;
        value += factor * (d == 1 ? s_l[w][h] : s_acc[w][h][d - 2]);
      }
    }
    partial_of(p.workspace, entry, head0 + h, blockIdx.z, static_cast<int>(p.heads), max_splits,
               HD)[d] = value;
  }
}

template <typename T, KvFormat F, int HD, int QPB>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_scalar_kernel(AttentionParams p, int max_splits) {
  constexpr int PER_LANE = (HD + 31) / 32;
  DecodeSplit d;
  if (!decode_split(p, QPB, d)) return;
  const int entry = d.entry, kv_head = d.kv_head, head0 = d.head0, begin = d.begin, end = d.end;
  const AttentionEntry& e = d.e;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float scale = rsqrtf(static_cast<float>(HD));

  float q[QPB][PER_LANE], acc[QPB][PER_LANE], m[QPB], l[QPB];
#pragma unroll
  for (int h = 0; h < QPB; ++h) {
    const T* row = static_cast<const T*>(p.q) +
                   static_cast<std::int64_t>(e.first_row) * p.q_row_stride +
                   static_cast<std::int64_t>(head0 + h) * HD;
    load_row<T, HD>(row, q[h], lane);
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      q[h][i] *= scale;
      acc[h][i] = 0.0f;
    }
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
  }
  for (int key = begin + warp; key < end; key += kDecodeWarps) {
    const std::int64_t slot = slot_of(p, e, key);
    float k[PER_LANE], v[PER_LANE];
    load_kv_row<T, F, HD>(kv_row<T, F, HD>(p.k_pool, slot, p.kv_heads, kv_head), k, lane);
    load_kv_row<T, F, HD>(kv_row<T, F, HD>(p.v_pool, slot, p.kv_heads, kv_head), v, lane);
#pragma unroll
    for (int h = 0; h < QPB; ++h) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) dot += q[h][i] * k[i];
      dot = warp_sum(dot);
      const float m_new = fmaxf(m[h], dot);
      const float correction = __expf(m[h] - m_new), weight = __expf(dot - m_new);
      l[h] = l[h] * correction + weight;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) acc[h][i] = acc[h][i] * correction + weight * v[i];
      m[h] = m_new;
    }
  }
  // Merge the warps' partial softmaxes.
  __shared__ float s_m[kDecodeWarps][QPB], s_l[kDecodeWarps][QPB];
  __shared__ float s_acc[kDecodeWarps][QPB][HD];
#pragma unroll
  for (int h = 0; h < QPB; ++h) {
    if (lane == 0) {
      s_m[warp][h] = m[h];
      s_l[warp][h] = l[h];
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int d = i * 32 + lane;
      if (d < HD) s_acc[warp][h][d] = acc[h][i];
    }
  }
  __syncthreads();
  write_block_partial<HD, QPB>(p, max_splits, entry, head0, s_m, s_l, s_acc);
}

// The kElements values of a row this lane holds: chunks i * kLanesPerKey + sub, i < kLoads.
template <typename T, int HD>
__device__ __forceinline__ void load_chunks(const T* row, float* out, int sub) {
  using L = VectorLayout<T, HD>;
  const uint4* chunks = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int i = 0; i < L::kLoads; ++i) {
    const uint4 raw = chunks[i * L::kLanesPerKey + sub];
    T values[L::kVec];
    memcpy(static_cast<void*>(values), &raw, sizeof(raw));
#pragma unroll
    for (int j = 0; j < L::kVec; ++j) out[i * L::kVec + j] = to_float(values[j]);
  }
}
// The element of a row that a lane's local value `local` is.
template <typename T, int HD>
__device__ __forceinline__ int element_of(int local, int sub) {
  using L = VectorLayout<T, HD>;
  return ((local / L::kVec) * L::kLanesPerKey + sub) * L::kVec + local % L::kVec;
}

// One query head's online softmax over a step's keys (kUnroll per lane group): scores by dot
// products summed inside each key's lane group (every lane shuffles, invalid keys too), then
// the running max, sum and accumulator absorb the valid keys.
template <typename L, int kUnroll>
__device__ __forceinline__ void absorb_keys(const float (&q)[L::kElements],
                                            const float (&k)[kUnroll][L::kElements],
                                            const float (&v)[kUnroll][L::kElements],
                                            const bool (&valid)[kUnroll], float& m, float& l,
                                            float (&acc)[L::kElements]) {
  constexpr int E = L::kElements;
  float score[kUnroll];
  float m_new = m;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) dot += q[i] * k[u][i];
#pragma unroll
    for (int offset = L::kLanesPerKey / 2; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    score[u] = dot;
    if (valid[u]) m_new = fmaxf(m_new, dot);
  }
  if (!valid[0]) return;  // no key for this group this step (valid[u] implies valid[0])
  const float correction = __expf(m - m_new);
  l *= correction;
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] *= correction;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!valid[u]) continue;
    const float weight = __expf(score[u] - m_new);
    l += weight;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] += weight * v[u][i];
  }
  m = m_new;
}

// Merges the lane groups of each warp: they hold the same elements for different keys.
template <typename L, int QPB>
__device__ __forceinline__ void merge_lane_groups(float (&m)[QPB], float (&l)[QPB],
                                                  float (&acc)[QPB][L::kElements]) {
#pragma unroll
  for (int offset = L::kLanesPerKey; offset < 32; offset *= 2) {
#pragma unroll
    for (int h = 0; h < QPB; ++h) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[h], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[h], offset);
      const float m_new = fmaxf(m[h], m_other);
      const float mine = l[h] > 0.0f ? __expf(m[h] - m_new) : 0.0f;
      const float theirs = l_other > 0.0f ? __expf(m_other - m_new) : 0.0f;
#pragma unroll
      for (int i = 0; i < L::kElements; ++i)
        acc[h][i] = acc[h][i] * mine + __shfl_xor_sync(0xffffffffu, acc[h][i], offset) * theirs;
      l[h] = l[h] * mine + l_other * theirs;
      m[h] = m_new;
    }
  }
}

// Same grid and workspace as the scalar kernel. A warp's lanes form kKeysPerWarp groups of
// kLanesPerKey lanes; each step a group takes kUnroll keys, so a warp has kKeysPerWarp x kUnroll
// K and V rows in flight. Each group keeps its own online softmax; groups merge by shuffles,
// warps through shared memory.
template <typename T, KvFormat F, int HD, int QPB>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_vectorized_kernel(AttentionParams p, int max_splits) {
  using S = detail::KvElement<T, F>;  // the pool's element: rows of HD of them
  using L = VectorLayout<S, HD>;
  constexpr int kUnroll = 2;
  constexpr int E = L::kElements;
  DecodeSplit d;
  if (!decode_split(p, QPB, d)) return;
  const int entry = d.entry, kv_head = d.kv_head, head0 = d.head0, begin = d.begin, end = d.end;
  const AttentionEntry& e = d.e;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int key_group = lane / L::kLanesPerKey, sub = lane % L::kLanesPerKey;
  const float scale = rsqrtf(static_cast<float>(HD));

  float q[QPB][E], acc[QPB][E], m[QPB], l[QPB];
#pragma unroll
  for (int h = 0; h < QPB; ++h) {
    const T* row = static_cast<const T*>(p.q) +
                   static_cast<std::int64_t>(e.first_row) * p.q_row_stride +
                   static_cast<std::int64_t>(head0 + h) * HD;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      q[h][i] = to_float(row[element_of<S, HD>(i, sub)]) * scale;
      acc[h][i] = 0.0f;
    }
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
  }
  const S* k_pool = static_cast<const S*>(p.k_pool);
  const S* v_pool = static_cast<const S*>(p.v_pool);
  constexpr int kKeysPerStep = kDecodeWarps * L::kKeysPerWarp * kUnroll;
  for (int step = begin; step < end; step += kKeysPerStep) {
    float k[kUnroll][E], v[kUnroll][E];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = step + (warp * kUnroll + u) * L::kKeysPerWarp + key_group;
      valid[u] = key < end;
      if (valid[u]) {
        const std::int64_t slot = slot_of(p, e, key);
        const std::int64_t offset = (slot * p.kv_heads + kv_head) * HD;
        load_chunks<S, HD>(k_pool + offset, k[u], sub);
        load_chunks<S, HD>(v_pool + offset, v[u], sub);
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) k[u][i] = v[u][i] = 0.0f;
      }
    }
#pragma unroll
    for (int h = 0; h < QPB; ++h) absorb_keys<L, kUnroll>(q[h], k, v, valid, m[h], l[h], acc[h]);
  }
  merge_lane_groups<L, QPB>(m, l, acc);
  // Merge the warps through shared memory; lane group 0 of each warp holds its result.
  __shared__ float s_m[kDecodeWarps][QPB], s_l[kDecodeWarps][QPB];
  __shared__ float s_acc[kDecodeWarps][QPB][HD];
  if (key_group == 0) {
#pragma unroll
    for (int h = 0; h < QPB; ++h) {
      if (sub == 0) {
        s_m[warp][h] = m[h];
        s_l[warp][h] = l[h];
      }
#pragma unroll
      for (int i = 0; i < E; ++i) s_acc[warp][h][element_of<S, HD>(i, sub)] = acc[h][i];
    }
  }
  __syncthreads();
  write_block_partial<HD, QPB>(p, max_splits, entry, head0, s_m, s_l, s_acc);
}

// out[entry row, head] = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)
template <typename T, int HD>
__global__ void combine_kernel(AttentionParams p, int max_splits) {
  const AttentionEntry e = p.entries[blockIdx.x];
  if (e.queries != 1) return;
  const int head = blockIdx.y;
  const int lo = first_key(e, e.start_position, p.window);
  const int splits = (e.start_position - lo) / p.split_keys + 1;
  const int heads = static_cast<int>(p.heads);
  float total_m = -FLT_MAX;
  for (int s = 0; s < splits; ++s)
    total_m =
        fmaxf(total_m, partial_of(p.workspace, blockIdx.x, head, s, heads, max_splits, HD)[0]);
  float total_l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float* part = partial_of(p.workspace, blockIdx.x, head, s, heads, max_splits, HD);
    total_l += part[1] * __expf(part[0] - total_m);
  }
  T* out = static_cast<T*>(p.out) + static_cast<std::int64_t>(e.first_row) * p.heads * HD +
           static_cast<std::int64_t>(head) * HD;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float value = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* part = partial_of(p.workspace, blockIdx.x, head, s, heads, max_splits, HD);
      value += part[2 + d] * __expf(part[0] - total_m);
    }
    out[d] = from_float<T>(value / total_l);
  }
}

// One key of a warp's query in the online softmax (FlashAttention): the dot product with the key
// row (shared memory, HD floats), then the running max m, sum l and output acc rescaled.
template <int HD, int PER_LANE>
__device__ __forceinline__ void attend_key(const float (&q)[PER_LANE], const float* k_row,
                                           const float* v_row, int lane, float& m, float& l,
                                           float (&acc)[PER_LANE]) {
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = i * 32 + lane;
    if (d < HD) dot += q[i] * k_row[d];
  }
  dot = warp_sum(dot);
  const float m_new = fmaxf(m, dot);
  const float correction = __expf(m - m_new), weight = __expf(dot - m_new);
  l = l * correction + weight;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = i * 32 + lane;
    acc[i] = acc[i] * correction + (d < HD ? weight * v_row[d] : 0.0f);
  }
  m = m_new;
}

// The entry a prefill block serves: blockIdx.x indexes p.prefill_entries when there is one.
__device__ inline const AttentionEntry& prefill_entry(const AttentionParams& p) {
  return p.entries[p.prefill_entries ? p.prefill_entries[blockIdx.x] : blockIdx.x];
}

// One block per (entry, query head, tile of kPrefillWarps queries); warp w serves query
// tile * kPrefillWarps + w. Keys stream through shared memory in tiles of KEY_TILE.
template <typename T, KvFormat F, int HD>
__global__ void __launch_bounds__(kPrefillWarps * 32) prefill_kernel(AttentionParams p) {
  constexpr int PER_LANE = (HD + 31) / 32;
  constexpr int KEY_TILE = HD <= 128 ? 32 : 16;
  const AttentionEntry e = prefill_entry(p);
  if (e.queries <= 1) return;
  const int first_query = static_cast<int>(blockIdx.z) * kPrefillWarps;
  if (first_query >= e.queries) return;  // uniform over the block
  const int head = blockIdx.y;
  const int kv_head = head / static_cast<int>(p.heads / p.kv_heads);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int query = first_query + warp;
  const bool active = query < e.queries;
  const int position = e.start_position + query;  // meaningful when active
  const int last_position = e.start_position + min(e.queries, first_query + kPrefillWarps) - 1;
  const int block_lo = first_key(e, e.start_position + first_query, p.window);
  const int my_lo = active ? first_key(e, position, p.window) : 0;
  const float scale = rsqrtf(static_cast<float>(HD));

  float q[PER_LANE], acc[PER_LANE], m = -FLT_MAX, l = 0.0f;
  if (active) {
    load_row<T, HD>(static_cast<const T*>(p.q) +
                        static_cast<std::int64_t>(e.first_row + query) * p.q_row_stride +
                        static_cast<std::int64_t>(head) * HD,
                    q, lane);
  }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    q[i] = active ? q[i] * scale : 0.0f;
    acc[i] = 0.0f;
  }
  __shared__ float s_k[KEY_TILE][HD], s_v[KEY_TILE][HD];
  for (int tile = block_lo; tile <= last_position; tile += KEY_TILE) {
    const int tile_keys = min(KEY_TILE, last_position + 1 - tile);
    for (int index = threadIdx.x; index < tile_keys * HD; index += blockDim.x) {
      const int j = index / HD, d = index % HD;
      const std::int64_t slot = slot_of(p, e, tile + j);
      const char* k_row = kv_row<T, F, HD>(p.k_pool, slot, p.kv_heads, kv_head);
      const char* v_row = kv_row<T, F, HD>(p.v_pool, slot, p.kv_heads, kv_head);
      s_k[j][d] = kv_element<T, F>(k_row, d, kv_row_scale<F>(k_row));
      s_v[j][d] = kv_element<T, F>(v_row, d, kv_row_scale<F>(v_row));
    }
    __syncthreads();
    if (active) {
      for (int j = 0; j < tile_keys; ++j) {
        const int key = tile + j;
        if (key < my_lo || key > position) continue;  // causal and window (warp-uniform)
        attend_key<HD, PER_LANE>(q, s_k[j], s_v[j], lane, m, l, acc);
      }
    }
    __syncthreads();
  }
  if (!active) return;
  T* out = static_cast<T*>(p.out) + static_cast<std::int64_t>(e.first_row + query) * p.heads * HD +
           static_cast<std::int64_t>(head) * HD;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int d = i * 32 + lane;
    if (d < HD) out[d] = from_float<T>(acc[i] / l);
  }
}

// ---- Tensor-core prefill (bf16): FlashAttention-2's loop on mma.sync m16n8k16 ----
constexpr int kMmaWarps = 4;
constexpr int kMmaQueries = 16 * kMmaWarps;  // a block's query tile: 16 rows per warp
constexpr int kMmaKeys = 64;                 // keys per shared-memory tile
constexpr int kMmaPad = 8;  // bf16 per shared row beyond HD: a warp's fragment loads hit 32 banks

// Two bf16 (their bits) as one 32-bit operand register, `low` in the low half.
__device__ __forceinline__ unsigned pack_bf16(unsigned short low, unsigned short high) {
  return static_cast<unsigned>(low) | (static_cast<unsigned>(high) << 16);
}
__device__ __forceinline__ unsigned short bf16_bits(float value) {
  const __nv_bfloat16 rounded = __float2bfloat16(value);  // round to nearest even
  unsigned short bits = 0;
  std::memcpy(&bits, &rounded, sizeof bits);
  return bits;
}
__device__ __forceinline__ unsigned pack_bf16(float low, float high) {
  return pack_bf16(bf16_bits(low), bf16_bits(high));
}

// kCount (2 or 4) 8 x 8 matrices of b16 from shared memory, one 32-bit register per matrix
// (PTX ldmatrix): lane i gives the address of row i % 8 of matrix i / 8 (16-byte aligned).
// Lane l (g = l / 4, t = l % 4) receives elements (g, 2t) and (g, 2t + 1) of each matrix, or
// transposed, (2t, g) and (2t + 1, g): an mma.sync B fragment of K rows, or of V rows.
template <int kCount, bool kTransposed>
__device__ __forceinline__ void load_matrices(unsigned (&r)[kCount], const unsigned short* row) {
  static_assert(kCount == 2 || kCount == 4);
#if defined(KVLAB_CUDA_EMULATION)
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int m = 0; m < kCount; ++m) {
    if constexpr (kTransposed) {
      const unsigned short* low = emulation::shuffle(0xffffffffu, row, 8 * m + 2 * t);
      const unsigned short* high = emulation::shuffle(0xffffffffu, row, 8 * m + 2 * t + 1);
      r[m] = pack_bf16(low[g], high[g]);
    } else {
      const unsigned short* source = emulation::shuffle(0xffffffffu, row, 8 * m + g);
      std::memcpy(&r[m], source + 2 * t, sizeof(unsigned));
    }
  }
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kCount == 4 && kTransposed)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else if constexpr (kCount == 4)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else if constexpr (kTransposed)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(address));
#endif
}

// d (16 x 8) fp32 += a (16 x 16) bf16 x b (16 x 8) bf16: PTX mma.sync.aligned.m16n8k16.row.col.
// Lane l (g = l / 4, t = l % 4) holds a = {A[g][2t, 2t+1], A[g+8][2t, 2t+1], A[g][2t+8, 2t+9],
// A[g+8][2t+8, 2t+9]}, b = {B[2t, 2t+1][g], B[2t+8, 2t+9][g]} (the lower index in the low half)
// and d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]) {
#if defined(KVLAB_CUDA_EMULATION)
  // The warp's operands meet in shared memory; each lane computes its four outputs from them.
  struct Operands {
    unsigned a[4], b[2];
  };
  __shared__ Operands staged[32][32];  // (warp, lane)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  staged[warp][lane] = {{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  __syncwarp();
  auto half = [](unsigned reg, int k) {
    const unsigned bits = (k % 2 == 0 ? reg & 0xffffu : reg >> 16) << 16;
    float value = 0;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  };
  auto a_at = [&](int row, int k) {
    return half(staged[warp][(row % 8) * 4 + (k % 8) / 2].a[(row >= 8) + 2 * (k >= 8)], k);
  };
  auto b_at = [&](int k, int n) { return half(staged[warp][n * 4 + (k % 8) / 2].b[k >= 8], k); };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) sum += a_at(g + 8 * (i / 2), k) * b_at(k, 2 * t + i % 2);
    d[i] += sum;
  }
  __syncwarp();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Stages keys [tile, tile + KEYS) of the entry's K/V head `kv_head` of `pool` (K or V) in shared
// memory through its block table with 16-byte asynchronous copies (pools 16-byte aligned); keys
// at or beyond `end` are zeros. The caller commits and waits (copy_async_*).
template <int HD, int KEYS>
__device__ void stage_rows(const AttentionParams& p, const AttentionEntry& e, const void* pool,
                           int kv_head, int tile, int end, unsigned short (*rows)[HD + kMmaPad]) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  const auto* elements = static_cast<const unsigned short*>(pool);
  for (int index = threadIdx.x; index < KEYS * kChunks; index += blockDim.x) {
    const int j = index / kChunks, chunk = index % kChunks;
    const bool valid = tile + j < end;
    const std::int64_t offset =
        valid ? (slot_of(p, e, tile + j) * p.kv_heads + kv_head) * HD + 8 * chunk : 0;
    copy_async_16(&rows[j][8 * chunk], elements + offset, valid);
  }
}

// Row max over the 4 lanes that share a row (lanes g*4 .. g*4+3).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One warp's 16 rows on tensor cores (prefill: 16 queries of one head; decode: up to 16 query
// heads of one K/V head at one position): the queries as A fragments, and this lane's two rows
// (g and g + 8 of the 16): their index, running max and partial sum (base 2), and the output
// accumulators (16 x HD over the warp).
template <int HD>
struct MmaRows {
  unsigned q[HD / 16][4];
  float o[HD / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  int rows[2] = {0, 0};
};
// A warp's S tile: 16 rows x 8 NT keys (NT n-tiles of the mma).
template <int NT>
using Scores = float[NT][4];

// Loads this lane's A fragments of 16 query rows: row r < rows_here is the HD elements of q
// from element first_of(r); rows beyond are zeros.
template <int HD, typename FirstOf>
__device__ void load_query_fragments(const AttentionParams& p, int rows_here, FirstOf first_of,
                                     MmaRows<HD>& w) {
  const int t = threadIdx.x % 4;
  const auto* q_pairs = static_cast<const unsigned*>(p.q);
  for (int s = 0; s < HD / 16; ++s)
    for (int r = 0; r < 4; ++r) {
      const int row = w.rows[r % 2], d = 16 * s + 2 * t + 8 * (r / 2);
      w.q[s][r] = row < rows_here ? q_pairs[(first_of(row) + d) / 2] : 0u;
    }
}

// S = Q K^T over 8 NT keys staged at s_k (fp32 accumulators, unscaled). One ldmatrix gives the
// B fragments of two k-steps of an n-tile (the rows are keys: K^T's columns).
template <int HD, int NT>
__device__ void score_keys(const MmaRows<HD>& w, const unsigned short (*s_k)[HD + kMmaPad],
                           Scores<NT>& c) {
  constexpr int kSteps = HD / 16;
  const int lane = threadIdx.x % 32;
  for (int j = 0; j < NT; ++j) {
    for (int i = 0; i < 4; ++i) c[j][i] = 0.0f;
    const unsigned short* key_row = s_k[8 * j + lane % 8];
    for (int s = 0; s + 1 < kSteps; s += 2) {
      unsigned b[4];
      load_matrices<4, false>(b, key_row + 16 * s + 8 * (lane / 8));
      mma_16816(c[j], w.q[s], {b[0], b[1]});
      mma_16816(c[j], w.q[s + 1], {b[2], b[3]});
    }
    if constexpr (kSteps % 2 == 1) {
      unsigned b[2];
      load_matrices<2, false>(b, key_row + 16 * (kSteps - 1) + 8 * (lane / 8 % 2));
      mma_16816(c[j], w.q[kSteps - 1], b);
    }
  }
}

// Scales S to base 2 (1/sqrt(HD) and log2(e)) where seen(row, key) and sets -inf elsewhere
// (all_seen: the caller knows every key of the tile is seen by every row);`tile_max` gets the
// largest of each of the lane's two rows. Element i of n-tile j is key first_key + 8 j + 2 t +
// i % 2 of row rows[i / 2].
template <int HD, int NT, typename Seen>
__device__ void mask_scores(const MmaRows<HD>& w, int first_key, bool all_seen, Seen seen,
                            Scores<NT>& c, float (&tile_max)[2]) {
  const int t = threadIdx.x % 4;
  const float scale = rsqrtf(static_cast<float>(HD)) * 1.4426950408889634f;
  tile_max[0] = tile_max[1] = -INFINITY;
  for (int j = 0; j < NT; ++j)
    for (int i = 0; i < 4; ++i) {
      const int key = first_key + 8 * j + 2 * t + i % 2;
      c[j][i] = all_seen || seen(w.rows[i / 2], key) ? c[j][i] * scale : -INFINITY;
      tile_max[i / 2] = fmaxf(tile_max[i / 2], c[j][i]);
    }
}

// Online softmax over the tile (c becomes P), then O = O x correction + P V with P in bf16;
// the 8 NT keys' V rows are staged at s_v.
template <int HD, int NT>
__device__ void accumulate_tile(Scores<NT>& c, const float (&tile_max)[2],
                                const unsigned short (*s_v)[HD + kMmaPad], MmaRows<HD>& w) {
  static_assert(NT % 2 == 0, "P V takes keys 16 at a time");
  const int lane = threadIdx.x % 32;
  float correction[2];
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(w.m[r], quad_max(tile_max[r]));
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing seen yet
    correction[r] = exp2f(w.m[r] - base);
    w.m[r] = m_new;
    w.l[r] *= correction[r];
    for (int j = 0; j < NT; ++j)
      for (int i = 2 * r; i < 2 * r + 2; ++i) {
        c[j][i] = exp2f(c[j][i] - base);
        w.l[r] += c[j][i];
      }
  }
  for (int n = 0; n < HD / 8; ++n)
    for (int i = 0; i < 4; ++i) w.o[n][i] *= correction[i / 2];
  for (int s = 0; s < NT / 2; ++s) {  // S's accumulators are P's A fragments
    const unsigned a[4] = {pack_bf16(c[2 * s][0], c[2 * s][1]), pack_bf16(c[2 * s][2], c[2 * s][3]),
                           pack_bf16(c[2 * s + 1][0], c[2 * s + 1][1]),
                           pack_bf16(c[2 * s + 1][2], c[2 * s + 1][3])};
    // One transposed ldmatrix: the B fragments of two n-tiles (8 dims each) over the 16 keys.
    const unsigned short* value_row = s_v[16 * s + 8 * (lane / 8 % 2) + lane % 8];
    for (int n = 0; n < HD / 8; n += 2) {
      unsigned b[4];
      load_matrices<4, true>(b, value_row + 8 * (n + lane / 16));
      mma_16816(w.o[n], a, {b[0], b[1]});
      mma_16816(w.o[n + 1], a, {b[2], b[3]});
    }
  }
}

template <int HD>
__device__ void store_rows(const AttentionParams& p, const AttentionEntry& e, int head,
                           const MmaRows<HD>& w) {
  const int t = threadIdx.x % 4;
  auto* out = static_cast<unsigned*>(p.out);
  for (int r = 0; r < 2; ++r) {
    const float total = quad_sum(w.l[r]);  // every lane of the quad takes part
    if (w.rows[r] >= e.queries) continue;
    for (int n = 0; n < HD / 8; ++n) {
      const std::int64_t element =
          static_cast<std::int64_t>(e.first_row + w.rows[r]) * p.heads * HD + head * HD + 8 * n +
          2 * t;
      out[element / 2] = pack_bf16(w.o[n][2 * r] / total, w.o[n][2 * r + 1] / total);
    }
  }
}

constexpr int kKeyTiles = kMmaKeys / 8;  // n-tiles of Q K^T over a prefill key tile

// KEYS rows of K and of V in shared memory (bf16 bits, rows padded; ldmatrix and cp.async need
// 16-byte aligned rows).
template <int HD, int KEYS>
struct alignas(16) KeyTile {
  unsigned short k[KEYS][HD + kMmaPad];
  unsigned short v[KEYS][HD + kMmaPad];
};

// One block per (entry, query head, tile of kMmaQueries queries); warp w owns 16 query rows.
// Per key tile: S = Q K^T on tensor cores (fp32), causal/window mask, online softmax in base 2,
// O += P V with P rounded to bf16 (FlashAttention-2). Rows beyond the entry's queries compute
// (every lane takes part in each mma) but are never written.
template <int HD>
__global__ void __launch_bounds__(kMmaWarps * 32) prefill_mma_kernel(AttentionParams p) {
  const AttentionEntry e = prefill_entry(p);
  if (e.queries <= 1) return;
  const int first_query = static_cast<int>(blockIdx.z) * kMmaQueries;
  if (first_query >= e.queries) return;  // uniform over the block
  const int head = blockIdx.y;
  const int kv_head = head / static_cast<int>(p.heads / p.kv_heads);
  const int warp_rows = first_query + static_cast<int>(threadIdx.x / 32) * 16;
  MmaRows<HD> w;
  w.rows[0] = warp_rows + static_cast<int>(threadIdx.x % 32 / 4);
  w.rows[1] = w.rows[0] + 8;
  load_query_fragments<HD>(
      p, e.queries,
      [&](int row) { return (std::int64_t{e.first_row} + row) * p.q_row_stride + head * HD; }, w);
  const int last = e.start_position + min(e.queries, first_query + kMmaQueries) - 1;
  const auto seen = [&](int row, int key) {
    const int position = e.start_position + row;
    return row < e.queries && key <= position && key >= first_key(e, position, p.window);
  };
  // The warp's rows with queries: a tile every one of them sees whole needs no mask.
  const int lowest = e.start_position + warp_rows;
  const int highest = e.start_position + min(warp_rows + 15, e.queries - 1);
  __shared__ KeyTile<HD, kMmaKeys> staged;
  auto& s_k = staged.k;
  auto& s_v = staged.v;
  // FlashAttention-2's overlap with one buffer each: V's copies fly while S = Q K^T is computed,
  // the next tile's K's while the softmax and P V are.
  int tile = first_key(e, e.start_position + first_query, p.window);
  stage_rows<HD, kMmaKeys>(p, e, p.k_pool, kv_head, tile, last + 1, s_k);
  copy_async_commit();
  for (; tile <= last; tile += kMmaKeys) {
    copy_async_wait<0>();
    __syncthreads();  // K staged; every warp done with the last tile's V
    stage_rows<HD, kMmaKeys>(p, e, p.v_pool, kv_head, tile, last + 1, s_v);
    copy_async_commit();
    Scores<kKeyTiles> c;
    score_keys<HD, kKeyTiles>(w, s_k, c);
    __syncthreads();  // every warp done with K
    if (tile + kMmaKeys <= last)
      stage_rows<HD, kMmaKeys>(p, e, p.k_pool, kv_head, tile + kMmaKeys, last + 1, s_k);
    copy_async_commit();  // possibly empty: the wait below always leaves the newest group
    const bool all_seen =
        tile + kMmaKeys - 1 <= lowest && (p.window == 0 || tile >= first_key(e, highest, p.window));
    float tile_max[2];
    mask_scores<HD, kKeyTiles>(w, tile, all_seen, seen, c, tile_max);
    copy_async_wait<1>();
    __syncthreads();  // V staged
    accumulate_tile<HD, kKeyTiles>(c, tile_max, s_v, w);
  }
  store_rows<HD>(p, e, head, w);
}

// ---- Decode on tensor cores (bf16): the query heads that share a K/V head are the rows ----
// A K/V row read once serves every query head of its group (GQA 8: 8 of the tile's 16 rows; MHA
// 1), so the math is cheap on tensor cores and the kernel streams K/V: two warps take 16 keys
// each of a 32-key tile, and the next tile's copies are in flight while one is computed.
constexpr int kDecodeMmaWarps = 2;
constexpr int kDecodeMmaKeys = 16 * kDecodeMmaWarps;
constexpr int kMmaRows = 16;  // query heads per block

// Merges warp 1's rows into warp 0's (through shared memory) and writes the block's workspace
// partial [m, l, acc[HD]] of each of its `rows_here` query heads; m in natural-log units, as the
// combine kernel reads it.
template <int HD>
__device__ void write_mma_partial(const AttentionParams& p, int max_splits, const DecodeSplit& d,
                                  int rows_here, const MmaRows<HD>& w) {
  static_assert(kDecodeMmaWarps == 2, "one warp merges into the other");
  __shared__ float s_o[kMmaRows][HD], s_m[kMmaRows], s_l[kMmaRows];
  const int warp = threadIdx.x / 32, t = threadIdx.x % 4;
  const float l_row[2] = {quad_sum(w.l[0]), quad_sum(w.l[1])};
  if (warp == 1) {
    for (int r = 0; r < 2; ++r) {
      for (int n = 0; n < HD / 8; ++n) {
        s_o[w.rows[r]][8 * n + 2 * t] = w.o[n][2 * r];
        s_o[w.rows[r]][8 * n + 2 * t + 1] = w.o[n][2 * r + 1];
      }
      if (t == 0) {
        s_m[w.rows[r]] = w.m[r];
        s_l[w.rows[r]] = l_row[r];
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
  for (int r = 0; r < 2; ++r) {
    const int row = w.rows[r];
    if (row >= rows_here) continue;
    const float m_new = fmaxf(w.m[r], s_m[row]);
    const float mine = l_row[r] > 0.0f ? exp2f(w.m[r] - m_new) : 0.0f;
    const float theirs = s_l[row] > 0.0f ? exp2f(s_m[row] - m_new) : 0.0f;
    float* part = partial_of(p.workspace, d.entry, d.head0 + row, blockIdx.z,
                             static_cast<int>(p.heads), max_splits, HD);
    if (t == 0) {
      part[0] = m_new * 0.6931471805599453f;  // base 2 to natural
      part[1] = l_row[r] * mine + s_l[row] * theirs;
    }
    for (int n = 0; n < HD / 8; ++n)
      for (int i = 0; i < 2; ++i) {
        const int dim = 8 * n + 2 * t + i;
        part[2 + dim] = w.o[n][2 * r + i] * mine + s_o[row][dim] * theirs;
      }
  }
}

// Grid as the CUDA-core decode kernels with 16 query heads per block (x: row tile of a K/V
// head's group, y: entry, z: key split); the same workspace partials and combine kernel. Rows
// beyond the group compute (every lane takes part in each mma) but are never written.
template <int HD>
__global__ void __launch_bounds__(kDecodeMmaWarps * 32)
    decode_mma_kernel(AttentionParams p, int max_splits) {
  DecodeSplit d;
  if (!decode_split(p, kMmaRows, d)) return;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int rows_here = min(kMmaRows, d.kv_head * group + group - d.head0);
  const int warp = threadIdx.x / 32;
  MmaRows<HD> w;
  w.rows[0] = static_cast<int>(threadIdx.x % 32 / 4);
  w.rows[1] = w.rows[0] + 8;
  load_query_fragments<HD>(
      p, rows_here,
      [&](int row) { return std::int64_t{d.e.first_row} * p.q_row_stride + (d.head0 + row) * HD; },
      w);
  __shared__ KeyTile<HD, kDecodeMmaKeys> stages[2];
  const auto stage_tile = [&](int tile, int stage) {
    stage_rows<HD, kDecodeMmaKeys>(p, d.e, p.k_pool, d.kv_head, tile, d.end, stages[stage].k);
    stage_rows<HD, kDecodeMmaKeys>(p, d.e, p.v_pool, d.kv_head, tile, d.end, stages[stage].v);
  };
  stage_tile(d.begin, 0);
  copy_async_commit();
  const int end = d.end;
  const auto seen = [end](int, int key) { return key < end; };
  for (int tile = d.begin, stage = 0; tile < end; tile += kDecodeMmaKeys, stage ^= 1) {
    if (tile + kDecodeMmaKeys < end) stage_tile(tile + kDecodeMmaKeys, stage ^ 1);
    copy_async_commit();  // possibly empty: the wait below always leaves the newest group
    copy_async_wait<1>();
    __syncthreads();
    const int first = 16 * warp;  // this warp's keys of the tile
    Scores<2> c;
    float tile_max[2];
    score_keys<HD, 2>(w, stages[stage].k + first, c);
    mask_scores<HD, 2>(w, tile + first, tile + kDecodeMmaKeys <= end, seen, c, tile_max);
    accumulate_tile<HD, 2>(c, tile_max, stages[stage].v + first, w);
    __syncthreads();  // before the next iteration's copies overwrite the other stage
  }
  write_mma_partial<HD>(p, max_splits, d, rows_here, w);
}

// The shapes the bf16 tensor-core kernels are instantiated for (head_dim a multiple of 16 up to
// 128), and whether they can take a launch of such a shape: asked for (tensor_cores), K/V rows
// in 16-byte chunks (asynchronous copies), queries and outputs in bf16 pairs.
template <typename T, int HD>
constexpr bool kMmaShape = std::is_same_v<T, __nv_bfloat16>&& HD % 16 == 0 && HD <= 128;
bool tensor_cores_take(const AttentionParams& p) {
  const auto address = [](const void* pointer) {
    return reinterpret_cast<std::uintptr_t>(pointer);
  };
  return p.tensor_cores && (address(p.k_pool) | address(p.v_pool)) % 16 == 0 &&
         (address(p.q) | address(p.out)) % 4 == 0 && p.q_row_stride % 2 == 0;
}

// The prefill launch: on tensor cores where they take it (bf16, head_dim a multiple of 16 up to
// 128); the warp-per-query kernel otherwise (fp32, the check path; other head sizes; unaligned
// pools).
template <typename T, KvFormat F, int HD>
cudaError_t launch_prefill(const AttentionParams& p, cudaStream_t stream) {
  const std::int32_t entries = p.prefill_entries ? p.prefill_count : p.entry_count;
  if (entries <= 0) return cudaSuccess;
  const auto tiles = [&](int queries_per_block) {
    return dim3(static_cast<unsigned>(entries), static_cast<unsigned>(p.heads),
                static_cast<unsigned>((p.max_queries + queries_per_block - 1) / queries_per_block));
  };
  if constexpr (F == KvFormat::compute && kMmaShape<T, HD>) {
    if (tensor_cores_take(p))
      return launch_kernel(prefill_mma_kernel<HD>, tiles(kMmaQueries), kMmaWarps * 32, stream, p);
  }
  return launch_kernel(prefill_kernel<T, F, HD>, tiles(kPrefillWarps), kPrefillWarps * 32, stream,
                       p);
}

// The largest power of two <= limit dividing the group size.
int queries_per_block(std::int64_t group, int limit) {
  for (int candidate : {8, 4, 2})
    if (candidate <= limit && group % candidate == 0) return candidate;
  return 1;
}

// The decode launch for one dtype, KV format and head size: on tensor cores where they take it
// (bf16 rows), else vectorized where it applies (compute and fp8 rows), else scalar (int8 rows,
// odd head sizes, unaligned pools).
template <typename T, KvFormat F, int HD>
cudaError_t launch_decode(const AttentionParams& p, int max_splits, cudaStream_t stream) {
  using L = VectorLayout<detail::KvElement<T, F>, HD>;
  constexpr bool kVectorizes = L::kApplies && F != KvFormat::int8;
  const std::int64_t group = p.heads / p.kv_heads;
  if constexpr (F == KvFormat::compute && kMmaShape<T, HD>) {
    if (tensor_cores_take(p)) {
      const std::int64_t row_tiles = (group + kMmaRows - 1) / kMmaRows;
      const dim3 grid(static_cast<unsigned>(p.kv_heads * row_tiles),
                      static_cast<unsigned>(p.entry_count), static_cast<unsigned>(max_splits));
      return launch_kernel(decode_mma_kernel<HD>, grid, kDecodeMmaWarps * 32, stream, p,
                           max_splits);
    }
  }
  const std::uintptr_t pools =
      reinterpret_cast<std::uintptr_t>(p.k_pool) | reinterpret_cast<std::uintptr_t>(p.v_pool);
  const bool vectorized = kVectorizes && pools % 16 == 0;
  const int qpb = queries_per_block(group, vectorized ? L::kMaxQueriesPerBlock : 8);
  // x: the query-head blocks, fastest, so the blocks that share a K/V head (GQA with more query
  // heads than one block serves) run side by side and the second read of its rows hits L2.
  const dim3 grid(static_cast<unsigned>(p.kv_heads * (group / qpb)),
                  static_cast<unsigned>(p.entry_count), static_cast<unsigned>(max_splits));
  KVLAB_DISPATCH_GROUP(qpb, QPB, {
    if constexpr (kVectorizes && QPB <= L::kMaxQueriesPerBlock) {
      if (vectorized)
        return launch_kernel(decode_vectorized_kernel<T, F, HD, QPB>, grid, kDecodeWarps * 32,
                             stream, p, max_splits);
    }
    return launch_kernel(decode_scalar_kernel<T, F, HD, QPB>, grid, kDecodeWarps * 32, stream, p,
                         max_splits);
  });
}

}  // namespace

std::int64_t attention_workspace_floats(std::int64_t entries, std::int64_t heads,
                                        std::int64_t head_dim, std::int64_t max_keys,
                                        std::int64_t split_keys) {
  const std::int64_t splits = (max_keys + split_keys - 1) / split_keys;
  return entries * heads * std::max<std::int64_t>(splits, 1) * (head_dim + 2);
}

bool attention_supports(std::int64_t head_dim) {
  switch (head_dim) {
    case 16:
    case 32:
    case 48:
    case 64:
    case 80:
    case 96:
    case 128:
    case 256:
      return true;
    default:
      return false;
  }
}

cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.entry_count <= 0) return cudaSuccess;
  if (p.kv_heads <= 0 || p.heads % p.kv_heads != 0 || p.split_keys <= 0 ||
      !attention_supports(p.head_dim) || p.entry_count > kMaxEntries || p.prefill_count < 0 ||
      p.prefill_count > p.entry_count)
    return cudaErrorInvalidValue;
  const int max_splits = std::max(1, (p.max_keys + p.split_keys - 1) / p.split_keys);
  const dim3 combine_grid(static_cast<unsigned>(p.entry_count), static_cast<unsigned>(p.heads));
  cudaError_t status = cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    KVLAB_DISPATCH_KV_FORMAT(p.kv_format, F, {
      KVLAB_DISPATCH_HEAD_DIM(p.head_dim, HD, {
        status = launch_decode<T, F, HD>(p, max_splits, stream);
        constexpr int kCombineThreads = HD < 128 ? HD : 128;
        if (status == cudaSuccess)
          status = launch_kernel(combine_kernel<T, HD>, combine_grid, kCombineThreads, stream, p,
                                 max_splits);
        if (status == cudaSuccess && p.max_queries > 1)
          status = launch_prefill<T, F, HD>(p, stream);
      });
    });
  });
  return status;
}

}  // namespace kvlab::cuda
