#include "machine_peak.hpp"

#include <omp.h>

#include <chrono>
#include <map>
#include <mutex>

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#endif

namespace kvlab::bench {
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
  return cache[threads] = best;
}

}  // namespace kvlab::bench
