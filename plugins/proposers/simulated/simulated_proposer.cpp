// simulated: the simulated backend's stand-in for a drafter. Each proposed token is the
// simulated target's own with probability acceptance_rate, or as a measured run's verifies
// (accept_trace) say; the draws are seeded per request and position.
#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"
#include "kvlab/speculation/builtin_proposers.hpp"

namespace {

using namespace kvlab;

const ModelConfig& model_of(const PluginContext& context) {
  if (context.model == nullptr) throw Error("simulated proposer: needs the model (a host bug)");
  return *context.model;
}

class SimulatedProposerPlugin final : public Proposer {
 public:
  SimulatedProposerPlugin(const PluginParams& params, const PluginContext& context)
      : simulated_(
            make_simulated_proposer(model_of(context).vocab_size, model_of(context).eos_token_ids,
                                    {params.real("acceptance_rate"), params.string("accept_trace"),
                                     static_cast<std::uint64_t>(params.integer("seed"))})) {}
  void propose(std::span<const ProposeAsk> asks) override { simulated_->propose(asks); }

 private:
  std::unique_ptr<Proposer> simulated_;
};

const ParamSpec kParams[] = {
    {"acceptance_rate", ParamType::param_real,
     "each proposal is the target's token with this probability, given the ones before it", "0.7",
     0, 1},
    {"accept_trace", ParamType::param_string,
     "a measured run's verifies.csv (columns proposed and accepted): each verify's run of right "
     "proposals drawn from it instead of the rate; \"\" for the rate",
     "\"\"", 0, 0},
    {"seed", ParamType::param_integer, "the draws' seed ([experiment] seed by default)", "0", -9e18,
     9e18},
};

}  // namespace

KVLAB_PLUGIN(
    kvlab::PluginKind::proposer, SimulatedProposerPlugin, "simulated",
    "the simulated backend's drafter: proposals right at acceptance_rate, or as a measured "
    "accept trace says (no tokens computed)",
    kParams)
