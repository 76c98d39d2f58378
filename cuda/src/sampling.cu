// Token choice on the device: greedy argmax, and temperature / top-k / top-p sampling with the
// request's own uniform draw, picking the token the host's kvlab::pick_token picks from the same
// logits and draw (kvlab/engine/sampling.hpp). One 256-thread block per row.
#include "common.cuh"

namespace kvlab::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBins = 256;      // one 8-bit digit of the key per radix pass
constexpr int kKeyDigits = 12;  // a 96-bit key: 64 bits of probability, 32 of ~token id

__device__ __forceinline__ unsigned long long double_bits(double v) {
#if defined(KVLAB_CUDA_EMULATION)
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
#else
  return static_cast<unsigned long long>(__double_as_longlong(v));
#endif
}

// A token's place in the host's candidate order (more likely first, the lower id first among
// equals) as one number: larger keys come first. Probabilities are >= 0, so their IEEE bits
// order as they do.
struct Key {
  unsigned long long high = 0;  // the probability's bits
  unsigned low = 0;             // ~token id
};
__device__ __forceinline__ bool key_less(const Key& a, const Key& b) {
  return a.high < b.high || (a.high == b.high && a.low < b.low);
}
__device__ __forceinline__ unsigned key_digit(const Key& k, int d) {  // d = 0: the top 8 bits
  return d < 8 ? static_cast<unsigned>(k.high >> (56 - 8 * d)) & 0xffu
               : (k.low >> (24 - 8 * (d - 8))) & 0xffu;
}
__device__ __forceinline__ void set_key_digit(Key& k, int d, unsigned digit) {
  if (d < 8)
    k.high |= static_cast<unsigned long long>(digit) << (56 - 8 * d);
  else
    k.low |= digit << (24 - 8 * (d - 8));
}
// Whether k's digits above digit d equal prefix's.
__device__ __forceinline__ bool key_matches(const Key& k, const Key& prefix, int d) {
  if (d == 0) return true;
  if (d <= 8) return (k.high >> (64 - 8 * d)) == (prefix.high >> (64 - 8 * d));
  return k.high == prefix.high &&
         (k.low >> (32 - 8 * (d - 8))) == (prefix.low >> (32 - 8 * (d - 8)));
}

// softmax(logits / temperature) as the host computes it: the max logit scores exactly 0, every
// other (logit - max) / T in double, normalised by log(sum(exp)).
struct RowStats {
  float max_logit = 0;
  double inv_temperature = 0;
  double log_normaliser = 0;
};
__device__ __forceinline__ double probability(float logit, const RowStats& s) {
  const double scaled =
      logit == s.max_logit
          ? 0.0
          : (static_cast<double>(logit) - static_cast<double>(s.max_logit)) * s.inv_temperature;
  return exp(scaled - s.log_normaliser);
}
__device__ __forceinline__ Key key_of(const float* row, int i, const RowStats& s) {
  return {double_bits(probability(row[i], s)), ~static_cast<unsigned>(i)};
}

// Block-wide reductions through shared memory; every thread gets the result.
__device__ double block_sum(double v) {
  __shared__ double partial[kThreads];
  __syncthreads();  // a previous call's readers are done
  partial[threadIdx.x] = v;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  return partial[0];
}

