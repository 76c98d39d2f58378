#pragma once
// Hardware profiles: what the simulated backend's cost model knows about a device. Stored as
// TOML files (profiles/*.toml, installed to <prefix>/share/kvlab/profiles) and selectable by
// name ("h200") or by path ("my-gpu.toml"); `kvlab calibrate` writes them.
#include <cstdint>
#include <filesystem>
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
