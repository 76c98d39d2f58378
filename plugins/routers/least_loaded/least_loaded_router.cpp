// least_loaded: the replica with the least work, measured `by` queued tokens (prompts not yet
// in KV + outputs not yet generated: the work its queue stands for), KV use (share of its pool
// held) or requests (waiting + running). Ties go to the lowest index. What load balancers in
// front of vLLM/SGLang replicas do (shortest queue, least outstanding requests).
#include <fmt/format.h>

#include <string>

#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"

namespace {

enum class Measure { queued_tokens, kv, requests };

Measure measure_from_name(const std::string& name) {
  if (name == "queued_tokens") return Measure::queued_tokens;
  if (name == "kv") return Measure::kv;
  if (name == "requests") return Measure::requests;
  throw kvlab::Error(fmt::format(
      "least_loaded: by = \"{}\": choose \"queued_tokens\", \"kv\" or \"requests\"", name));
}

double load_of(const kvlab::ReplicaLoad& r, Measure by) {
  switch (by) {
    case Measure::queued_tokens:
      return static_cast<double>(r.queued_tokens);
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
    std::size_t best = 0;
    for (std::size_t i = 1; i < replicas.size(); ++i)
      if (load_of(replicas[i], by_) < load_of(replicas[best], by_)) best = i;
    return {best, fmt::format("least loaded by {}: {:g}", by_name_, load_of(replicas[best], by_))};
  }

 private:
  Measure by_;
  std::string by_name_;
};

const kvlab::ParamSpec kParams[] = {
    {"by", kvlab::ParamType::param_string,
     "the load compared: \"queued_tokens\" (prompt + output tokens still to compute), \"kv\" "
     "(share of the KV pool held) or \"requests\" (waiting + running)",
     "\"queued_tokens\"", 0, 0}};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::router, LeastLoadedRouter, "least_loaded",
             "the replica with the least queued tokens, KV use or requests", kParams)
