#include "kvlab/cpu_reference/ops.hpp"

#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kvlab/memory_limit.hpp"
#include "parallel.hpp"

extern "C" void openblas_set_num_threads(int threads);  // OpenBLAS's own API (cblas.h)
extern "C" int openblas_get_num_threads();

namespace kvlab::cpu {
namespace {

// OpenBLAS (its OpenMP build) starts with OMP_NUM_THREADS, or every core, whatever
// OMP_THREAD_LIMIT says, and then waits forever (yielding the processor) inside a parallel region
// the limit keeps to fewer threads than it counts on. Told the limit as the library loads.
[[maybe_unused]] const bool kOpenBlasWithinTheThreadLimit = [] {
  const int limit = std::max(1, omp_get_thread_limit());
  if (openblas_get_num_threads() > limit) openblas_set_num_threads(limit);
  return true;
}();

}  // namespace

void set_num_threads(int threads) {
  // More threads than processors only oversubscribes; OpenBLAS at 64+ threads under an
  // address-space limit spins forever allocating its buffers. Capped to the processors, and to
  // OMP_THREAD_LIMIT where the environment sets one: the test suite sets 1, as ctest runs two
  // tests at once on 2 cores, and two 2-thread runs there wake their threads through futexes
  // tens of thousands of times a second (a 2 s test took 133 s on a CI machine). Eigen and
  // OpenBLAS are told the same number OpenMP gives: OpenBLAS told 2 under a limit of 1 yields
  // the processor in a loop (sys time 6x the work).
  const int cap = std::min(omp_get_num_procs(), omp_get_thread_limit());
  threads = std::clamp(threads, 1, std::max(1, cap));
  omp_set_num_threads(threads);  // OpenMP's own regions (perplexity's chunks, the probes)
  configure_threads(threads);    // the backend's regions (thread_pool.hpp)
  Eigen::setNbThreads(threads);
  openblas_set_num_threads(threads);  // Eigen's products run in OpenBLAS (EIGEN_USE_BLAS)
}

int num_threads() {
  return configured_threads();  // what set_num_threads gave the pool, Eigen and OpenBLAS
}

namespace {

#if defined(__AVX2__) && defined(__FMA__)
float horizontal_sum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_shuffle_ps(sum2, sum2, 1)));
}

// out[i][j] = x row i . w row j over k in [0, k_vec): a 2 x 4 register tile, 8 accumulators +
// 4 w vectors + 1 x vector (13 of AVX2's 16 registers: no spills), 6 loads per 8 FMAs.
void tile_2x4(const float* x, const float* w, std::int64_t ld, std::int64_t k_vec,
              float (&out)[2][4]) {
  __m256 acc[2][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < k_vec; k += 8) {
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm256_loadu_ps(w + j * ld + k);
    for (int i = 0; i < 2; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ld + k);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) out[i][j] = horizontal_sum(acc[i][j]);
}
#endif

}  // namespace

void multiply_by_transposed(const RowMatrix& x, const RowMatrix& w, RowMatrix& y, bool accumulate) {
  constexpr Eigen::Index kSkinnyRows = 16;  // measured: BLAS (with packing) wins above ~16 rows
  if (!accumulate) y.resize(x.rows(), w.rows());
  if (x.rows() > kSkinnyRows) {
    if (accumulate)
      y.noalias() += x * w.transpose();
    else
      y.noalias() = x * w.transpose();
    return;
  }
  // Few rows (decode batches): no packing. Each thread takes 4 rows of w at a time, reads them
  // from memory once and multiplies them with every row of x (which stays in cache).
  const Eigen::Index rows = x.rows(), outputs = w.rows();
  const Eigen::Index n_blocks = (outputs + 3) / 4;
  parallel_for(n_blocks, [&](Eigen::Index block) {
    const Eigen::Index n0 = block * 4, n_count = std::min<Eigen::Index>(4, outputs - n0);
    Eigen::Index m0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const Eigen::Index depth = x.cols(), k_vec = depth / 8 * 8;
    if (n_count == 4) {
      for (; m0 + 2 <= rows; m0 += 2) {
        float tile[2][4];
        tile_2x4(x.row(m0).data(), w.row(n0).data(), depth, k_vec, tile);
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 4; ++j) {
            float value = tile[i][j];
            for (Eigen::Index k = k_vec; k < depth; ++k) value += x(m0 + i, k) * w(n0 + j, k);
            y(m0 + i, n0 + j) = accumulate ? y(m0 + i, n0 + j) + value : value;
          }
      }
    }
#endif
    for (; m0 < rows; ++m0)  // edges (and machines without AVX2): plain dot products
      for (Eigen::Index j = 0; j < n_count; ++j) {
        const float dot = x.row(m0).dot(w.row(n0 + j));
        y(m0, n0 + j) = accumulate ? y(m0, n0 + j) + dot : dot;
      }
  });
}

