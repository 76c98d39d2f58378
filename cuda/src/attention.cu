// Attention over the device KV pool, read through a per-token slot table (any allocator:
// contiguous extents or paged blocks), with GQA/MQA head mapping and a sliding window.
//   decode  (one query): split-K flash-decoding, one block per (entry, K/V head, query-head
//           chunk, key split), online softmax per warp, partials combined by a second kernel
//   prefill (a chunk of queries): one warp per query, key tiles staged in shared memory,
//           causal, online softmax; earlier chunks' keys come from the cache like any other
#include <algorithm>
#include <cfloat>

#include "common.cuh"

namespace kvlab::cuda {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kPrefillWarps = 8;

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

// Workspace per (entry, head, split): [m, l, acc[HD]].
__device__ __forceinline__ float* partial_of(float* workspace, int entry, int head, int split,
                                             int heads, int max_splits, int head_dim) {
  return workspace +
         ((static_cast<std::int64_t>(entry) * heads + head) * max_splits + split) * (head_dim + 2);
}

template <typename T, int HD, int QPB>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_kernel(AttentionParams p, int max_splits) {
  constexpr int PER_LANE = (HD + 31) / 32;
  const AttentionEntry e = p.entries[blockIdx.x];
  if (e.queries != 1) return;
  const int group = static_cast<int>(p.heads / p.kv_heads);
  const int chunks = group / QPB;
  const int kv_head = blockIdx.y / chunks;
  const int head0 = kv_head * group + (blockIdx.y % chunks) * QPB;
  const int position = e.start_position;
  const int lo = first_key(e, position, p.window);
  const int begin = lo + static_cast<int>(blockIdx.z) * p.split_keys;
  if (begin > position) return;  // the combine kernel counts this entry's splits the same way
  const int end = min(position + 1, begin + p.split_keys);
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
  const T* k_pool = static_cast<const T*>(p.k_pool);
  const T* v_pool = static_cast<const T*>(p.v_pool);
  for (int key = begin + warp; key < end; key += kDecodeWarps) {
    const std::int64_t slot = p.slot_table[e.slot_offset + (key - e.first_position)];
    const std::int64_t offset = (slot * p.kv_heads + kv_head) * HD;
    float k[PER_LANE], v[PER_LANE];
    load_row<T, HD>(k_pool + offset, k, lane);
    load_row<T, HD>(v_pool + offset, v, lane);
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
    partial_of(p.workspace, blockIdx.x, head0 + h, blockIdx.z, static_cast<int>(p.heads),
               max_splits, HD)[d] = value;
  }
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

// One block per (entry, query head, tile of kPrefillWarps queries); warp w serves query
// tile * kPrefillWarps + w. Keys stream through shared memory in tiles of KEY_TILE.
template <typename T, int HD>
__global__ void __launch_bounds__(kPrefillWarps * 32) prefill_kernel(AttentionParams p) {
  constexpr int PER_LANE = (HD + 31) / 32;
  constexpr int KEY_TILE = HD <= 128 ? 32 : 16;
  const AttentionEntry e = p.entries[blockIdx.x];
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
  const T* k_pool = static_cast<const T*>(p.k_pool);
  const T* v_pool = static_cast<const T*>(p.v_pool);
  for (int tile = block_lo; tile <= last_position; tile += KEY_TILE) {
    const int tile_keys = min(KEY_TILE, last_position + 1 - tile);
    for (int index = threadIdx.x; index < tile_keys * HD; index += blockDim.x) {
      const int j = index / HD, d = index % HD;
      const std::int64_t slot = p.slot_table[e.slot_offset + (tile + j - e.first_position)];
      const std::int64_t offset = (slot * p.kv_heads + kv_head) * HD + d;
      s_k[j][d] = to_float(k_pool[offset]);
      s_v[j][d] = to_float(v_pool[offset]);
    }
    __syncthreads();
    if (active) {
      for (int j = 0; j < tile_keys; ++j) {
        const int key = tile + j;
        if (key < my_lo || key > position) continue;  // causal and window (warp-uniform)
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int d = i * 32 + lane;
          if (d < HD) dot += q[i] * s_k[j][d];
        }
        dot = warp_sum(dot);
        const float m_new = fmaxf(m, dot);
        const float correction = __expf(m - m_new), weight = __expf(dot - m_new);
        l = l * correction + weight;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
          const int d = i * 32 + lane;
          acc[i] = acc[i] * correction + (d < HD ? weight * s_v[j][d] : 0.0f);
        }
        m = m_new;
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

int queries_per_block(std::int64_t group) {
  for (int candidate : {8, 4, 2})
    if (group % candidate == 0) return candidate;
  return 1;
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
      !attention_supports(p.head_dim))
    return cudaErrorInvalidValue;
  const std::int64_t group = p.heads / p.kv_heads;
  const int qpb = queries_per_block(group);
  const int max_splits = std::max(1, (p.max_keys + p.split_keys - 1) / p.split_keys);
  const int max_queries = std::max(p.max_queries, 1);
  const dim3 decode_grid(static_cast<unsigned>(p.entry_count),
                         static_cast<unsigned>(p.kv_heads * (group / qpb)),
                         static_cast<unsigned>(max_splits));
  const dim3 combine_grid(static_cast<unsigned>(p.entry_count), static_cast<unsigned>(p.heads));
  const dim3 prefill_grid(static_cast<unsigned>(p.entry_count), static_cast<unsigned>(p.heads),
                          static_cast<unsigned>((max_queries + kPrefillWarps - 1) / kPrefillWarps));
  cudaError_t status = cudaSuccess;
  KVLAB_DISPATCH_DTYPE(p.dtype, T, {
    KVLAB_DISPATCH_HEAD_DIM(p.head_dim, HD, {
      KVLAB_DISPATCH_GROUP(qpb, QPB, {
        status = launch_kernel(decode_kernel<T, HD, QPB>, decode_grid, kDecodeWarps * 32, stream, p,
                               max_splits);
      });
      constexpr int kCombineThreads = HD < 128 ? HD : 128;
      if (status == cudaSuccess)
        status = launch_kernel(combine_kernel<T, HD>, combine_grid, kCombineThreads, stream, p,
                               max_splits);
      if (status == cudaSuccess && p.max_queries > 1)
        status = launch_kernel(prefill_kernel<T, HD>, prefill_grid, kPrefillWarps * 32, stream, p);
    });
  });
  return status;
}

}  // namespace kvlab::cuda
