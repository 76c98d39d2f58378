#pragma once
// This machine's limits, measured by the benchmark binary itself in the same run, so figures
// are reported as ratios (the machine's speed drifts from run to run).

namespace kvlab::bench {

// FP32 FMA throughput with `threads` threads, GFLOP/s (an FMA = 2 FLOPs). Measured once.
double measured_fp32_peak_gflops(int threads);

// Sustained read bandwidth with `threads` threads over a 1 GiB buffer, GB/s (10^9 bytes).
// Measured once per process.
double measured_read_bandwidth_gbs(int threads);

}  // namespace kvlab::bench
