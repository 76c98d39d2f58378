#pragma once
// Hardware profiles: what the simulated backend's cost model knows about a device. Stored as
// TOML files (profiles/*.toml, installed to <prefix>/share/kvlab/profiles) and selectable by
// name ("h200") or by path ("my-gpu.toml"); `kvlab calibrate` writes them.
#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvlab/dtype.hpp"

namespace kvlab {

// Fractions of the datasheet peak an operator group reaches (0 < e <= 1).
struct Efficiency {
  double gemm_compute = 0.7;        // projections + MLP + LM head, FLOP-bound side
  double gemm_memory = 0.85;        // their weight/activation traffic, byte-bound side
  double attention_compute = 0.5;   // prefill attention (QK^T and PV FLOPs)
  double attention_memory = 0.75;   // K/V bytes read (decode attention)
  double elementwise_memory = 0.7;  // RMSNorm, RoPE, SwiGLU, residual adds
};

// Few rows run other kernels than many, each with its own efficiency: matrix products (the CPU
// backend: fused dot products up to 4 rows, packed panels up to 64, BLAS beyond; GPUs: GEMV for
// one row, small-M tiles, tensor-core tiles) and decode attention (the CPU backend: one task per
// sequence and K/V head below 4 sequences per thread, one per sequence from there on). From
// `min_rows` rows on, a regime's efficiencies replace the base ones of [efficiency], up to the
// next regime's min_rows.
struct KernelRegime {
  std::int64_t min_rows = 2;
  double compute = 0.7;
  double memory = 0.85;
};

// What one kernel launch costs beyond its roofline, fitted to measured operators (kvlab calibrate
// --vidur): a fixed time each launch pays (launch, the first and the last wave), and the knee
// joining its compute and memory times. A kernel of compute time c and memory time m takes
// floor_s + (c^k + m^k)^(1/k): k = 0 (unset) is max(c, m), the plain roofline; a small k (1.5 on
// A100 and H100 GEMMs) is the gradual knee between 128 and 512 rows where neither side is reached.
struct KernelTerms {
  double floor_s = 0;
  double knee = 0;
};

// The element-wise kernels a layer runs (and the embedding gather before the first): each its own
// bandwidth fraction and floor where the profile says ([elementwise]), else [efficiency]'s
// elementwise_memory and no floor.
enum class ElementwiseKind { rms_norm, residual_add, rope, activation, kv_write, embedding };
inline constexpr int kElementwiseKinds = 6;
inline constexpr std::array<const char*, kElementwiseKinds> kElementwiseNames = {
    "rms_norm", "residual_add", "rope", "activation", "kv_write", "embedding"};

struct ElementwiseTerm {
  double memory = 0;  // fraction of the bandwidth; 0: [efficiency].elementwise_memory
  double floor_s = 0;
};

// An all-reduce over `gpus` GPUs of one node, measured: latency_s + 2 (gpus - 1) / gpus x B /
// (gb_per_s x 10^9), as [interconnect] but per group size (NCCL picks other algorithms and
// channel counts for 2, 4 and 8 GPUs).
struct AllReduceTerm {
  std::int64_t gpus = 2;
  double latency_s = 0;
  double gb_per_s = 0;
};

struct HardwareProfile {
  std::string name;
  std::string description;
  double peak_tflops = 0;      // dense, in the compute dtype (bf16 tensor cores on GPUs)
  double memory_gb_per_s = 0;  // HBM (or DRAM) bandwidth, 10^9 bytes/s
  double memory_gib = 0;       // device memory, 2^30 bytes
  DType compute_dtype = DType::dtype_bf16;  // weights and activations
  DType kv_dtype = DType::dtype_bf16;
  Efficiency efficiency;
  // By min_rows, ascending; none: the base efficiency for every size. Rows of a product: tokens
  // (projections, MLP), sequences (LM head); of decode attention: the step's sequences.
  std::vector<KernelRegime> gemm_regimes, decode_attention_regimes;
  double step_overhead_s = 0;      // fixed cost of one engine step (launches, scheduling, sync)
  double sequence_overhead_s = 0;  // per sequence in the batch (metadata, sampling)
  // Beyond step_overhead_s, for a step that replays no CUDA graph: one with prefill tokens (vLLM
  // and kvlab's cuda backend capture decode batches only), whose kernels are launched one by one.
  double ungraphed_step_s = 0;
  // [kernels]: per-launch floors and knees (none: the plain rooflines of [efficiency]).
  KernelTerms gemm_kernel, prefill_attention_kernel, decode_attention_kernel;
  // An element-wise kernel of fewer rows (tokens) than this takes as long as this many: one row a
  // thread block, and a wave of blocks occupies the GPU however few of them there are. 0: none.
  double elementwise_wave_rows = 0;
  std::array<ElementwiseTerm, kElementwiseKinds> elementwise{};  // [elementwise], by kind
  // [[allreduce]], by gpus ascending; a group size not listed uses [interconnect].
  std::vector<AllReduceTerm> allreduce;
  // [provenance]: where each fitted term came from (data, models, grid, error), by term name.
  std::map<std::string, std::string> provenance;
  // KV capacity = memory_gib x memory_utilization - weights - activation_reserve_gib.
  double memory_utilization = 0.9;
  double activation_reserve_gib = 1.0;
  // The link swapped KV crosses (device <-> host memory): one copy of B bytes takes
  // swap_latency_s + B / (swap_gb_per_s x 10^9). GPUs: PCIe to host buffers; CPUs: the host
  // pool's rows copied to a host buffer (kvlab calibrate times the engine's own swap copy on
  // either backend and fits both).
  double swap_gb_per_s = 16.0;
  double swap_latency_s = 1e-5;
  // The KV disk tier's storage (docs/concepts/kv-tiers.md): one block read or written takes
  // disk_latency_s + B / (disk_gb_per_s x 10^9); a disk block loaded back also crosses the swap
  // link. Defaults: one NVMe SSD (PCIe 4.0: ~5 GB/s sequential, ~100 us a request).
  double disk_gb_per_s = 5.0;
  double disk_latency_s = 1e-4;
  // Whether KV tier copies run beside the step's compute (a GPU's copy engines, loads layer by
  // layer ahead of attention: the step lasts the longer of the two) or before it on the same
  // cores (a CPU's memcpy: the step lasts both).
  bool tier_copies_overlap = false;
  // The link between the GPUs of a tensor-parallel group: an all-reduce of B bytes over t GPUs
  // takes allreduce_latency_s + 2 (t - 1) / t x B / (allreduce_gb_per_s x 10^9), the ring
  // algorithm's traffic at its bus bandwidth (NCCL's "busbw"). 0: no interconnect (tp 1 only).
  double allreduce_gb_per_s = 0;
  double allreduce_latency_s = 0;
  // The network between replicas ([network]): a disaggregated cluster's KV handoff of B bytes
  // from a prefill GPU to a decode GPU takes kv_transfer_latency_s + B / (kv_transfer_gb_per_s x
  // 10^9) (with tensor parallelism each GPU sends its heads' share over its own NIC). Default:
  // one 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE, as DistServe's and Mooncake's clusters).
  double kv_transfer_gb_per_s = 46.0;
  double kv_transfer_latency_s = 2e-5;
  std::string source;  // the file it was read from ("" when built in code)
};

// Whether any [elementwise] term is set (else one efficiency prices all of them, no floors).
bool has_elementwise_terms(const HardwareProfile& profile);

// An all-reduce of `gpus` GPUs: the [[allreduce]] entry for that size, else [interconnect]'s.
std::pair<double, double> allreduce_latency_and_bandwidth(const HardwareProfile& profile,
                                                          std::int64_t gpus);

// The (compute, memory) efficiencies of `rows` rows under `regimes`, `base` below the first.
std::pair<double, double> regime_efficiency(std::span<const KernelRegime> regimes,
                                            std::int64_t rows, std::pair<double, double> base);

// Reads and validates a profile file: every problem (missing key, wrong type, unknown key with
// a suggestion, non-positive value, efficiency outside (0, 1]) is a kvlab::Error naming the
// file, line and key. `changes` (TOML text, the profile's sections: "[link]\nswap_gb_per_s =
// 10") are merged over the file's tables before the checks, as an experiment's [hardware] asks.
HardwareProfile load_hardware_profile_file(const std::filesystem::path& file,
                                           std::string_view changes = {});

// `name_or_path`: a path (contains '/' or ends in ".toml") or a profile name looked up
// case-insensitively in hardware_profile_search_path(). Unknown names list what exists.
HardwareProfile load_hardware_profile(std::string_view name_or_path, std::string_view changes = {});

// $KVLAB_PROFILE_PATH (colon-separated), <exe>/../share/kvlab/profiles, the source tree's
// profiles/ folder.
std::vector<std::filesystem::path> hardware_profile_search_path();
// Names of the profiles found on the search path, sorted.
std::vector<std::string> hardware_profile_names();

// The TOML text of a profile (what `kvlab calibrate` writes); loading it gives `profile` back.
std::string hardware_profile_to_toml(const HardwareProfile& profile);

}  // namespace kvlab
