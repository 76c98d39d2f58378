// CUDA benchmarks (run by scripts/gpu_check.sh on a GPU machine; they report an error and
// measure nothing where no device is present).
//   DecodeAttention: flash-decoding over the paged device pool, 8 K/V heads, block 16 scattered
//   across the pool: batch 64 x 4096 and 256 x 1024 context, head_dim 128 and 64, GQA 8 and 4;
//   prefill:1 rows run each sequence's context as one causal prompt (4 x 4,096 tokens) and
//   report TFLOP/s instead.
//   Achieved bandwidth = K/V bytes read / kernel time (CUDA events), and its fraction of the
//   device's peak (memory clock x bus width x 2, from the driver). kernel: 0 what
//   launch_attention picks (bf16: tensor cores); 1 the CUDA-core kernels (tensor_cores off: the
//   vectorized decode, the warp-per-query prefill); 2 pools one element off 16-byte alignment,
//   which leaves only the scalar decode kernel; 3 and 4 fp8 (e4m3) and int8 KV pools (the scalar
//   decode kernel, bf16 queries: issue 37's decode-attention ratio against rows 0 and 2, in
//   time and in bytes read). Rows 0 and 1 at the same shape say which bf16 decode kernel to keep.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <numeric>
#include <random>
#include <vector>

#include "kvlab/cuda/device.hpp"
#include "kvlab/cuda/kernels.hpp"

namespace {

using kvlab::cuda::Dtype;

double peak_bandwidth_bytes_per_s() {
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
  return 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
}

// The blocks of every sequence scattered across the pool, as a paged allocator leaves them:
// each sequence's block table in turn.
std::vector<std::int64_t> scattered_block_table(std::int64_t slots, std::int64_t block) {
  std::vector<std::int64_t> blocks(slots / block);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(1));
  for (auto& b : blocks) b *= block;
  return blocks;
}

// One entry per sequence of `context` tokens: its last token decoding, or (prefill) all of it
// as one prompt.
std::vector<kvlab::cuda::AttentionEntry> whole_context_entries(std::int64_t batch,
                                                               std::int64_t context,
                                                               std::int64_t block, bool prefill) {
  std::vector<kvlab::cuda::AttentionEntry> entries(batch);
  for (std::int64_t e = 0; e < batch; ++e) {
    entries[e].first_row = static_cast<std::int32_t>(prefill ? e * context : e);
    entries[e].queries = static_cast<std::int32_t>(prefill ? context : 1);
    entries[e].start_position = static_cast<std::int32_t>(prefill ? 0 : context - 1);
    entries[e].first_position = 0;
    entries[e].block_shift = std::countr_zero(static_cast<std::uint64_t>(block));
    entries[e].table_offset = e * context / block;
  }
  return entries;
}

