#include "kvlab/cpu_reference/ops.hpp"

#include <omp.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

extern "C" void openblas_set_num_threads(int threads);  // OpenBLAS's own API (cblas.h)

namespace kvlab::cpu {

void set_num_threads(int threads) {
  omp_set_num_threads(threads);
  Eigen::setNbThreads(threads);
  openblas_set_num_threads(threads);  // Eigen's products run in OpenBLAS (EIGEN_USE_BLAS)
}

int num_threads() {
  return Eigen::nbThreads();
}

void multiply_by_transposed(const RowMatrix& x, const RowMatrix& w, RowMatrix& y, bool accumulate) {
  constexpr Eigen::Index kSkinnyRows = 8;
  if (!accumulate) y.resize(x.rows(), w.rows());
  if (x.rows() > kSkinnyRows) {
    if (accumulate)
      y.noalias() += x * w.transpose();
    else
      y.noalias() = x * w.transpose();
    return;
  }
  const Eigen::Index rows = x.rows(), outputs = w.rows();
#pragma omp parallel for schedule(static)
  for (Eigen::Index n = 0; n < outputs; ++n) {
    const auto w_row = w.row(n);  // (K): read from memory once, dotted with every x row
    for (Eigen::Index m = 0; m < rows; ++m) {
      const float dot = x.row(m).dot(w_row);
      y(m, n) = accumulate ? y(m, n) + dot : dot;
    }
  }
}

void rms_norm(const RowMatrix& x, const Eigen::VectorXf& weight, float eps, RowMatrix& out) {
  out.resize(x.rows(), x.cols());
  const auto gain = weight.transpose().array();  // (1, dim)
#pragma omp parallel for if (x.rows() > 16)
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const float mean_square = x.row(t).squaredNorm() / static_cast<float>(x.cols());
    const float inverse_rms = 1.0f / std::sqrt(mean_square + eps);
    out.row(t).array() = x.row(t).array() * inverse_rms * gain;
  }
}

RopeTable::RopeTable(std::int64_t head_dim, double theta, std::int64_t max_positions)
    : head_dim_(head_dim), cos_(max_positions, head_dim / 2), sin_(max_positions, head_dim / 2) {
  for (std::int64_t i = 0; i < head_dim / 2; ++i) {
    const double inverse_frequency =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    for (std::int64_t p = 0; p < max_positions; ++p) {
      const double angle = static_cast<double>(p) * inverse_frequency;
      cos_(p, i) = static_cast<float>(std::cos(angle));
      sin_(p, i) = static_cast<float>(std::sin(angle));
    }
  }
}

void RopeTable::apply(RowMatrix& rows, std::span<const std::int32_t> positions,
                      std::int64_t n_heads) const {
  const std::int64_t half = head_dim_ / 2;
  for (std::int64_t t = 0; t < rows.rows(); ++t) {
    const auto cos_row = cos_.row(positions[static_cast<std::size_t>(t)]).array();  // (half)
    const auto sin_row = sin_.row(positions[static_cast<std::size_t>(t)]).array();  // (half)
    for (std::int64_t h = 0; h < n_heads; ++h) {
      auto first = rows.row(t).segment(h * head_dim_, half).array();          // x[0 : d/2]
      auto second = rows.row(t).segment(h * head_dim_ + half, half).array();  // x[d/2 : d]
      const Eigen::ArrayXXf x1 = first;
      first = x1 * cos_row - second * sin_row;
      second = second * cos_row + x1 * sin_row;
    }
  }
}

void causal_attention(const RowMatrix& q, const RowMatrix& k, const RowMatrix& v,
                      std::int64_t n_heads, std::int64_t n_kv_heads,
                      std::optional<std::int64_t> window, RowMatrix& out) {
  const std::int64_t tokens = q.rows();
  const std::int64_t head_dim = q.cols() / n_heads;
  const std::int64_t group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  out.resize(tokens, n_heads * head_dim);
  // Queries go in blocks so each block only multiplies the keys it can see (causal, windowed).
  constexpr std::int64_t kBlock = 64;
  const std::int64_t blocks = (tokens + kBlock - 1) / kBlock;
#pragma omp parallel for collapse(2) schedule(dynamic)
  for (std::int64_t h = 0; h < n_heads; ++h) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t kv_head = h / group;
      const std::int64_t q0 = b * kBlock;
      const std::int64_t q1 = std::min(tokens, q0 + kBlock);
      const std::int64_t k0 = window ? std::max<std::int64_t>(0, q0 - *window + 1) : 0;
      const auto q_block = q.block(q0, h * head_dim, q1 - q0, head_dim);        // (B, hd)
      const auto k_block = k.block(k0, kv_head * head_dim, q1 - k0, head_dim);  // (L, hd)
      const auto v_block = v.block(k0, kv_head * head_dim, q1 - k0, head_dim);  // (L, hd)
      RowMatrix scores = (q_block * k_block.transpose()) * scale;               // (B, L)
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
      out.block(q0, h * head_dim, q1 - q0, head_dim).noalias() = scores * v_block;  // (B, hd)
    }
  }
}

}  // namespace kvlab::cpu
