// y (+)= x w^T for f32/f16/bf16 weights in panels (panels.hpp) with fp32 activations: the
// reference's function over the stored values, each output summed over k in order. The panels
// were packed once at load, so a product only reads them. x is packed in tiles of kTileRows rows
// ((depth, kTileRows): a tile's broadcasts read consecutive floats), and the threads take
// contiguous ranges of panels, i.e. of the matrix's bytes, in guided chunks (parallel.hpp: a
// quarter of what is left for two threads, ... then one at a time): when one thread runs behind,
// the other takes the last panels instead of waiting at the join (f16 and f32 at batch 64: +1-3%
// over equal static halves):
//   up to kTileRows rows of x   one tile per panel, whose values are widened in registers as they
//                               stream from memory (decode at small batches: every weight byte
//                               read once, nothing written);
//   more rows                   an f16/bf16 panel is widened once into an fp32 buffer (an f32
//                               panel is used in place) that every tile runs against from cache,
//                               while the tiles' loops ask for the next panel's bytes a line at a
//                               time (a burst of prefetches waits on the core's miss buffers).
// AVX-512: tiles of 8 rows x 32 outputs (16 accumulators); AVX2 + FMA + F16C: 6 rows x 16 outputs,
// each half of a panel in turn; without AVX2, Eigen products over widened panels.
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVLAB_PANEL_SIMD 1
#include <immintrin.h>
#endif

#include <Eigen/Dense>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kvlab/dtype.hpp"
#include "panels.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

using panels::kPanelRows;
using panels::panel_count;

std::int64_t panel_bytes(const WeightMatrix& w) {
  return kPanelRows * w.cols() * weight_format_block_bytes(w.format());
}