LayerRopes::LayerRopes(const ModelConfig& config)
    : global_(config), global_layer_every_(config.global_layer_every) {
  if (config.global_layer_every > 0 && config.rope_local_theta > 0)
    local_.emplace(config.head_dim, config.rope_local_theta, config.max_position_embeddings);
}

float query_rescale(const ModelConfig& config) {
  return config.query_scale > 0
             ? static_cast<float>(config.query_scale *
                                  std::sqrt(static_cast<double>(config.head_dim)))
             : 1.0f;
}

void rms_norm(const RowMatrix& x, Eigen::Ref<const Eigen::VectorXf> weight, float eps,
              RowMatrix& out) {
  out.resize(x.rows(), x.cols());
  const auto gain = weight.transpose().array();  // (1, dim)
  parallel_for(
      x.rows(),
      [&](Eigen::Index t) {
        const float mean_square = x.row(t).squaredNorm() / static_cast<float>(x.cols());
        const float inverse_rms = 1.0f / std::sqrt(mean_square + eps);
        out.row(t).array() = x.row(t).array() * inverse_rms * gain;
      },
      17);
}

void rms_norm_row_heads(float* row, std::int64_t heads, Eigen::Ref<const Eigen::VectorXf> weight,
                        float eps) {
  const std::int64_t head_dim = weight.size();
  for (std::int64_t h = 0; h < heads; ++h) {
    Eigen::Map<Eigen::VectorXf> head(row + h * head_dim, head_dim);  // (head_dim)
    const float inverse_rms =
        1.0f / std::sqrt(head.squaredNorm() / static_cast<float>(head_dim) + eps);
    head.array() = head.array() * inverse_rms * weight.array();
  }
}

void rms_norm_heads(RowMatrix& rows, Eigen::Ref<const Eigen::VectorXf> weight, float eps) {
  const std::int64_t heads = rows.cols() / weight.size();
  parallel_for(
      rows.rows(),
      [&](std::int64_t t) { rms_norm_row_heads(rows.row(t).data(), heads, weight, eps); }, 17);
}

void gated_activation(const RowMatrix& gate_up, std::int64_t ffn,
                      ModelConfig::Activation activation, RowMatrix& hidden) {
  hidden.resize(gate_up.rows(), ffn);
  const bool gelu = activation == ModelConfig::Activation::gelu_tanh;
  parallel_for(
      gate_up.rows(),
      [&](std::int64_t t) {
        const auto gate = gate_up.row(t).head(ffn).array();
        const auto up = gate_up.row(t).tail(ffn).array();
        if (gelu) {
          constexpr float kSqrt2OverPi = 0.7978845608028654f;
          hidden.row(t).array() =
              0.5f * gate * (1.0f + (kSqrt2OverPi * (gate + 0.044715f * gate.cube())).tanh()) * up;
        } else {
          hidden.row(t).array() = gate / (1.0f + (-gate).exp()) * up;
        }
      },
      17);
}

namespace {
ModelConfig plain_rope_config(std::int64_t head_dim, double theta) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  return c;
}
}  // namespace

RopeTable::RopeTable(const ModelConfig& config)
    : RopeTable(rope_inverse_frequencies(config), config.max_position_embeddings) {}

RopeTable::RopeTable(std::int64_t head_dim, double theta, std::int64_t max_positions)
    : RopeTable(rope_inverse_frequencies(plain_rope_config(head_dim, theta)), max_positions) {}

namespace {
// The table's rows, checked first: a legal 2^31-position context asks for 2^31 rows.
std::int64_t checked_rope_rows(std::int64_t positions, std::size_t frequencies) {
  check_allocation(2 * static_cast<std::uint64_t>(positions) * frequencies * sizeof(float),
                   fmt::format("the RoPE cos/sin table for max_position_embeddings = {} ({} "
                               "frequencies)",
                               positions, frequencies));
  return positions;
}
}  // namespace

