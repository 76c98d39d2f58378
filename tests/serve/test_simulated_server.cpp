// kvlab serve with the simulated backend: a GPU-free stand-in that answers on the wall clock as
// the hardware profile prices each step (the paced clock). A client replays a workload's arrivals
// and lengths over HTTP; the served run's TTFT and TPOT must match what kvlab run predicts for
// the same arrivals (the virtual clock) within 5%, and what the client saw must too.
#include <gtest/gtest.h>

#include <future>

#include "serve_fixture.hpp"

namespace kvlab::test {
namespace {

using nlohmann::json;

// Llama-2-7B on one H200 at 10 requests/s: steps of ~5-20 ms, TTFT tens of milliseconds. `sets`
// change it as --set does. 80 requests: with 40, the TTFTs about the median sat 0.4-0.6 ms apart
// with gaps of ~1.8 ms beside it, so a request or two a step off on a busy machine moved the p50
// by 5.7-7.6% (CI, 2026-12-05: one replica and two) while the mean moved 0.5-1.7%.
std::vector<ExperimentRun> simulated_h200(const std::vector<std::string>& sets) {
  return served_experiment_from(R"([experiment]
name = "simulated_server"
seed = 3
clock = "virtual"
[model]
name = "llama2-7b"
[backend]
name = "simulated"
profile = "h200"
[kv_cache]
allocator = "paged"
[kv_cache.params]
block_size = 16
prefix_caching = false
[scheduler]
name = "fcfs"
[scheduler.params]
max_batch = 64
max_tokens_per_step = 4096
[workload]
requests = 80
arrival = "poisson"
rate = 10.0
prompt_tokens = { dist = "lognormal", mean = 600, stddev = 400, min = 64, max = 2048 }
output_tokens = { dist = "uniform", min = 24, max = 80 }
ignore_eos = true
)",
                                sets);
}

struct ClientSide {
  double e2e_s = 0;
  int status = 0;
  std::string body;
};

// Each request of the replay sent at its arrival time (from its own thread), whole answers.
std::vector<ClientSide> replay_over_http(const std::vector<RequestTimeline>& requests,
                                         std::uint16_t port, const std::string& model) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<ClientSide>> sent;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const RequestTimeline& r = requests[i];
    sent.push_back(std::async(std::launch::async, [&, i] {
      std::this_thread::sleep_until(start + std::chrono::duration<double>(r.arrival_s));
      const json body = {{"model", model},
                         {"prompt", std::vector<int>(static_cast<std::size_t>(r.prompt_tokens),
                                                     100 + static_cast<int>(i))},
                         {"max_tokens", r.token_times_s.size()},
                         {"temperature", 0},
                         {"ignore_eos", true}};
      const auto sent_at = std::chrono::steady_clock::now();
      const HttpResult reply = post_json(port, "/v1/completions", body);
      return ClientSide{
          std::chrono::duration<double>(std::chrono::steady_clock::now() - sent_at).count(),
          reply.status, reply.status == 200 ? std::string{} : reply.body};
    }));
  }
  std::vector<ClientSide> seen;
  for (auto& f : sent) seen.push_back(f.get());
  return seen;
}

double relative(double got, double expected) {
  return std::abs(got - expected) / expected;
}

// kvlab run of `run` on the arrivals the server stamped (each request's arrival there, its prompt
// and output lengths), as a trace: what the simulator predicts for exactly those arrivals.
RunOutput replay_served_arrivals(const ExperimentRun& run, const RunOutput& served) {
  const TempDir dir;
  std::string csv = "arrival_s,prompt_len,output_len\n";
  for (const RequestTimeline& t : served.engine.requests)
    csv += fmt::format("{:.9f},{},{}\n", t.arrival_s, t.prompt_tokens, t.output_tokens());
  write_file(dir / "served_arrivals.csv", csv);
  ExperimentConfig config = run.config;
  config.trace = (dir / "served_arrivals.csv").string();
  return run_experiment(config, false, nullptr);
}

struct ServedAndReplayed {
  RunOutput served, offline;
};

