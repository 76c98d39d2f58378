// prompt_lookup: n-gram prompt lookup (kvlab/speculation/prompt_lookup.hpp): each decode's last
// max_ngram..min_ngram tokens looked for earlier in its prompt and output; what followed them
// is proposed. No second model, nothing kept between steps.
#include <string>

#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"
#include "kvlab/speculation/builtin_proposers.hpp"

namespace {

using namespace kvlab;

PromptLookup lookup_of(const PluginParams& params) {
  const PromptLookup lookup{params.integer("min_ngram"), params.integer("max_ngram")};
  if (lookup.min_ngram > lookup.max_ngram)
    throw Error("prompt_lookup: min_ngram (" + std::to_string(lookup.min_ngram) +
                ") must not exceed max_ngram (" + std::to_string(lookup.max_ngram) + ")");
  return lookup;
}

class PromptLookupProposerPlugin final : public Proposer {
 public:
  PromptLookupProposerPlugin(const PluginParams& params, const PluginContext&)
      : lookup_(make_prompt_lookup_proposer(lookup_of(params))) {}
  void propose(std::span<const ProposeAsk> asks) override { lookup_->propose(asks); }

 private:
  std::unique_ptr<Proposer> lookup_;
};

const ParamSpec kParams[] = {
    {"min_ngram", ParamType::param_integer, "the shortest suffix matched", "1", 1, 64},
    {"max_ngram", ParamType::param_integer, "the longest suffix matched, tried first", "3", 1, 64},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::proposer, PromptLookupProposerPlugin, "prompt_lookup",
             "n-gram prompt lookup: what followed the sequence's last tokens where they occurred "
             "before in its prompt or output (no second model)",
             kParams)
