#include "kvlab/cpu_reference/machine_peak.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <omp.h>

#include <chrono>
#include <map>
#include <mutex>
#include <vector>

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvlab::cpu {
namespace {

// Independent accumulator chains, enough to cover FMA latency x FMA ports.
constexpr int kChains = 12;

double fma_flops_one_thread(long iterations) {
#if defined(__FMA__) && defined(__AVX__)
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(0.001f * static_cast<float>(c));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  volatile float sink = _mm256_cvtss_f32(sum);
  (void)sink;
  return 2.0 * 8 * kChains * static_cast<double>(iterations);
#else
  float acc[kChains * 8];
  for (int c = 0; c < kChains * 8; ++c) acc[c] = 0.001f * static_cast<float>(c);
  for (long i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains * 8; ++c) acc[c] = acc[c] * 0.999999f + 1e-7f;
  float sum = 0;
  for (float v : acc) sum += v;
  volatile float sink = sum;
  (void)sink;
  return 2.0 * 8 * kChains * static_cast<double>(iterations);
#endif
}

}  // namespace

double measured_fp32_peak_gflops(int threads) {
  static std::mutex mutex;
  static std::map<int, double> cache;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  return cache[threads] = probe_fp32_peak_gflops(threads);
}

double probe_fp32_peak_gflops(int threads) {
  double best = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {  // best of 5 x ~0.1 s
    double flops = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += fma_flops_one_thread(4'000'000);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, flops / seconds / 1e9);
  }
  return best;
}

double measured_read_bandwidth_gbs(int threads) {
  static std::mutex mutex;
  static std::map<int, double> cache;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  const std::size_t count = (std::size_t{1} << 30) / sizeof(float);
  std::vector<float> buffer(count);
#pragma omp parallel for num_threads(threads)
  for (std::size_t i = 0; i < count; ++i)
    buffer[i] = static_cast<float>(i & 1023);  // touch every page
  double best = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    double total = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      // Eight independent vector sums per thread: the loads, not the add latency, set the pace.
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const std::size_t begin =
          count / 64 * static_cast<std::size_t>(t) / static_cast<std::size_t>(n) * 64;
      const std::size_t end =
          count / 64 * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(n) * 64;
      float lanes[64] = {};
      for (std::size_t i = begin; i < end; i += 64)
#pragma omp simd
        for (int j = 0; j < 64; ++j) lanes[j] += buffer[i + static_cast<std::size_t>(j)];
      for (float v : lanes) total += v;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    volatile double sink = total;
    (void)sink;
    best = std::max(best, static_cast<double>(count * sizeof(float)) / seconds / 1e9);
  }
  return cache[threads] = best;
}

}  // namespace kvlab::cpu
