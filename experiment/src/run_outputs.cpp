// Stage 5: one run's files: requests.csv, steps.csv, events.jsonl, summary.json (the metric
// registry's metrics), and outputs.jsonl / logprobs.jsonl when the workload has them.
#include <fmt/compile.h>
#include <fmt/format.h>

#include <future>

#include <iterator>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/metric_registry.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/results_view.hpp"

namespace kvlab {

namespace {

// A file's text, formatted straight into a buffer (no string a field or a row) that goes to
// the file each megabyte.
class Text {
 public:
  explicit Text(const std::filesystem::path& path) : file_(path) {}
  fmt::memory_buffer& buffer() { return buffer_; }
  void flush_if_full() {
    if (buffer_.size() >= kChunkBytes) flush();
  }
  void close() {
    flush();
    file_.close();
  }

 private:
  static constexpr std::size_t kChunkBytes = std::size_t{1} << 20;
  void flush() {
    file_.write(std::string_view(buffer_.data(), buffer_.size()));
    buffer_.clear();
  }
  FileWriter file_;
  fmt::memory_buffer buffer_;
};

template <typename... Args>
void put(Text& text, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(text.buffer()), format, std::forward<Args>(args)...);
  text.flush_if_full();
}
void put(Text& text, std::string_view plain) {
  text.buffer().append(plain);
  text.flush_if_full();
}

void put_number(Text& text, const std::optional<double>& v) {
  if (v) put(text, "{:.6f}", *v);
}

void write_requests_csv(Text& f, const RunOutput& out) {
  put(f,
      "id,priority,tenant,arrival_s,first_scheduled_s,first_token_s,finish_s,prompt_tokens,output_"
      "tokens,");
  for (const RequestMetric& m : request_metrics()) put(f, "{},", m.name);  // the registry's
  put(f, "preemptions,recomputed_tokens,swapped_bytes,rejected,reject_reason,token_times_s\n");
  for (const auto& r : out.engine.requests) {
    put(f, "{},{},{},{:.6f},", r.id, r.priority, csv_field(r.tenant), r.arrival_s);
    put_number(f, r.first_scheduled_s);
    put(f, ",");
    if (!r.token_times_s.empty()) put(f, "{:.6f}", r.token_times_s.front());
    put(f, ",");
    put_number(f, r.finish_s);
    put(f, ",{},{},", r.prompt_tokens, r.output_tokens());
    for (const RequestMetric& m : request_metrics()) {
      put_number(f, m.extract(r));
      put(f, ",");
    }
    // The reason quoted, a quote in it doubled (RFC 4180): reasons name plugins in quotes.
    std::string reason = r.reject_reason;
    for (std::size_t at = reason.find('"'); at != std::string::npos; at = reason.find('"', at + 2))
      reason.insert(at, 1, '"');
    put(f, "{},{},{},{},\"{}\",", r.preemptions, r.recomputed_tokens, r.swapped_bytes,
        r.rejected ? 1 : 0, reason);
    // every output token's time, space-separated
    auto times = std::back_inserter(f.buffer());
    for (std::size_t i = 0; i < r.token_times_s.size(); ++i)
      fmt::format_to(times, FMT_COMPILE("{}{:.6f}"), i == 0 ? "" : " ", r.token_times_s[i]);
    put(f, "\n");
  }
}

// Measured times only where they are the clock's (measured, wall): virtual runs stay
// byte-identical and carry no columns of zeros.
void write_steps_csv(Text& f, const RunOutput& out, bool measured) {
  const bool cluster = !out.replicas.empty();  // each step is one replica's
  const bool tiers = out.kv_tiers.has_value();
  const bool speculative = std::any_of(out.engine.steps.begin(), out.engine.steps.end(),
                                       [](const StepRecord& s) { return s.verify_entries > 0; });
  const bool drafted = std::any_of(out.engine.steps.begin(), out.engine.steps.end(),
                                   [](const StepRecord& s) { return s.predicted_propose_s > 0; });
  put(f, "{}step,start_s,duration_s,{}", cluster ? "replica," : "",
      measured ? "measured_forward_s,measured_step_s," : "");
  put(f,
      "predicted_s,batch,prefill_tokens,decode_tokens,preempted,waiting,running,padding,"
      "padding_slots,swap_bytes,kv_capacity,kv_used,kv_reserved_unused,kv_last_block_slack,"
      "kv_free,kv_unusable_free,kv_blocking_unusable_free,kv_cached_free,prefix_hit_tokens,"
      "prefix_query_tokens");
  put(f, "{}{}{}{}\n",
      tiers ? ",host_hit_tokens,disk_hit_tokens,tier_bytes_stored,tier_bytes_loaded,tier_s" : "",
      speculative ? ",verify_entries,proposed_tokens,accepted_tokens" : "",
      speculative && measured ? ",propose_s" : "", drafted ? ",predicted_propose_s" : "");
  // A row per step (a whole-trace replay has a million): formats compiled, not parsed per row.
  auto row = std::back_inserter(f.buffer());
  for (const auto& s : out.engine.steps) {
    if (cluster) fmt::format_to(row, FMT_COMPILE("{},"), s.replica);
    fmt::format_to(row, FMT_COMPILE("{},{:.6f},{:.6f},"), s.step, s.start_s, s.duration_s);
    if (measured)
      fmt::format_to(row, FMT_COMPILE("{:.6f},{:.6f},"), s.measured_forward_s, s.measured_step_s);
    fmt::format_to(row,
                   FMT_COMPILE("{:.6f},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}"),
                   s.predicted_s, s.batch, s.prefill_tokens, s.decode_tokens, s.preempted,
                   s.waiting, s.running, s.padding, s.padding_slots, s.swap_bytes, s.kv.capacity,
                   s.kv.used, s.kv.reserved_unused, s.kv.last_block_slack, s.kv.free,
                   s.kv.unusable_free, s.blocking_unusable_free, s.kv.cached_free,
                   s.kv.prefix_hit_tokens, s.kv.prefix_query_tokens);
    if (tiers)
      fmt::format_to(row, FMT_COMPILE(",{},{},{},{},{:.6f}"), s.kv.host_hit_tokens,
                     s.kv.disk_hit_tokens, s.kv.host_bytes_stored + s.kv.disk_bytes_stored,
                     s.kv.host_bytes_loaded + s.kv.disk_bytes_loaded, s.tier_s);
    if (speculative)
      fmt::format_to(row, FMT_COMPILE(",{},{},{}"), s.verify_entries, s.proposed_tokens,
                     s.accepted_tokens);
    if (speculative && measured) fmt::format_to(row, FMT_COMPILE(",{:.6f}"), s.propose_s);
    if (drafted) fmt::format_to(row, FMT_COMPILE(",{:.6f}"), s.predicted_propose_s);
    put(f, "\n");
  }
}

// A prompt set's run: each request's question and the model's answer, as text.
void write_outputs_jsonl(Text& f, const RunOutput& out) {
  for (std::size_t i = 0; i < out.answer_texts.size(); ++i) {
    const auto& r = out.engine.requests[i];
    put(f, "{}\n",
        nlohmann::json{{"id", r.id},
                       {"finish_reason", r.rejected ? "rejected" : r.finish_reason},
                       {"output_tokens", out.engine.tokens[i].size()},
                       {"prompt", out.prompt_texts[i]},
                       {"answer", out.answer_texts[i]}}
            // An answer cut at max_tokens may end inside a UTF-8 character: U+FFFD.
            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
}

// Each request that asked for log-probabilities (workload.logprobs): its generated tokens, each
// one's log-probability, and the k most likely tokens at each position as [token, logprob].
void write_logprobs_jsonl(Text& f, const RunOutput& out) {
  const auto& all = out.engine.logprobs;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].empty()) continue;
    nlohmann::json token_logprobs = nlohmann::json::array(), top = nlohmann::json::array();
    for (const GeneratedLogprobs& token : all[i]) {
      token_logprobs.push_back(token.logprob);
      auto& alternatives = top.emplace_back(nlohmann::json::array());
      for (const TokenLogprob& t : token.top) alternatives.push_back({t.token, t.logprob});
    }
    put(f, "{}\n",
        nlohmann::json{{"id", out.engine.requests[i].id},
                       {"tokens", out.engine.tokens[i]},
                       {"token_logprobs", std::move(token_logprobs)},
                       {"top_logprobs", std::move(top)}}
            .dump());
  }
}