#if KVLAB_PANEL_SIMD
#if defined(__AVX512F__)
constexpr int kTileRows = 8;
constexpr std::int64_t kLanes = 16;
using Vec = __m512;
inline Vec zero() {
  return _mm512_setzero_ps();
}
inline Vec broadcast(const float* p) {
  return _mm512_set1_ps(*p);
}
inline Vec fmadd(Vec a, Vec b, Vec c) {
  return _mm512_fmadd_ps(a, b, c);
}
inline void store(float* p, Vec v) {
  _mm512_storeu_ps(p, v);
}
// kLanes values of a panel from element `index`, widened to fp32.
template <WeightFormat F>
Vec load_values(const std::byte* panel, std::int64_t index) {
  if constexpr (F == WeightFormat::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(panel) + index);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 2 * index));
    if constexpr (F == WeightFormat::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#else
constexpr int kTileRows = 6;  // 12 accumulators of AVX2's 16 registers
constexpr std::int64_t kLanes = 8;
using Vec = __m256;
inline Vec zero() {
  return _mm256_setzero_ps();
}
inline Vec broadcast(const float* p) {
  return _mm256_broadcast_ss(p);
}
inline Vec fmadd(Vec a, Vec b, Vec c) {
  return _mm256_fmadd_ps(a, b, c);
}
inline void store(float* p, Vec v) {
  _mm256_storeu_ps(p, v);
}
template <WeightFormat F>
Vec load_values(const std::byte* panel, std::int64_t index) {
  if constexpr (F == WeightFormat::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(panel) + index);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 2 * index));
    if constexpr (F == WeightFormat::f16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
#endif
constexpr std::int64_t kTileColumns = 2 * kLanes;  // outputs of one tile: 32 or 16
constexpr std::int64_t kPasses = kPanelRows / kTileColumns;

// Rows of x packed per tile: fewer than kTileRows rows are one tile of just their height (no zero
// rows widening the stride of its broadcasts: at depth 2048 a padded single row takes 64 KiB).
std::int64_t tile_stride(std::int64_t rows) {
  return std::min<std::int64_t>(rows, kTileRows);
}

// A slice of the next panel's bytes to ask for during one tile: `burst` 64-byte lines every
// `every` columns of the tile's loop.
struct Prefetch {
  const std::byte* next = nullptr;
  std::int64_t lines = 0, every = 1, burst = 1;

  // `lines` lines from `first`, spread over a loop of `depth` columns.
  static Prefetch spread(const std::byte* first, std::int64_t lines, std::int64_t depth) {
    const std::int64_t burst = std::max<std::int64_t>(1, (lines + depth - 1) / depth);
    return {first, lines,
            std::max<std::int64_t>(1, depth * burst / std::max<std::int64_t>(1, lines)), burst};
  }
};

// out (Rows, kTileColumns) = x tile . panel columns [c0, c0 + kTileColumns); x (depth, stride):
// x[k * stride + i] is row i's value k.
template <int Rows, WeightFormat F>
void panel_tile(const float* x, std::int64_t stride, const std::byte* panel, std::int64_t c0,
                std::int64_t depth, Prefetch ahead, float* out) {
  Vec acc[Rows][2];
  for (auto& row : acc) row[0] = row[1] = zero();
  for (std::int64_t k0 = 0; k0 < depth; k0 += ahead.every) {
    const std::int64_t burst = std::min(ahead.burst, ahead.lines);
    for (std::int64_t b = 0; b < burst; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(ahead.next + 64 * b), _MM_HINT_T1);
    ahead.next += 64 * burst;
    ahead.lines -= burst;
    for (std::int64_t k = k0; k < std::min(depth, k0 + ahead.every); ++k) {
      const std::int64_t index = k * kPanelRows + c0;
      const Vec w0 = load_values<F>(panel, index), w1 = load_values<F>(panel, index + kLanes);
      for (int i = 0; i < Rows; ++i) {
        const Vec xi = broadcast(x + k * stride + i);
        acc[i][0] = fmadd(xi, w0, acc[i][0]);
        acc[i][1] = fmadd(xi, w1, acc[i][1]);
      }
    }
  }
  for (int i = 0; i < Rows; ++i) {
    store(out + i * kTileColumns, acc[i][0]);
    store(out + i * kTileColumns + kLanes, acc[i][1]);
  }
}

// The tile for the last rows (fewer than kTileRows): Rows counts down to the one needed.
template <WeightFormat F, int Rows = kTileRows>
void panel_tile_rows(int rows, const float* x, std::int64_t stride, const std::byte* panel,
                     std::int64_t c0, std::int64_t depth, Prefetch ahead, float* out) {
  if constexpr (Rows > 1) {
    if (rows < Rows)
      return panel_tile_rows<F, Rows - 1>(rows, x, stride, panel, c0, depth, ahead, out);
  }
  panel_tile<Rows, F>(x, stride, panel, c0, depth, ahead, out);
}

// Where one panel's products go: y's columns [n0, n0 + count).
struct PanelOutput {
  RowMatrix& y;
  std::int64_t n0, count;
  bool accumulate;
};

// Every tile of x against one panel (`values` in format F); `next`, `next_bytes`: the bytes to
// ask for meanwhile, spread over the tiles (none with a single tile: it streams from memory).
template <WeightFormat F>
void tiles_against_panel(const float* x_tiles, std::int64_t rows, const std::byte* values,
                         std::int64_t depth, const std::byte* next, std::int64_t next_bytes,
                         const PanelOutput& o) {
  const std::int64_t tiles = (rows + kTileRows - 1) / kTileRows, steps = tiles * kPasses;
  const std::int64_t lines = tiles > 1 && next ? (next_bytes + 63) / 64 : 0;
  const std::int64_t slice = (lines + steps - 1) / steps;
  for (std::int64_t t = 0; t < tiles; ++t)
    for (std::int64_t pass = 0; pass < kPasses; ++pass) {
      const std::int64_t c0 = pass * kTileColumns, columns = std::min(kTileColumns, o.count - c0);
      const std::int64_t first_line = std::min(lines, (t * kPasses + pass) * slice);
      const Prefetch ahead =
          Prefetch::spread(next + 64 * first_line, std::min(slice, lines - first_line), depth);
      if (columns <= 0) continue;
      const std::int64_t m0 = t * kTileRows;
      const int tile_rows = static_cast<int>(std::min<std::int64_t>(kTileRows, rows - m0));
      float out[kTileRows * kTileColumns];
      panel_tile_rows<F>(tile_rows, x_tiles + m0 * depth, tile_stride(rows), values, c0, depth,
                         ahead, out);
      for (int i = 0; i < tile_rows; ++i) {
        float* target = o.y.data() + (m0 + i) * o.y.cols() + o.n0 + c0;
        for (std::int64_t j = 0; j < columns; ++j)
          target[j] =
              o.accumulate ? target[j] + out[i * kTileColumns + j] : out[i * kTileColumns + j];
      }
    }
}

// One panel: f16/bf16 widened into `widened` first when several tiles will read it.
template <WeightFormat F>
void panel_product(const float* x_tiles, std::int64_t rows, const std::byte* panel,
                   std::int64_t depth, const std::byte* next, std::int64_t next_bytes,
                   std::vector<float>& widened, const PanelOutput& o) {
  if (F == WeightFormat::f32 || rows <= kTileRows)
    return tiles_against_panel<F>(x_tiles, rows, panel, depth, next, next_bytes, o);
  for (std::int64_t i = 0; i < depth * kPanelRows; i += kLanes)
    store(widened.data() + i, load_values<F>(panel, i));
  tiles_against_panel<WeightFormat::f32>(x_tiles, rows,
                                         reinterpret_cast<const std::byte*>(widened.data()), depth,
                                         next, next_bytes, o);
}

void multiply_tiled(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t rows = x.rows(), outputs = w.rows(), depth = w.cols();
  const std::int64_t count = panel_count(outputs), bytes = panel_bytes(w);
  thread_local std::vector<float> kept;  // between products: no allocation per call
  std::vector<float>& x_tiles = kept;    // the caller's, shared by the threads below
  const int stride = static_cast<int>(tile_stride(rows));
  const std::int64_t tiles = panels::row_tile_count(rows, stride);
  x_tiles.resize(static_cast<std::size_t>(tiles * stride * depth));
  parallel_region([&] {
    shared_loop(tiles,
                [&](std::int64_t t) { panels::pack_row_tile(x, stride, t, x_tiles.data()); });
    thread_local std::vector<float> widened;
    if (rows > kTileRows && w.format() != WeightFormat::f32)
      widened.resize(static_cast<std::size_t>(depth * kPanelRows));
    shared_loop(count, [&](std::int64_t p) {
      const std::byte* panel = w.data() + p * bytes;
      const std::byte* next = p + 1 < count ? panel + bytes : nullptr;
      const PanelOutput o{y, p * kPanelRows, std::min(kPanelRows, outputs - p * kPanelRows),
                          accumulate};
      switch (w.format()) {
        case WeightFormat::f16:
          panel_product<WeightFormat::f16>(x_tiles.data(), rows, panel, depth, next, bytes, widened,
                                           o);
          break;
        case WeightFormat::bf16:
          panel_product<WeightFormat::bf16>(x_tiles.data(), rows, panel, depth, next, bytes,
                                            widened, o);
          break;
        default:
          panel_product<WeightFormat::f32>(x_tiles.data(), rows, panel, depth, next, bytes, widened,
                                           o);
          break;
      }
    });
  });
}

#else
// Without AVX2: each thread widens a panel to fp32 (depth, 32) and takes Eigen's coefficient-wise
// product of x with it (lazyProduct: no BLAS call from inside the parallel region).
void multiply_plain(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
  const std::int64_t outputs = w.rows(), depth = w.cols(), bytes = panel_bytes(w);
  using PanelMatrix = Eigen::Matrix<float, Eigen::Dynamic, kPanelRows, Eigen::RowMajor>;
  parallel_region([&] {
    thread_local std::vector<float> widened;
    widened.resize(static_cast<std::size_t>(depth * kPanelRows));
    shared_loop(panel_count(outputs), [&](std::int64_t p) {
      convert_to_f32(panels::float_dtype(w.format()),
                     {w.data() + p * bytes, static_cast<std::size_t>(bytes)}, widened);
      const Eigen::Map<const PanelMatrix> panel(widened.data(), depth, kPanelRows);
      const std::int64_t n0 = p * kPanelRows, count = std::min(kPanelRows, outputs - n0);
      auto block = y.middleCols(n0, count);  // (rows, count)
      if (accumulate)
        block += x.lazyProduct(panel.leftCols(count));
      else
        block = x.lazyProduct(panel.leftCols(count));
    });
  });
}
#endif

}  // namespace