RopeTable::RopeTable(std::span<const double> inverse_frequencies, std::int64_t max_positions)
    : head_dim_(2 * static_cast<std::int64_t>(inverse_frequencies.size())),
      cos_(checked_rope_rows(max_positions, inverse_frequencies.size()), head_dim_ / 2),
      sin_(max_positions, head_dim_ / 2) {
  for (std::int64_t i = 0; i < head_dim_ / 2; ++i) {
    const double inverse_frequency = inverse_frequencies[static_cast<std::size_t>(i)];
    for (std::int64_t p = 0; p < max_positions; ++p) {
      const double angle = static_cast<double>(p) * inverse_frequency;
      cos_(p, i) = static_cast<float>(std::cos(angle));
      sin_(p, i) = static_cast<float>(std::sin(angle));
    }
  }
}

void RopeTable::apply(RowMatrix& rows, std::span<const std::int32_t> positions,
                      std::int64_t n_heads) const {
  parallel_for(
      rows.rows(),
      [&](std::int64_t t) {
        apply_row(rows.row(t).data(), positions[static_cast<std::size_t>(t)], n_heads);
      },
      17);
}

void RopeTable::apply_row(float* row, std::int32_t position, std::int64_t n_heads) const {
  const std::int64_t half = head_dim_ / 2;
  const float* cos_row = cos_.row(position).data();  // (half)
  const float* sin_row = sin_.row(position).data();  // (half)
  for (std::int64_t h = 0; h < n_heads; ++h) {
    float* first = row + h * head_dim_;  // x[0 : d/2]; x[d/2 : d] follows
    for (std::int64_t i = 0; i < half; ++i) {
      const float x1 = first[i], x2 = first[i + half];
      first[i] = x1 * cos_row[i] - x2 * sin_row[i];
      first[i + half] = x2 * cos_row[i] + x1 * sin_row[i];
    }
  }
}

void causal_attention(const RowMatrix& q, const RowMatrix& k, const RowMatrix& v,
                      std::int64_t n_heads, std::int64_t n_kv_heads,
                      std::optional<std::int64_t> window, RowMatrix& out) {
  const std::int64_t tokens = q.rows();
  const std::int64_t head_dim = q.cols() / n_heads, value_dim = v.cols() / n_kv_heads;
  const std::int64_t group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  out.resize(tokens, n_heads * value_dim);
  // Queries go in blocks so each block only multiplies the keys it can see (causal, windowed).
  constexpr std::int64_t kBlock = 64;
  const std::int64_t blocks = (tokens + kBlock - 1) / kBlock;
  parallel_for<LoopSchedule::one_at_a_time>(n_heads * blocks, [&](std::int64_t task) {
    const std::int64_t h = task / blocks, b = task % blocks;  // (head, query block)
    const std::int64_t kv_head = h / group;
    const std::int64_t q0 = b * kBlock;
    const std::int64_t q1 = std::min(tokens, q0 + kBlock);
    const std::int64_t k0 = window ? std::max<std::int64_t>(0, q0 - *window + 1) : 0;
    const auto q_block = q.block(q0, h * head_dim, q1 - q0, head_dim);          // (B, hd)
    const auto k_block = k.block(k0, kv_head * head_dim, q1 - k0, head_dim);    // (L, hd)
    const auto v_block = v.block(k0, kv_head * value_dim, q1 - k0, value_dim);  // (L, vd)
    RowMatrix scores = (q_block * k_block.transpose()) * scale;                 // (B, L)
    for (std::int64_t i = 0; i < q1 - q0; ++i) {
      // Query q0 + i sees keys [first, q0 + i]: causal, and within the window if any.
      const std::int64_t position = q0 + i;
      const std::int64_t first = window ? std::max<std::int64_t>(k0, position - *window + 1) : k0;
      auto row = scores.row(i);
      auto visible = row.segment(first - k0, position - first + 1);
      const float max_score = visible.maxCoeff();
      visible = (visible.array() - max_score).exp();
      visible /= visible.sum();
      row.head(first - k0).setZero();
      row.tail(q1 - 1 - position).setZero();
    }
    out.block(q0, h * value_dim, q1 - q0, value_dim).noalias() = scores * v_block;  // (B, vd)
  });
}

void hadamard_rotate(float* x, std::int64_t heads, std::int64_t head_dim) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (std::int64_t h = 0; h < heads; ++h, x += head_dim) {
    for (std::int64_t half = 1; half < head_dim; half *= 2)
      for (std::int64_t i = 0; i < head_dim; i += 2 * half)
        for (std::int64_t j = i; j < i + half; ++j) {
          const float a = x[j], b = x[j + half];
          x[j] = a + b;
          x[j + half] = a - b;
        }
    for (std::int64_t d = 0; d < head_dim; ++d) x[d] *= scale;
  }
}

}  // namespace kvlab::cpu