// The run's description (what ran, with what), then every metric of the registry
// (kvlab/experiment/metric_registry.hpp) that it reports.
nlohmann::json summary_json(const ExperimentConfig& c, const RunOutput& out) {
  nlohmann::json j = {{"name", c.name},
                      {"label", c.label},
                      {"swept", swept_json(c)},
                      {"model", out.model_name},
                      {"allocator", c.allocator},
                      {"attention", c.attention},
                      {"scheduler", c.scheduler},
                      {"seed", c.seed},
                      {"backend", c.backend},
                      {"profile", c.profile},
                      {"tensor_parallel", c.tensor_parallel},
                      {"context_parallel", c.context_parallel},
                      {"clock", clock_name(c.clock)}};
  for (const RunMetric& m : run_metrics())
    if (m.in_summary_json)
      if (nlohmann::json value = m.extract(c, out); !value.is_null()) j[m.name] = std::move(value);
  if (!out.workload_description.empty()) j["workload"] = out.workload_description;
  if (!out.weights_description.empty()) j["weights"] = out.weights_description;
  if (!out.kv_dtype.empty()) j["kv_dtype"] = out.kv_dtype;  // as the pool stores it
  if (out.machine_load_1m >= 0) j["machine_load_1m"] = out.machine_load_1m;
  if (!out.replicas.empty()) {  // a cluster: the router and every replica's own figures
    j["router"] = c.router;
    for (const RunOutput::Replica& r : out.replicas)
      j["replicas"].push_back({{"requests", r.requests},
                               {"tensor_parallel", r.tensor_parallel},
                               {"kv_slots", r.kv_slots},
                               {"finished", r.summary.finished},
                               {"rejected", r.summary.rejected},
                               {"output_tokens_per_s", r.summary.output_tokens_per_s},
                               {"ttft_s", latency_json(r.summary.ttft_s)},
                               {"tpot_s", latency_json(r.summary.tpot_s)},
                               {"mean_kv_used_fraction", r.mean_kv_used},
                               {"prefix_hit_rate", r.prefix_hit_rate}});
  }
  return j;
}

}  // namespace