// The largest value's index (the lowest on ties) and whether the row is finite.
struct RowMax {
  float value = 0;
  std::int32_t index = -1;
  bool finite = true;
};
// Each thread's best (value, index) to the block's: the largest value, the lowest index on ties
// (index -1: none). Every thread gets the result.
__device__ RowMax block_best(const RowMax& mine) {
  __shared__ float values[kThreads];
  __shared__ std::int32_t indices[kThreads];
  __syncthreads();  // a previous call's readers are done
  values[threadIdx.x] = mine.value;
  indices[threadIdx.x] = mine.index;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float v = values[threadIdx.x + stride];
      const std::int32_t j = indices[threadIdx.x + stride];
      const std::int32_t own = indices[threadIdx.x];
      if (j >= 0 && (own < 0 || v > values[threadIdx.x] || (v == values[threadIdx.x] && j < own))) {
        values[threadIdx.x] = v;
        indices[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  return {values[0], indices[0], true};
}

__device__ RowMax row_max(const float* row, std::int64_t vocab) {
  RowMax mine;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = row[i];
    if (!is_finite(v)) {
      mine.finite = false;
    } else if (mine.index < 0 || v > mine.value) {
      mine.value = v;
      mine.index = static_cast<std::int32_t>(i);
    }
  }
  __shared__ int non_finite;
  if (threadIdx.x == 0) non_finite = 0;
  __syncthreads();
  if (!mine.finite) non_finite = 1;
  RowMax result = block_best(mine);  // (its syncs publish non_finite)
  result.finite = non_finite == 0;
  __syncthreads();  // before another call resets non_finite
  return result;
}

// The row's first token after `after` in the candidate order (larger logit first, the lower id
// first among equals; every token when after.index < 0), over finite rows: the next of a top-k.
// index -1 when none is left.
__device__ RowMax best_after(const float* row, std::int64_t vocab, const RowMax& after) {
  RowMax mine;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = row[i];
    const bool later = after.index < 0 || v < after.value || (v == after.value && i > after.index);
    if (later && (mine.index < 0 || v > mine.value)) {
      mine.value = v;
      mine.index = static_cast<std::int32_t>(i);
    }
  }
  return block_best(mine);
}

// What a radix select accumulates along the candidate order.
enum class Measure { count, mass };

// The first key, in descending order, at which the running count or probability mass (including
// it) reaches `target` (>= when `reach_equal`, else >). 12 passes of 8 bits: each histograms the
// keys that share the digits chosen so far and walks the bins from the top. Returns false when
// the whole row does not reach the target. A later pass whose bins fall short by rounding (they
// sum the same probabilities in another order) takes its last non-empty bin: the group's last key.
__device__ bool select_key(const float* row, int vocab, const RowStats& s, Measure measure,
                           double target, bool reach_equal, Key& result) {
  __shared__ unsigned counts[kBins];
  __shared__ double masses[kBins];
  __shared__ Key prefix;
  __shared__ double above;  // the measure of every key above the prefix's group
  __shared__ int found;
  if (threadIdx.x == 0) {
    prefix = Key{};
    above = 0;
    found = 1;
  }
  for (int d = 0; d < kKeyDigits; ++d) {
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
      counts[b] = 0;
      masses[b] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const Key k = key_of(row, i, s);
      if (!key_matches(k, prefix, d)) continue;
      const unsigned digit = key_digit(k, d);
      atomicAdd(&counts[digit], 1u);
      if (measure == Measure::mass) atomicAdd(&masses[digit], probability(row[i], s));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double running = above;
      int pick = -1, last = -1;
      double before_last = above;
      for (int b = kBins - 1; b >= 0; --b) {
        if (counts[b] == 0) continue;
        const double next =
            running + (measure == Measure::count ? static_cast<double>(counts[b]) : masses[b]);
        if (reach_equal ? next >= target : next > target) {
          pick = b;
          break;
        }
        last = b;
        before_last = running;
        running = next;
      }
      if (pick < 0 && d > 0) {  // rounding: the group reached the target as a whole
        pick = last;
        running = before_last;
      }
      if (pick < 0) {
        found = 0;
      } else {
        set_key_digit(prefix, d, static_cast<unsigned>(pick));
        above = running;
      }
    }
    __syncthreads();
    const bool stop = found == 0;
    __syncthreads();  // every thread has read `found` before another select resets it
    if (stop) return false;
  }
  result = prefix;
  __syncthreads();  // every thread has read prefix before another select resets it
  return true;
}

// The probability mass of the keys >= floor.
__device__ double mass_from(const float* row, int vocab, const RowStats& s, const Key& floor) {
  double mine = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const Key k = key_of(row, i, s);
    if (!key_less(k, floor)) mine += probability(row[i], s);
  }
  return block_sum(mine);
}