namespace panels {

void pack_row_tile(const RowMatrix& x, int tile_rows, std::int64_t tile, float* out) {
  const std::int64_t depth = x.cols(), m0 = tile * tile_rows;
  float* packed = out + m0 * depth;  // (depth, tile_rows)
#if KVLAB_PANEL_SIMD
  if (tile_rows == 8 && depth % 8 == 0) {
    const float* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = m0 + i < x.rows() ? x.row(m0 + i).data() : nullptr;
    for (std::int64_t k = 0; k < depth; k += 8) transpose_8x8(rows, k, packed + k * 8, 8);
    return;
  }
#endif
  for (int i = 0; i < tile_rows; ++i) {
    if (m0 + i >= x.rows()) {
      for (std::int64_t k = 0; k < depth; ++k) packed[k * tile_rows + i] = 0.0f;
      continue;
    }
    const float* row = x.row(m0 + i).data();
    for (std::int64_t k = 0; k < depth; ++k) packed[k * tile_rows + i] = row[k];
  }
}

std::vector<std::byte> pack(const WeightMatrix& w) {
  const std::int64_t depth = w.cols(), size = weight_format_block_bytes(w.format()),
                     bytes = panel_bytes(w);
  std::vector<std::byte> out(static_cast<std::size_t>(panel_count(w.rows()) * bytes));
  parallel_for(w.rows(), [&](std::int64_t r) {
    std::byte* column = out.data() + (r / kPanelRows) * bytes + (r % kPanelRows) * size;
    const std::byte* row = w.row(r);
    for (std::int64_t k = 0; k < depth; ++k)
      std::memcpy(column + k * kPanelRows * size, row + k * size, static_cast<std::size_t>(size));
  });
  return out;
}

void dequantize_panel_rows(const WeightMatrix& w, std::int64_t first, std::int64_t count,
                           float* out) {
  const std::int64_t depth = w.cols(), size = weight_format_block_bytes(w.format()),
                     bytes = panel_bytes(w);
  const DType dtype = panels::float_dtype(w.format());
  for (std::int64_t r = first; r < first + count; ++r) {
    const std::byte* column = w.data() + (r / kPanelRows) * bytes + (r % kPanelRows) * size;
    for (std::int64_t k = 0; k < depth; ++k)
      convert_to_f32(dtype, {column + k * kPanelRows * size, static_cast<std::size_t>(size)},
                     {out++, 1});
  }
}

int tile_rows() {
#if KVLAB_PANEL_SIMD
  return kTileRows;
#else
  return 1;
#endif
}

void multiply(const RowMatrix& x, const WeightMatrix& w, RowMatrix& y, bool accumulate) {
#if KVLAB_PANEL_SIMD
  multiply_tiled(x, w, y, accumulate);
#else
  multiply_plain(x, w, y, accumulate);
#endif
}

}  // namespace panels
}  // namespace kvlab::cpu
