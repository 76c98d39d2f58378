// Per-tenant metrics: each tenant's share of a run, and the service gap of the VTC paper
// ("Fairness in Serving Large Language Models", Sheng et al., OSDI 2024, section 3).
#include <algorithm>
#include <iterator>
#include <map>

#include "kvlab/engine/metrics.hpp"

namespace kvlab {

std::vector<TenantSummary> summarize_tenants(std::span<const RequestTimeline> requests,
                                             double duration_s,
                                             const ServiceLevelObjectives& instead) {
  std::vector<TenantSummary> tenants;
  if (std::none_of(requests.begin(), requests.end(),
                   [](const RequestTimeline& r) { return !r.tenant.empty(); }))
    return tenants;                // before copying anything: every run's metrics ask
  std::vector<std::string> order;  // by first arrival (requests are in submission order)
  std::map<std::string, std::vector<RequestTimeline>> by_tenant;
  for (const RequestTimeline& r : requests) {
    auto [it, added] = by_tenant.try_emplace(r.tenant);
    if (added) order.push_back(r.tenant);
    it->second.push_back(r);
  }
  for (const std::string& name : order) {
    const std::vector<RequestTimeline>& own = by_tenant[name];
    TenantSummary t{name, summarize_run(own, duration_s, instead)};
    for (const RequestTimeline& r : own)
      if (r.finish_s) t.served_tokens += r.prompt_tokens + r.output_tokens();
    tenants.push_back(std::move(t));
  }
  return tenants;
}

namespace {

// What changes a tenant's state at a time: service received, or its backlog growing (a request
// arrives) or shrinking (one is first scheduled). Ordered by time; at equal times backlogs
// grow first and shrink last, so a request scheduled at its arrival still counts as queued.
struct TenantEvent {
  double time_s = 0;
  int order = 0;  // 0: arrival, 1: service, 2: first scheduled
  std::size_t tenant = 0;
  double tokens = 0;
  bool operator<(const TenantEvent& o) const {
    return time_s != o.time_s ? time_s < o.time_s : order < o.order;
  }
};

// Each tenant's events in time order, tenants by first arrival.
std::vector<std::vector<TenantEvent>> tenant_events(std::span<const RequestTimeline> requests) {
  std::map<std::string, std::size_t> index;
  std::vector<std::vector<TenantEvent>> events;
  for (const RequestTimeline& r : requests) {
    const auto [it, added] = index.try_emplace(r.tenant, index.size());
    if (added) events.emplace_back();
    const std::size_t t = it->second;
    if (r.rejected || !r.first_scheduled_s) continue;
    std::vector<TenantEvent>& own = events[t];
    own.push_back({r.arrival_s, 0, t, 0});
    own.push_back({*r.first_scheduled_s, 2, t, 0});
    for (std::size_t i = 0; i < r.token_times_s.size(); ++i)  // the prompt with the first token
      own.push_back(
          {r.token_times_s[i], 1, t, 1.0 + (i == 0 ? static_cast<double>(r.prompt_tokens) : 0.0)});
  }
  for (auto& own : events) std::stable_sort(own.begin(), own.end());
  return events;
}

// The largest |service(f) - service(g)| over an interval in which both f and g stay backlogged:
// the range of the difference of their cumulative service within each such period.
// `events`: f's and another tenant's, merged in time order.
double pair_gap(std::span<const TenantEvent> events, std::size_t f) {
  double served_f = 0, served_g = 0, gap = 0, low = 0, high = 0;
  std::int64_t queued_f = 0, queued_g = 0;
  bool both = false;
  // Events of one instant and kind apply together (their order among tenants is no order).
  for (std::size_t i = 0; i < events.size();) {
    const TenantEvent& first = events[i];
    for (; i < events.size() && !(first < events[i]); ++i) {
      const TenantEvent& e = events[i];
      const std::int64_t change = e.order == 0 ? 1 : e.order == 2 ? -1 : 0;
      (e.tenant == f ? queued_f : queued_g) += change;
      (e.tenant == f ? served_f : served_g) += e.tokens;
    }
    const double difference = served_f - served_g;
    if (both) {
      low = std::min(low, difference);
      high = std::max(high, difference);
      gap = std::max(gap, high - low);
    }
    const bool now_both = queued_f > 0 && queued_g > 0;
    if (now_both && !both) low = high = difference;
    both = now_both;
  }
  return gap;
}

}  // namespace

double max_service_gap_tokens(std::span<const RequestTimeline> requests) {
  std::vector<std::vector<TenantEvent>> events = tenant_events(requests);
  // Pairs of the kMaxGapTenants busiest tenants (by events: their requests and tokens), so a
  // trace naming thousands of users stays O(kMaxGapTenants x events).
  if (events.size() > kMaxGapTenants) {
    std::stable_sort(events.begin(), events.end(),
                     [](const auto& a, const auto& b) { return a.size() > b.size(); });
    events.resize(kMaxGapTenants);
  }
  double gap = 0;
  std::vector<TenantEvent> both;
  for (std::size_t f = 0; f < events.size(); ++f)
    for (std::size_t g = f + 1; g < events.size(); ++g) {
      both.clear();
      std::merge(events[f].begin(), events[f].end(), events[g].begin(), events[g].end(),
                 std::back_inserter(both));
      if (!events[f].empty() && !events[g].empty())
        gap = std::max(gap, pair_gap(both, events[f].front().tenant));
    }
  return gap;
}

}  // namespace kvlab