// Times launch_attention(p) per iteration with CUDA events (after one checked launch); false,
// with the benchmark marked as failed, when that launch fails.
bool time_launches(benchmark::State& state, const kvlab::cuda::AttentionParams& p) {
  if (kvlab::cuda::launch_attention(p, nullptr) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    state.SkipWithError("attention launch failed");
    return false;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (auto _ : state) {
    cudaEventRecord(start);
    kvlab::cuda::launch_attention(p, nullptr);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return true;
}

void DecodeAttention(benchmark::State& state) {
  const kvlab::cuda::DeviceProbe probe = kvlab::cuda::probe_device();
  if (!probe.available) {
    state.SkipWithError(probe.reason.c_str());
    return;
  }
  const Dtype dtype = state.range(0) == 0 ? Dtype::bf16 : Dtype::f32;
  const int split_keys = static_cast<int>(state.range(1));
  const int kernel = static_cast<int>(state.range(2));
  const bool scalar = kernel == 2;
  const std::int64_t batch = state.range(3), context = state.range(4), head_dim = state.range(5),
                     kv_heads = 8, heads = kv_heads * state.range(6), block = 16;
  const bool prefill = state.range(7) != 0;  // each sequence's whole context as one prompt
  const std::int64_t rows = prefill ? batch * context : batch;
  const std::int64_t slots = batch * context;
  const std::size_t element = kvlab::cuda::dtype_bytes(dtype);
  const kvlab::cuda::KvFormat kv_format = kernel == 3   ? kvlab::cuda::KvFormat::fp8_e4m3
                                          : kernel == 4 ? kvlab::cuda::KvFormat::int8
                                                        : kvlab::cuda::KvFormat::compute;
  const auto pool_bytes = static_cast<std::size_t>(
      slots * kv_heads * kvlab::cuda::kv_row_bytes(kv_format, dtype, head_dim));
  const std::vector<std::int64_t> table = scattered_block_table(slots, block);
  const auto entries = whole_context_entries(batch, context, block, prefill);
  void *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr, *d_table = nullptr,
       *d_entries = nullptr, *workspace = nullptr;
  const std::int64_t workspace_floats =
      kvlab::cuda::attention_workspace_floats(batch, heads, head_dim, context, split_keys);
  const std::size_t shift = scalar ? element : 0;  // bytes before the first slot
  cudaMalloc(&k, pool_bytes + shift);
  cudaMalloc(&v, pool_bytes + shift);
  cudaMalloc(&q, rows * heads * head_dim * element);
  cudaMalloc(&out, rows * heads * head_dim * element);
  cudaMalloc(&d_table, table.size() * sizeof(std::int64_t));
  cudaMalloc(&d_entries, entries.size() * sizeof(entries[0]));
  cudaMalloc(&workspace, workspace_floats * sizeof(float));
  cudaMemset(k, 0, pool_bytes + shift);
  cudaMemset(v, 0, pool_bytes + shift);
  cudaMemset(q, 0, rows * heads * head_dim * element);
  cudaMemcpy(d_table, table.data(), table.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice);
  cudaMemcpy(d_entries, entries.data(), entries.size() * sizeof(entries[0]),
             cudaMemcpyHostToDevice);
  kvlab::cuda::AttentionParams p;
  p.q = q;
  p.q_row_stride = heads * head_dim;
  p.k_pool = static_cast<char*>(k) + shift;
  p.v_pool = static_cast<char*>(v) + shift;
  p.block_table = static_cast<const std::int64_t*>(d_table);
  p.entries = static_cast<const kvlab::cuda::AttentionEntry*>(d_entries);
  p.entry_count = static_cast<std::int32_t>(batch);
  p.max_keys = static_cast<std::int32_t>(prefill ? 1 : context);
  p.max_queries = static_cast<std::int32_t>(prefill ? context : 1);
  p.out = out;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.split_keys = split_keys;
  p.workspace = static_cast<float*>(workspace);
  p.dtype = dtype;
  p.tensor_cores = kernel == 0;
  p.kv_format = kv_format;
  if (time_launches(state, p)) {
    if (prefill) {  // causal: query i attends to i + 1 keys, 2 FLOPs per MAC, Q K^T and P V
      const double flops = 4.0 * static_cast<double>(batch * heads * head_dim) *
                           static_cast<double>(context) * static_cast<double>(context + 1) / 2.0;
      state.counters["TFLOP_per_s"] =
          benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
    } else {
      const double bytes = 2.0 * static_cast<double>(pool_bytes);  // K and V
      state.counters["kv_GB_per_s"] =
          benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
      state.counters["peak_GB_per_s"] = peak_bandwidth_bytes_per_s() / 1e9;
    }
    state.SetLabel(probe.name);
  }
  for (void* ptr : {k, v, q, out, d_table, d_entries, workspace}) cudaFree(ptr);
}
// The shapes issue 15 sets its target on (>= 80% of HBM peak in bf16): batch 64 x 4096 and
// 256 x 1024 context, head_dim 128 and 64, GQA 8 and 4, on tensor cores and on CUDA cores; then
// splits, fp32 and the scalar kernel at the first shape.
void DecodeShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"f32", "split", "kernel", "batch", "context", "hd", "group", "prefill"});
  for (const int kernel : {0, 1})
    for (const auto& [batch, context] : {std::pair{64, 4096}, std::pair{256, 1024}})
      for (const int head_dim : {128, 64})
        for (const int group : {8, 4})
          b->Args({0, 512, kernel, batch, context, head_dim, group, 0});
  for (const int split : {256, 1024}) b->Args({0, split, 0, 64, 4096, 128, 8, 0});
  b->Args({0, 512, 0, 64, 4096, 128, 1, 0});  // MHA: one row of the tensor-core tile
  b->Args({1, 512, 0, 64, 4096, 128, 8, 0});
  b->Args({0, 512, 2, 64, 4096, 128, 8, 0});
  b->Args({1, 512, 2, 64, 4096, 128, 8, 0});
  for (const int quantized : {3, 4}) {  // fp8, int8 KV
    b->Args({0, 512, quantized, 64, 4096, 128, 8, 0});
    b->Args({0, 512, quantized, 256, 1024, 64, 4, 0});
  }
  b->Args({0, 512, 2, 256, 1024, 64, 4, 0});  // the scalar bf16 kernel at the second shape
  // Prefill (issue 15's tensor-core target: >= 300 TFLOP/s at 4k-token prompts, head_dim 128):
  // 4 prompts of 4,096 tokens, 32 query heads over 8 K/V heads; bf16 on tensor cores, on CUDA
  // cores, and f32.
  for (const int kernel : {0, 1}) b->Args({0, 512, kernel, 4, 4096, 128, 4, 1});
  b->Args({1, 512, 0, 4, 4096, 128, 4, 1});
}
BENCHMARK(DecodeAttention)->Apply(DecodeShapes)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
