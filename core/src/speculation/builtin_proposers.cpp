#include "kvlab/speculation/builtin_proposers.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>

#include "../csv_fields.hpp"
#include "kvlab/error.hpp"
#include "kvlab/sim/simulated_backend.hpp"
#include "kvlab/splitmix64.hpp"

namespace kvlab {
namespace {

class PromptLookupProposer final : public Proposer {
 public:
  explicit PromptLookupProposer(PromptLookup lookup) : lookup_(lookup) {}
  void propose(std::span<const ProposeAsk> asks) override {
    for (const ProposeAsk& ask : asks)
      *ask.proposed = prompt_lookup(ask.request->tokens, lookup_, ask.max_tokens);
  }

 private:
  PromptLookup lookup_;
};

// A uniform draw in [0, 1) for (seed, request, position): splitmix64.
double draw(std::uint64_t seed, RequestId id, std::int64_t position) {
  const std::uint64_t z =
      splitmix64_mix(seed ^ (static_cast<std::uint64_t>(id) * 0x9e3779b97f4a7c15ULL) ^
                     (static_cast<std::uint64_t>(position) * 0xc2b2ae3d27d4eb4fULL));
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

class SimulatedProposer final : public Proposer {
 public:
  SimulatedProposer(std::int64_t vocab, std::span<const std::int32_t> eos,
                    const SimulatedAcceptance& acceptance)
      : target_(vocab, {eos.begin(), eos.end()}),
        vocab_(vocab),
        rate_(acceptance.rate),
        seed_(acceptance.seed) {
    if (!acceptance.accept_trace.empty()) trace_ = load_accept_trace(acceptance.accept_trace);
  }
  void propose(std::span<const ProposeAsk> asks) override {
    for (const ProposeAsk& ask : asks) *ask.proposed = propose(*ask.request, ask.max_tokens);
  }

 private:
  std::vector<std::int32_t> propose(const RequestState& r, std::int64_t max_tokens) const {
    std::vector<std::int32_t> proposed;
    std::int32_t last = r.tokens.back();
    const std::int64_t newest = r.length() - 1;
    const std::int64_t right = right_run(r.id, newest, max_tokens);
    for (std::int64_t j = 0; j < max_tokens; ++j) {
      // The target's token after `last` at this position: what the verify's row j will say.
      const std::int32_t target = target_.token_after(last, newest + j);
      last = j < right ? target : static_cast<std::int32_t>((target + 1) % vocab_);
      proposed.push_back(last);
    }
    return proposed;
  }

  // How many of k proposals from `position` on are right: each in turn with probability rate_,
  // or a measured verify's run drawn from the trace (one that accepted all it proposed goes on
  // with another draw, for proposals longer than its own).
  std::int64_t right_run(RequestId id, std::int64_t position, std::int64_t k) const {
    std::int64_t run = 0;
    if (trace_.empty()) {
      while (run < k && draw(seed_, id, position + run) < rate_) ++run;
      return run;
    }
    for (std::int64_t chain = 0; run < k; ++chain) {
      const double u = draw(seed_ ^ 0x5eedace7ULL, id, position * 64 + chain);
      const AcceptRecord& verify =
          trace_[std::min(trace_.size() - 1, static_cast<std::size_t>(u * trace_.size()))];
      run += verify.accepted;
      if (verify.accepted < verify.proposed) break;
    }
    return std::min(run, k);
  }

  SimulatedBackend target_;
  std::int64_t vocab_;
  double rate_;
  std::uint64_t seed_;
  std::vector<AcceptRecord> trace_;
};

}  // namespace

std::unique_ptr<Proposer> make_prompt_lookup_proposer(const PromptLookup& lookup) {
  return std::make_unique<PromptLookupProposer>(lookup);
}

std::unique_ptr<Proposer> make_simulated_proposer(std::int64_t vocab,
                                                  std::span<const std::int32_t> eos,
                                                  const SimulatedAcceptance& acceptance) {
  return std::make_unique<SimulatedProposer>(vocab, eos, acceptance);
}

std::vector<AcceptRecord> load_accept_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("cannot read the accept trace {}", path.string()));
  std::vector<AcceptRecord> verifies;
  std::size_t proposed_at = 0, accepted_at = 0, columns = 0;
  std::int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const std::vector<std::string> cells =
        columns == 0 ? csv_header_names(csv_cells(line)) : csv_cells(line);
    try {
      if (columns == 0) {
        const auto at = [&](const char* name) {
          const auto it = std::find(cells.begin(), cells.end(), name);
          if (it == cells.end())
            throw Error(
                fmt::format("the header names no \"{}\" column (it needs proposed and "
                            "accepted, as kvlab's verifies.csv has)",
                            name));
          return static_cast<std::size_t>(it - cells.begin());
        };
        proposed_at = at("proposed");
        accepted_at = at("accepted");
        columns = cells.size();
        continue;
      }
      if (cells.size() != columns)
        throw Error(fmt::format("{} cells, the header has {}", cells.size(), columns));
      const AcceptRecord verify{parse_number<std::int64_t>(cells[proposed_at], "proposed"),
                                parse_number<std::int64_t>(cells[accepted_at], "accepted")};
      if (verify.proposed < 1 || verify.proposed > 64 || verify.accepted < 0 ||
          verify.accepted > verify.proposed)
        throw Error(
            fmt::format("proposed must be in [1, 64] and accepted in [0, proposed], got "
                        "{} and {}",
                        verify.proposed, verify.accepted));
      verifies.push_back(verify);
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {}", path.string(), line_number, e.what()));
    }
  }
  if (verifies.empty())
    throw Error(fmt::format("the accept trace {} holds no verifies", path.string()));
  return verifies;
}

}  // namespace kvlab
