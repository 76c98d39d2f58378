// Tenants of a workload: who sends each request (drawn by share, or named by the trace) and the
// latency targets each tenant asked for.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>
#include <set>

#include "kvlab/error.hpp"
#include "kvlab/workload/workload.hpp"

namespace kvlab {
namespace {

// Each target of `own` where set, else the run's.
ServiceLevelObjectives over(const ServiceLevelObjectives& own, const ServiceLevelObjectives& run) {
  return {own.ttft_s ? own.ttft_s : run.ttft_s, own.tpot_s ? own.tpot_s : run.tpot_s,
          own.e2e_s ? own.e2e_s : run.e2e_s};
}

void check_shares(std::span<const TenantSpec> tenants) {
  std::set<std::string> names;
  double sum = 0;
  for (const TenantSpec& t : tenants) {
    check_tenant_name(t.name);
    if (!names.insert(t.name).second)
      throw Error(fmt::format("tenant \"{}\" is listed twice", t.name));
    const double share = t.share.value_or(1.0);
    if (!(share >= 0) || !std::isfinite(share))
      throw Error(fmt::format("tenant \"{}\": share must be a finite number >= 0", t.name));
    sum += share;
  }
  if (!(sum > 0)) throw Error("the tenants' shares must have a positive sum");
}

// Each request's tenant drawn by share: its own stream of the seed, so the requests' other
// draws (lengths, arrivals) do not change when tenants are added. The engine's bits turned
// into a pick by hand (not <random>'s implementation-defined distributions): the same seed
// gives the same tenants with any standard library.
void draw_tenants(std::vector<WorkloadRequest>& requests, std::span<const TenantSpec> tenants,
                  std::uint64_t seed) {
  double sum = 0;
  for (const TenantSpec& t : tenants) sum += t.share.value_or(1.0);
  std::mt19937_64 engine(seed ^ 0x7e4a9c3b5d1f2e68ULL);
  for (WorkloadRequest& r : requests) {
    double pick = static_cast<double>(engine() >> 11) * 0x1.0p-53 * sum;  // [0, sum)
    std::size_t chosen = tenants.size() - 1;  // rounding at the top end: the last with a share
    while (chosen > 0 && !(tenants[chosen].share.value_or(1.0) > 0)) --chosen;
    for (std::size_t t = 0; t < tenants.size(); ++t) {
      pick -= tenants[t].share.value_or(1.0);
      if (pick < 0) {
        chosen = t;
        break;
      }
    }
    r.tenant = tenants[chosen].name;
  }
}

// The requests name their tenants: every listed one must send some, none may have a share.
void check_named(const std::vector<WorkloadRequest>& requests,
                 std::span<const TenantSpec> tenants) {
  std::set<std::string> named;
  for (const WorkloadRequest& r : requests) named.insert(r.tenant);
  for (const TenantSpec& t : tenants) {
    if (t.share)
      throw Error(fmt::format(
          "tenant \"{}\" has a share, but the trace names each request's tenant (its tenant "
          "column): delete share, or the column",
          t.name));
    if (!named.contains(t.name))
      throw Error(fmt::format("tenant \"{}\" sends no request: the trace names {}", t.name,
                              fmt::join(named, ", ")));
  }
}

}  // namespace

const std::string& check_tenant_name(const std::string& name) {
  const bool fits =
      !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
      });
  if (!fits)
    throw Error(fmt::format(
        "tenant name \"{}\" must be 1-64 characters of letters, digits, '_' and '-'", name));
  return name;
}

void assign_tenants(std::vector<WorkloadRequest>& requests, std::span<const TenantSpec> tenants,
                    const ServiceLevelObjectives& run_slo, std::uint64_t seed) {
  if (!tenants.empty()) {
    check_shares(tenants);
    const bool named = std::any_of(requests.begin(), requests.end(),
                                   [](const WorkloadRequest& r) { return !r.tenant.empty(); });
    if (named)
      check_named(requests, tenants);
    else
      draw_tenants(requests, tenants, seed);
  }
  for (WorkloadRequest& r : requests) {
    const auto tenant = std::find_if(tenants.begin(), tenants.end(),
                                     [&](const TenantSpec& t) { return t.name == r.tenant; });
    r.slo = over(over(r.slo, tenant == tenants.end() ? ServiceLevelObjectives{} : tenant->slo),
                 run_slo);
  }
}

}  // namespace kvlab
