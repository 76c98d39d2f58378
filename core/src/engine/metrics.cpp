#include "kvlab/engine/metrics.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvlab/error.hpp"

namespace kvlab {

std::optional<double> RequestTimeline::ttft_s() const {
  if (token_times_s.empty()) return std::nullopt;
  return token_times_s.front() - arrival_s;
}

std::optional<double> RequestTimeline::tpot_s() const {
  if (token_times_s.size() < 2) return std::nullopt;
  return (token_times_s.back() - token_times_s.front()) /
         static_cast<double>(token_times_s.size() - 1);
}

std::optional<double> RequestTimeline::e2e_s() const {
  if (!finish_s) return std::nullopt;
  return *finish_s - arrival_s;
}

std::optional<double> RequestTimeline::queue_delay_s() const {
  if (!first_scheduled_s) return std::nullopt;
  return *first_scheduled_s - arrival_s;
}

double percentile_of_sorted(std::span<const double> sorted, double q) {
  if (sorted.empty()) return 0;
  const double rank = q / 100.0 * static_cast<double>(sorted.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(rank));
  const std::size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = rank - static_cast<double>(below);
  return sorted[below] + (sorted[above] - sorted[below]) * fraction;
}

namespace {

// percentile_of_sorted's figure without sorting: the two ranks around it selected (O(n) each;
// a whole-trace replay summarizes millions of inter-token latencies).
double select_percentile(std::vector<double>& values, double q) {
  const double rank = q / 100.0 * static_cast<double>(values.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(rank));
  const auto at = values.begin() + static_cast<std::ptrdiff_t>(below);
  std::nth_element(values.begin(), at, values.end());
  const double low = *at;
  const double high = below + 1 < values.size() ? *std::min_element(at + 1, values.end()) : low;
  return low + (high - low) * (rank - static_cast<double>(below));
}

}  // namespace

LatencySummary summarize_latencies(std::vector<double> values) {
  LatencySummary s;
  s.count = static_cast<std::int64_t>(values.size());
  if (values.empty()) return s;
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  s.max = *std::max_element(values.begin(), values.end());
  s.p99 = select_percentile(values, 99);
  s.p90 = select_percentile(values, 90);
  s.p50 = select_percentile(values, 50);
  return s;
}

bool meets_slo(const RequestTimeline& r, const ServiceLevelObjectives& instead) {
  const auto ttft = instead.ttft_s ? instead.ttft_s : r.slo.ttft_s;
  const auto tpot = instead.tpot_s ? instead.tpot_s : r.slo.tpot_s;
  const auto e2e = instead.e2e_s ? instead.e2e_s : r.slo.e2e_s;
  return (!ttft || (r.ttft_s() && *r.ttft_s() <= *ttft)) &&
         (!tpot || !r.tpot_s() || *r.tpot_s() <= *tpot) && (!e2e || *r.e2e_s() <= *e2e);
}

namespace {

// A disaggregated request's handoff: its transfer, its wait on the decode replica, its bytes.
void add_handoff(const RequestTimeline& r, std::vector<double>& transfer,
                 std::vector<double>& decode_queue, RunSummary& summary) {
  summary.kv_transfer_bytes += r.kv_transfer_bytes;
  if (r.kv_arrival_s && !r.token_times_s.empty())
    transfer.push_back(*r.kv_arrival_s - r.token_times_s.front());
  if (r.kv_arrival_s && r.decode_scheduled_s)
    decode_queue.push_back(*r.decode_scheduled_s - *r.kv_arrival_s);
}

}  // namespace

RunSummary summarize_run(std::span<const RequestTimeline> requests, double duration_s,
                         const ServiceLevelObjectives& slo) {
  RunSummary summary;
  summary.submitted = static_cast<std::int64_t>(requests.size());
  summary.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2e, queue, transfer, decode_queue;
  std::int64_t output_tokens = 0, prompt_tokens = 0;
  for (const auto& r : requests) {
    summary.preemptions += r.preemptions;
    summary.recomputed_tokens += r.recomputed_tokens;
    summary.swapped_bytes += r.swapped_bytes;
    if (r.rejected) {
      ++summary.rejected;
      continue;
    }
    if (!r.finish_s)
      throw Error(
          fmt::format("request {} was neither finished nor rejected: the run lost it", r.id));
    ++summary.finished;
    output_tokens += r.output_tokens();
    prompt_tokens += r.prompt_tokens;
    if (auto v = r.ttft_s()) ttft.push_back(*v);
    if (auto v = r.tpot_s()) tpot.push_back(*v);
    if (auto v = r.e2e_s()) e2e.push_back(*v);
    if (auto v = r.queue_delay_s()) queue.push_back(*v);
    add_handoff(r, transfer, decode_queue, summary);
    for (std::size_t i = 1; i < r.token_times_s.size(); ++i)
      itl.push_back(r.token_times_s[i] - r.token_times_s[i - 1]);
    if (meets_slo(r, slo)) ++summary.slo_met;
  }
  if (summary.finished + summary.rejected != summary.submitted)
    throw Error("internal: submitted != finished + rejected");
  if (duration_s > 0) {
    summary.requests_per_s = static_cast<double>(summary.finished) / duration_s;
    summary.output_tokens_per_s = static_cast<double>(output_tokens) / duration_s;
    summary.total_tokens_per_s = static_cast<double>(output_tokens + prompt_tokens) / duration_s;
    summary.goodput_per_s = static_cast<double>(summary.slo_met) / duration_s;
  }
  summary.ttft_s = summarize_latencies(std::move(ttft));
  summary.tpot_s = summarize_latencies(std::move(tpot));
  summary.itl_s = summarize_latencies(std::move(itl));
  summary.e2e_s = summarize_latencies(std::move(e2e));
  summary.queue_delay_s = summarize_latencies(std::move(queue));
  summary.kv_transfer_s = summarize_latencies(std::move(transfer));
  summary.decode_queue_s = summarize_latencies(std::move(decode_queue));
  return summary;
}

}  // namespace kvlab
