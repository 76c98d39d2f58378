// round_robin: replica 0, 1, ..., N-1, 0, ... in arrival order, whatever their load (the
// baseline every routing study starts from).
#include <fmt/format.h>

#include "kvlab/plugin.hpp"

namespace {

class RoundRobinRouter final : public kvlab::Router {
 public:
  RoundRobinRouter(const kvlab::PluginParams&, const kvlab::PluginContext&) {}

  kvlab::RouteDecision route(const kvlab::RouteRequest&,
                             std::span<const kvlab::ReplicaLoad> replicas) override {
    const std::size_t replica = next_++ % replicas.size();
    return {replica, fmt::format("round robin: turn of replica {}", replica)};
  }

 private:
  std::size_t next_ = 0;
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::router, RoundRobinRouter, "round_robin",
             "each replica in turn, whatever its load", kvlab::kNoParams)
