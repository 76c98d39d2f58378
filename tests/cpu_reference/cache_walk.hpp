#pragma once
// A sequence walked through a CpuBackend's cache as the engine walks it, against the reference's
// logits: its prompt in chunks of 5 through a scattered view, then decodes, each beside another
// sequence's prefill of 2 tokens a step (whose last logits are checked too).
#include <algorithm>
#include <vector>

#include "kvlab/cpu_reference/cpu_backend.hpp"
#include "kvlab/cpu_reference/reference_model.hpp"

namespace kvlab::test {

// The two sequences: 35 tokens (29 of prompt, 6 decodes) and 11 beside them.
struct CacheWalk {
  std::vector<std::int32_t> whole, other{9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11};
  cpu::RowMatrix expected, expected_other;  // the reference's logits of each, every position

  explicit CacheWalk(const cpu::ReferenceModel& reference) : whole(35) {
    for (std::size_t i = 0; i < whole.size(); ++i)
      whole[i] = static_cast<std::int32_t>((i * 37 + 11) % 500);
    expected = reference.forward(whole);
    expected_other = reference.forward(other);
  }

  // The largest |logit - reference logit| over every row the walk checks, on `backend`, whose
  // pool must hold slots 0-112 and 200-207.
  double worst_delta(cpu::CpuBackend& backend) const {
    const KvView view{{{40, 10}, {3, 12}, {100, 13}}, 0, {}};  // 35 slots, scattered
    double worst = 0;
    const auto compare = [&](const cpu::RowMatrix& logits, std::int64_t row,
                             const cpu::RowMatrix& truth, std::int64_t position) {
      worst =
          std::max<double>(worst, (logits.row(row) - truth.row(position)).cwiseAbs().maxCoeff());
    };
    for (std::int64_t start = 0; start < 29; start += 5) {  // the prompt, 5 tokens a chunk
      const std::int64_t n = std::min<std::int64_t>(5, 29 - start);
      BatchEntry chunk{{whole.data() + start, static_cast<std::size_t>(n)}, start, view};
      chunk.logit_rows = static_cast<std::int32_t>(n);
      const cpu::RowMatrix& logits = backend.run({&chunk, 1});
      for (std::int64_t r = 0; r < n; ++r) compare(logits, r, expected, start + r);
    }
    for (std::int64_t position = 29; position < 35; ++position) {  // decodes beside a prefill
      const BatchEntry decode{{whole.data() + position, 1}, position, view};
      const std::int64_t first = (position - 29) * 2, n = std::min<std::int64_t>(2, 11 - first);
      const BatchEntry prefill{
          {other.data() + first, static_cast<std::size_t>(std::max<std::int64_t>(n, 1))},
          first,
          KvView{{{0, 3}, {200, 8}}, 0, {}}};
      const std::vector<BatchEntry> batch =
          n > 0 ? std::vector<BatchEntry>{decode, prefill} : std::vector<BatchEntry>{decode};
      const cpu::RowMatrix& logits = backend.run(batch);
      compare(logits, 0, expected, position);
      if (n > 0 && first + n == 11) compare(logits, 1, expected_other, 10);
    }
    return worst;
  }
};

}  // namespace kvlab::test