// Serves `sets`' experiment to a client replaying its arrivals; returns the served run and the
// replay's.
ServedAndReplayed expect_served_matches_replay(const std::vector<std::string>& sets) {
  const std::vector<ExperimentRun> runs = simulated_h200(sets);
  RunOutput offline = run_experiment(runs.front().config, false, nullptr);
  const std::int64_t requests = runs.front().config.workload.requests;
  EXPECT_EQ(offline.summary.finished, requests);
  ServedStack stack(runs, {}, {}, {});
  const std::vector<ClientSide> client =
      replay_over_http(offline.engine.requests, stack.port(), stack.model_name());
  stack.stop(true);
  RunOutput served = stack.served().finish();
  double client_e2e = 0;
  for (const ClientSide& c : client) {
    EXPECT_EQ(c.status, 200) << c.body;
    client_e2e += c.e2e_s / static_cast<double>(client.size());
  }
  // Against what kvlab run predicts for the workload's arrivals: the issue's 5%.
  const RunSummary& want = offline.summary;
  const RunSummary& got = served.summary;
  EXPECT_LT(relative(got.ttft_s.mean, want.ttft_s.mean), 0.05)
      << got.ttft_s.mean << " vs " << want.ttft_s.mean;
  EXPECT_LT(relative(got.tpot_s.mean, want.tpot_s.mean), 0.05)
      << got.tpot_s.mean << " vs " << want.tpot_s.mean;
  EXPECT_LT(relative(got.tpot_s.p50, want.tpot_s.p50), 0.05)
      << got.tpot_s.p50 << " vs " << want.tpot_s.p50;
  EXPECT_LT(relative(client_e2e, want.e2e_s.mean), 0.05)
      << "client-side e2e " << client_e2e << " vs " << want.e2e_s.mean;
  EXPECT_EQ(served.summary.finished, requests);
  // The TTFT median against kvlab run of the arrivals as the server stamped them. Against the
  // workload's own arrivals the median measures the client's jitter too: a request whose HTTP
  // arrival lands a fraction of a millisecond later relative to the others crosses a step
  // boundary and waits a whole step (5-12 ms) more or less than its replay, and 80 TTFTs
  // quantised by steps have gaps about the median; so a few such requests moved the median 7%
  // (CI and here, 2026-12-05) while the mean moved under 2%.
  const RunSummary same = replay_served_arrivals(runs.front(), served).summary;
  EXPECT_LT(relative(got.ttft_s.mean, same.ttft_s.mean), 0.05)
      << got.ttft_s.mean << " vs " << same.ttft_s.mean << " (the served arrivals replayed)";
  EXPECT_LT(relative(got.ttft_s.p50, same.ttft_s.p50), 0.05)
      << got.ttft_s.p50 << " vs " << same.ttft_s.p50 << " (the served arrivals replayed)";
  std::printf(
      "simulated H200 server (%zu replica(s)) vs replay: TTFT mean %.2f / %.2f ms, p50 %.2f / %.2f "
      "ms (%.2f / %.2f ms replaying the served arrivals); TPOT mean %.3f / %.3f ms, p50 %.3f / "
      "%.3f ms; client e2e %.1f / %.1f ms\n",
      std::max<std::size_t>(1, served.replicas.size()), got.ttft_s.mean * 1e3,
      want.ttft_s.mean * 1e3, got.ttft_s.p50 * 1e3, want.ttft_s.p50 * 1e3, same.ttft_s.mean * 1e3,
      same.ttft_s.p50 * 1e3, got.tpot_s.mean * 1e3, want.tpot_s.mean * 1e3, got.tpot_s.p50 * 1e3,
      want.tpot_s.p50 * 1e3, client_e2e * 1e3, want.e2e_s.mean * 1e3);
  return {std::move(served), std::move(offline)};
}

TEST(SimulatedServer, LatenciesUnderAClientsLoadMatchTheReplayWithin5Percent) {
  (void)expect_served_matches_replay({});
}

// A cluster as a stand-in for a fleet behind a gateway: two replicas behind round robin, at twice
// the rate, answer as kvlab run's cluster predicts; each replica serves its half.
TEST(SimulatedServer, AClustersLatenciesMatchTheReplayWithin5Percent) {
  const RunOutput served =
      expect_served_matches_replay(
          {"cluster.replicas=2", "cluster.router=round_robin", "workload.rate=20"})
          .served;
  ASSERT_EQ(served.replicas.size(), 2u);
  EXPECT_EQ(served.replicas[0].requests, 40);
  EXPECT_EQ(served.replicas[1].requests, 40);
}

// Disaggregated: 1 prefill and 1 decode replica, each request's KV crossing the H200 profile's
// link (paced to its price, queued behind the link's earlier transfers), answer as kvlab run's
// disaggregated cluster predicts.
TEST(SimulatedServer, ADisaggregatedClustersLatenciesMatchTheReplayWithin5Percent) {
  const auto [served, offline] = expect_served_matches_replay(
      {"cluster.replicas=2", "cluster.prefill_replicas=1", "cluster.router=round_robin"});
  ASSERT_EQ(served.replicas.size(), 2u);
  EXPECT_EQ(served.replicas[0].requests, 80);
  EXPECT_EQ(served.replicas[1].requests, 80);
  // Each KV waits on the link as the replay says: from the first token to the decode replica's
  // arrival (the transfer, ~6 ms, plus the queue behind earlier ones), within 5% of the replay's
  // mean and 0.2 ms.
  const auto mean_link_wait = [](const RunOutput& out) {
    double sum = 0;
    for (const RequestTimeline& t : out.engine.requests) {
      EXPECT_GT(t.kv_transfer_bytes, 0);
      sum += *t.kv_arrival_s - t.token_times_s.front();
    }
    return sum / static_cast<double>(out.engine.requests.size());
  };
  const double served_wait = mean_link_wait(served), replay_wait = mean_link_wait(offline);
  std::printf("KV first token -> decode arrival: served %.3f ms, replay %.3f ms\n",
              served_wait * 1e3, replay_wait * 1e3);
  EXPECT_NEAR(served_wait, replay_wait, 0.05 * replay_wait + 2e-4);
}

}  // namespace
}  // namespace kvlab::test
