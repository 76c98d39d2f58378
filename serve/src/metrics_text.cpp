// kvlab serve's /metrics: the engine's state and the server's counters as Prometheus text
// (version 0.0.4), in the metric registry's names (kvlab_ + the name; counters end in _total).
#include <fmt/format.h>

#include "generation.hpp"

namespace kvlab::serve {

namespace {

void metric(std::string& out, const char* name, const char* help, double value,
            const char* type = "gauge") {
  out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n{0} {3}\n", name, help, type, value);
}

// The counters, cumulative since the server started.
void counter_lines(std::string& out, const LiveStats& s, const OpenAiServer::Shared& shared) {
  const KvAllocatorStats& kv = s.kv;
  struct Counter {
    const char* name;
    const char* help;
    std::int64_t value;
  };
  const Counter counters[] = {
      {"kvlab_steps_total", "engine steps that ran a batch", s.steps},
      {"kvlab_finished_total", "requests finished (EOS, max_tokens, a full context)", s.finished},
      {"kvlab_cancelled_total", "requests cancelled (a client gone, a stop string, --abort)",
       s.cancelled},
      {"kvlab_rejected_total", "requests the engine rejected (never fit, a fault)", s.rejected},
      {"kvlab_kv_handoffs_total",
       "requests prefilled and handed with their KV to a decode replica (disaggregated)",
       s.handed_off},
      {"kvlab_preemptions_total", "running requests preempted for memory", s.preemptions},
      {"kvlab_prefill_tokens_total", "prompt tokens computed", s.prefill_tokens},
      {"kvlab_decode_tokens_total", "tokens decoded", s.decode_tokens},
      {"kvlab_swapped_bytes_total", "KV bytes copied to and from the host swap pool", s.swap_bytes},
      {"kvlab_tier_bytes_stored_total", "KV bytes stored into the host and disk tiers",
       kv.host_bytes_stored + kv.disk_bytes_stored},
      {"kvlab_tier_bytes_loaded_total", "KV bytes loaded back from the host and disk tiers",
       kv.host_bytes_loaded + kv.disk_bytes_loaded},
      {"kvlab_prompt_tokens_total", "prompt tokens of the requests answered",
       shared.prompt_tokens.load()},
      {"kvlab_completion_tokens_total", "tokens generated for the requests answered",
       shared.completion_tokens.load()}};
  for (const Counter& c : counters)
    metric(out, c.name, c.help, static_cast<double>(c.value), "counter");
}

// A cluster's gauges per replica (label replica="i"): what a gateway or autoscaler scraping the
// replicas one by one would read.
void replica_lines(std::string& out, const LiveCluster& cluster) {
  struct Gauge {
    const char* name;
    const char* help;
    double (*value)(const LiveStats&);
  };
  static const Gauge gauges[] = {
      {"kvlab_replica_queue_length", "requests waiting on the replica",
       [](const LiveStats& s) { return static_cast<double>(s.waiting + s.queued); }},
      {"kvlab_replica_running", "requests in the replica's running batch",
       [](const LiveStats& s) { return static_cast<double>(s.running); }},
      {"kvlab_replica_kv_used_fraction", "the replica's pool slots holding live tokens' KV",
       [](const LiveStats& s) {
         return s.kv.capacity > 0
                    ? static_cast<double>(s.kv.used) / static_cast<double>(s.kv.capacity)
                    : 0.0;
       }},
      {"kvlab_replica_finished_total", "requests the replica finished",
       [](const LiveStats& s) { return static_cast<double>(s.finished); }},
      {"kvlab_replica_kv_handoffs_total", "requests the replica prefilled and handed off",
       [](const LiveStats& s) { return static_cast<double>(s.handed_off); }}};
  std::vector<LiveStats> stats;
  for (std::size_t r = 0; r < cluster.size(); ++r) stats.push_back(cluster.replica_stats(r));
  for (const Gauge& g : gauges) {
    const bool counter = std::string_view(g.name).ends_with("_total");
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} {2}\n", g.name, g.help,
                       counter ? "counter" : "gauge");
    for (std::size_t r = 0; r < stats.size(); ++r)
      out += fmt::format("{}{{replica=\"{}\"}} {}\n", g.name, r, g.value(stats[r]));
  }
}

}  // namespace

// The engine's state after its last step and the server's counters, in the metric registry's
// names (kvlab_ + the name; counters end in _total).
std::string metrics_text(OpenAiServer::Shared& shared) {
  const LiveStats s = shared.engine.stats();
  const KvAllocatorStats& kv = s.kv;
  const double capacity = kv.capacity > 0 ? static_cast<double>(kv.capacity) : 1.0;
  std::string out;
  metric(out, "kvlab_queue_length", "requests waiting: taken by the engine, not running",
         static_cast<double>(s.waiting + s.queued));
  metric(out, "kvlab_running", "requests in the running batch", static_cast<double>(s.running));
  metric(out, "kvlab_kv_used_fraction", "pool slots holding live tokens' KV",
         static_cast<double>(kv.used) / capacity);
  metric(out, "kvlab_kv_waste_fraction",
         "pool slots reserved ahead or in unfilled last blocks (mean_kv_waste_fraction's parts)",
         static_cast<double>(kv.reserved_unused + kv.last_block_slack) / capacity);
  metric(out, "kvlab_prefix_hit_rate", "prompt tokens found in the prefix cache / looked up",
         kv.prefix_query_tokens > 0 ? static_cast<double>(kv.prefix_hit_tokens) /
                                          static_cast<double>(kv.prefix_query_tokens)
                                    : 0.0);
  metric(out, "kvlab_kv_slots", "the pool's capacity in tokens", static_cast<double>(kv.capacity));
  counter_lines(out, s, shared);
  if (shared.engine.size() > 1) replica_lines(out, shared.engine);
  out += shared.ttft.text("kvlab_ttft_s", "time to first token, as the server saw it");
  out += shared.tpot.text("kvlab_tpot_s", "time per output token after the first, per request");
  out += shared.itl.text("kvlab_itl_s", "time between consecutive tokens");
  out += shared.e2e.text("kvlab_e2e_s", "request submission to its end");
  out +=
      "# HELP kvlab_http_responses_total answers by status\n"
      "# TYPE kvlab_http_responses_total counter\n";
  std::lock_guard lock(shared.answered_mutex);
  for (const auto& [status, count] : shared.answered)
    out += fmt::format("kvlab_http_responses_total{{code=\"{}\"}} {}\n", status, count);
  return out;
}

}  // namespace kvlab::serve