// Temperature, then top-k, then top-p, then the draw, as kvlab::pick_token does on the host.
__device__ std::int32_t sample_row(const float* row, int vocab, const RowSampling& c,
                                   float max_logit) {
  RowStats s;
  s.max_logit = max_logit;
  s.inv_temperature = 1.0 / c.temperature;
  double mine = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    mine += probability(row[i], s);         // exp(scaled): the normaliser is still 0
  s.log_normaliser = log(block_sum(mine));  // log(sum(exp(scaled))), as the host's
  Key kept{};                               // the last kept key: every key >= it is kept
  if (c.top_k > 0 && c.top_k < vocab)
    (void)select_key(row, vocab, s, Measure::count, c.top_k, true, kept);
  double kept_mass = mass_from(row, vocab, s, kept);
  Key nucleus;
  if (c.top_p < 1.0 &&
      select_key(row, vocab, s, Measure::mass, c.top_p * kept_mass, true, nucleus) &&
      key_less(kept, nucleus)) {
    kept = nucleus;
    kept_mass = mass_from(row, vocab, s, kept);
  }
  Key drawn;
  if (!select_key(row, vocab, s, Measure::mass, c.uniform * kept_mass, false, drawn) ||
      key_less(drawn, kept))
    drawn = kept;  // the draw landed in the rounding slack at the top: the last kept token
  return static_cast<std::int32_t>(~drawn.low);
}

__global__ void sample_rows_kernel(const float* logits, std::int64_t vocab,
                                   const RowSampling* choices, std::int32_t* out) {
  const float* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  const RowSampling c = choices != nullptr ? choices[blockIdx.x] : RowSampling{};
  const RowMax m = row_max(row, vocab);
  std::int32_t token = m.index;
  if (m.finite && c.temperature > 0) token = sample_row(row, static_cast<int>(vocab), c, m.value);
  if (threadIdx.x == 0) out[blockIdx.x] = m.finite ? token : -1;
}

// Row r's log-probabilities under softmax(logits) as kvlab::token_logprob and kvlab::top_logprobs
// compute them on the host (the max, then log(sum(exp(logit - max))) in double): out row r
// (width) = {chosen token, its logprob}, then counts[r] most likely tokens, then {-1, NaN}.
__global__ void row_logprobs_kernel(const float* logits, std::int64_t vocab,
                                    const std::int32_t* chosen, const std::int32_t* counts,
                                    int width, LogprobEntry* out) {
  const float* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  LogprobEntry* o = out + static_cast<std::int64_t>(blockIdx.x) * width;
  const RowMax m = row_max(row, vocab);
  const int count = counts[blockIdx.x];
  const std::int32_t token = chosen[blockIdx.x];
  if (count < 0 || !m.finite || token < 0 || token >= vocab) {  // none asked, or no choice
    for (int j = threadIdx.x; j < width; j += blockDim.x) o[j] = {-1, quiet_nan()};
    return;
  }
  double mine = 0;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    mine += row[i] == m.value ? 1.0 : exp(static_cast<double>(row[i]) - m.value);
  const double log_sum = log(block_sum(mine));
  const double normaliser = static_cast<double>(m.value) + log_sum;
  if (threadIdx.x == 0)
    o[0] = {token, static_cast<float>(static_cast<double>(row[token]) -
                                      static_cast<double>(m.value) - log_sum)};
  RowMax previous;  // index -1: best_after starts from the top, so only before the first pass
  for (int j = 1; j < width; ++j) {
    if (j <= count && (j == 1 || previous.index >= 0)) previous = best_after(row, vocab, previous);
    const bool kept = j <= count && previous.index >= 0;
    if (threadIdx.x == 0)
      o[j] =
          kept ? LogprobEntry{previous.index,
                              static_cast<float>(static_cast<double>(previous.value) - normaliser)}
               : LogprobEntry{-1, quiet_nan()};
  }
}

}  // namespace

cudaError_t launch_row_logprobs(const float* logits, std::int64_t rows, std::int64_t vocab,
                                const std::int32_t* chosen, const std::int32_t* counts, int width,
                                LogprobEntry* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > 0x7fffffff || rows > 0x7fffffff || width < 1)
    return cudaErrorInvalidValue;
  return launch_kernel(row_logprobs_kernel, static_cast<unsigned>(rows), kThreads, stream, logits,
                       vocab, chosen, counts, width, out);
}

cudaError_t launch_sample_rows(const float* logits, std::int64_t rows, std::int64_t vocab,
                               const RowSampling* choices, std::int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0 || vocab > 0x7fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  return launch_kernel(sample_rows_kernel, static_cast<unsigned>(rows), kThreads, stream, logits,
                       vocab, choices, out);
}

}  // namespace kvlab::cuda
