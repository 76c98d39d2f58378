#pragma once
// This machine's limits, measured by the running process itself (benchmarks report ratios to them;
// `kvlab calibrate` uses them as the CPU profile's peaks).

namespace kvlab::cpu {

// FP32 FMA throughput with `threads` threads, GFLOP/s (an FMA = 2 FLOPs), the best of five
// ~0.1 s runs. Measured once per process.
double measured_fp32_peak_gflops(int threads);
// The same probe, run again now (a shared VM's vCPU can be taken for seconds: one probe read 113
// GFLOP/s and the next 215 on the build VM).
double probe_fp32_peak_gflops(int threads);

// Sustained read bandwidth with `threads` threads over a 1 GiB buffer, GB/s (10^9 bytes).
// Measured once per process.
double measured_read_bandwidth_gbs(int threads);

}  // namespace kvlab::cpu
