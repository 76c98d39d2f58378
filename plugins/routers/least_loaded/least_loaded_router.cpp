// least_loaded: the replica with the least work, measured `by` prefill tokens (prompt tokens
// of its waiting requests: the work ahead of a new arrival's first token; the default), queued
// tokens (those plus the outputs its running requests have still to generate), KV use (share of
// its pool held) or requests (waiting + running). What load balancers in front of vLLM/SGLang
// replicas do (shortest queue, least outstanding requests). Ties go round robin.
#include <fmt/format.h>

#include <string>

#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"

namespace {

enum class Measure { queued_tokens, prefill_tokens, kv, requests };

Measure measure_from_name(const std::string& name) {
  if (name == "queued_tokens") return Measure::queued_tokens;
  if (name == "prefill_tokens") return Measure::prefill_tokens;
  if (name == "kv") return Measure::kv;
  if (name == "requests") return Measure::requests;
  throw kvlab::Error(fmt::format(
      "least_loaded: by = \"{}\": choose \"queued_tokens\", \"prefill_tokens\", \"kv\" or "
      "\"requests\"",
      name));
}

double load_of(const kvlab::ReplicaLoad& r, Measure by) {
  switch (by) {
    case Measure::queued_tokens:
      return static_cast<double>(r.queued_tokens);
    case Measure::prefill_tokens:
      return static_cast<double>(r.queued_prefill_tokens);
    case Measure::kv:
      return r.kv_capacity > 0 ? static_cast<double>(r.kv_used) / static_cast<double>(r.kv_capacity)
                               : 0.0;
    case Measure::requests:
      return static_cast<double>(r.waiting + r.running);
  }
  return 0;
}

class LeastLoadedRouter final : public kvlab::Router {
 public:
  LeastLoadedRouter(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : by_(measure_from_name(params.string("by"))), by_name_(params.string("by")) {}

  kvlab::RouteDecision route(const kvlab::RouteRequest&,
                             std::span<const kvlab::ReplicaLoad> replicas) override {
    // Ties go round: the first tied replica from the one after the last choice (idle replicas
    // all tie at 0; taking the lowest index would pile a light load onto replica 0).
    const std::size_t n = replicas.size();
    std::size_t best = next_ % n;
    for (std::size_t k = 1; k < n; ++k) {
      const std::size_t i = (next_ + k) % n;
      if (load_of(replicas[i], by_) < load_of(replicas[best], by_)) best = i;
    }
    next_ = best + 1;
    return {best, fmt::format("least loaded by {}: {:g}", by_name_, load_of(replicas[best], by_))};
  }

 private:
  Measure by_;
  std::string by_name_;
  std::size_t next_ = 0;  // where the search for the least loaded starts
};

const kvlab::ParamSpec kParams[] = {
    {"by", kvlab::ParamType::param_string,
     "the load compared: \"queued_tokens\" (prompt + output tokens still to compute), "
     "\"prefill_tokens\" (prompt tokens waiting: the prefill work ahead of a new arrival), "
     "\"kv\" (share of the KV pool held) or \"requests\" (waiting + running)",
     "\"prefill_tokens\"", 0, 0}};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::router, LeastLoadedRouter, "least_loaded",
             "the replica with the least queued prefill tokens, queued tokens, KV use or requests",
             kParams)