void write_run_outputs(const std::filesystem::path& directory, const ExperimentConfig& c,
                       const RunOutput& out) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    throw WriteError(
        fmt::format("cannot create output folder {}: {}", directory.string(), ec.message()));
  // Each file is written as it is made; FileWriter checks every byte reached it.
  auto write = [&](const char* name, const auto& fill) {
    Text text(directory / name);
    fill(text);
    text.close();
  };
  // steps.csv (a long run's largest file, a row a step) is made on a second thread while the
  // others are made here; its errors surface at get() (and a throw here waits for it in the
  // future's destructor).
  auto steps = std::async(std::launch::async, [&] {
    write("steps.csv", [&](Text& f) {
      write_steps_csv(f, out, c.clock == EngineClock::measured || c.clock == EngineClock::wall);
    });
  });
  write("requests.csv", [&](Text& f) { write_requests_csv(f, out); });
  write("summary.json", [&](Text& f) { put(f, "{}\n", summary_json(c, out).dump(2)); });
  write("events.jsonl", [&](Text& f) {
    for (const auto& event : out.engine.events) put(f, "{}\n", event_json(event));
  });
  steps.get();
  if (!out.answer_texts.empty())
    write("outputs.jsonl", [&](Text& f) { write_outputs_jsonl(f, out); });
  if (c.workload.logprobs >= 0)
    write("logprobs.jsonl", [&](Text& f) { write_logprobs_jsonl(f, out); });
  if (!out.engine.frames.empty())  // kvlab view's step frames
    write("frames.jsonl", [&](Text& f) {
      for (const StepFrame& frame : out.engine.frames) put(f, "{}\n", frame_json(frame));
    });
  if (!out.engine.verifies.empty())  // speculative decoding: a row per verify
    write("verifies.csv", [&](Text& f) {
      put(f, "request,step,proposed,accepted\n");
      for (const VerifyRecord& v : out.engine.verifies)
        put(f, "{},{},{},{}\n", v.request, v.step, v.proposed, v.accepted);
    });
}

}  // namespace kvlab
