// kvlab serve FILE.toml: the experiment file's serving stack behind an OpenAI-compatible HTTP
// server (kvlab/serve/openai_server.hpp) until SIGTERM or SIGINT (or --max-seconds): then the
// requests in flight drain (or, with --abort, are cancelled), the counts are printed, and the
// served run is written as a results folder like kvlab run's.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <optional>
#include <thread>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/served_experiment.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "kvlab/model/chat_template.hpp"
#include "kvlab/model/tokenizer.hpp"
#include "kvlab/serve/http_server.hpp"
#include "kvlab/serve/openai_api.hpp"
#include "kvlab/serve/openai_server.hpp"

namespace kvlab::cli {
namespace {

struct ServeOptions {
  std::string file;
  CommandLineChanges changes;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string model_name;
  std::int64_t max_queued = 256;
  std::int64_t max_connections = 2048;
  double max_body_mb = 4;
  double read_timeout_s = 30;
  int http_threads = 2;
  bool abort = false;      // at shutdown: cancel what is in flight instead of draining it
  double max_seconds = 0;  // > 0: shut down by itself after this long
  std::string ui = "aggregate";
  std::int64_t max_users = 1000;
  std::string out;
  bool force = false;
};

// The model's tokenizer and chat template, when its checkpoint has them.
struct ModelText {
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat;
  std::vector<std::int32_t> stop_tokens;  // the chat's end of turn
  std::string note;                       // why there is no chat or tokenizer
};

ModelText model_text(const ExperimentConfig& c) {
  ModelText t;
  const ModelSource source = resolve_model(c.model);
  if (source.is_preset()) {
    t.note = "a preset has no tokenizer: prompts are token ids, answers \" <id>\" per token";
    return t;
  }
  TokenizerLookup lookup = find_tokenizer(source.directory, source.config.vocab_size);
  t.tokenizer = std::move(lookup.tokenizer);
  if (!t.tokenizer) {
    t.note = "no tokenizer (" + lookup.why_not + "): prompts are token ids";
    return t;
  }
  try {
    t.chat = ChatTemplate::detect(lookup.chat_template, source.directory.string());
    t.stop_tokens.push_back(t.chat->end_of_turn(*t.tokenizer));
  } catch (const Error& e) {
    t.note = fmt::format("no chat completions: {}", e.what());
  }
  return t;
}

// What clients name the model by default: a preset's name, a checkpoint folder's or GGUF file's
// own name ("SmolLM2-135M-Instruct.Q4_1"), not the path it was found at.
std::string default_model_name(const std::string& name) {
  std::filesystem::path path(name);
  if (path.extension() == ".gguf") path.replace_extension();
  const std::string last = path.filename().string();
  return last.empty() ? name : last;
}

// Waits (with SIGTERM and SIGINT blocked in every thread) for one of them or the deadline.
std::string wait_for_shutdown(const sigset_t& signals, double max_seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(max_seconds > 0 ? max_seconds : 1e9);
  while (std::chrono::steady_clock::now() < deadline) {
    timespec tick{0, 100'000'000};
    const int signal = sigtimedwait(&signals, nullptr, &tick);
    if (signal == SIGTERM) return "SIGTERM";
    if (signal == SIGINT) return "SIGINT";
  }
  return fmt::format("--max-seconds {}", max_seconds);
}

std::filesystem::path results_path(const ServeOptions& o, const ExperimentConfig& c) {
  if (!o.out.empty()) return o.out;
  if (!c.output_dir.empty()) return c.output_dir;
  return std::filesystem::path("results") / (c.name + "_served");
}

// The served run into the results folder taken before serving began (so a folder that cannot
// be written is refused then, not after the session, with its record lost).
void write_served_run(const ServeOptions& o, const std::string& experiment_text,
                      ResultsFolder& folder, const std::vector<ExperimentRun>& runs,
                      const RunOutput& out, const std::filesystem::path& journal) {
  const std::filesystem::path dir = folder.staging() / run_directory_name(runs.front(), 0);
  RunRecord record = record_run(runs, 0, out, dir, 0);
  // The journal joins the run's files (every choice as the server answered it); the folder's
  // requests.csv, written from the engine's record, says the same of each.
  std::error_code ec;
  std::filesystem::rename(journal, dir / "journal.jsonl", ec);
  if (ec)
    fmt::print(stderr, "kvlab serve: the journal stays at {} ({})\n", journal.string(),
               ec.message());
  const SweepReport r = report_sweep(false, 1, runs, {std::move(record)});
  for (const SweepReport::Line& line : r.lines)
    fmt::print(line.to_stderr ? stderr : stdout, "{}", line.text);
  finish_results(folder, r, o.file, experiment_text, o.changes, 1, 1);
}

constexpr double kMaxTimeoutS = 86400;       // a day
constexpr double kMaxServeSeconds = 31.6e6;  // a year

std::optional<LiveViewDetail> ui_detail(const std::string& ui) {
  if (ui == "off") return std::nullopt;
  return ui == "full" ? LiveViewDetail::full : LiveViewDetail::aggregate;
}

// The journal beside the results folder while serving (RequestJournal): a journal left there by
// a server that died is kept, renamed with its time, never appended to or overwritten.
std::filesystem::path journal_path(const ResultsFolder& folder) {
  const std::filesystem::path path =
      folder.path().parent_path() / (folder.path().filename().string() + ".journal.jsonl");
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(path, ec))) {
    const std::filesystem::path kept =
        path.parent_path() / fmt::format("{}.journal-{}.jsonl", folder.path().filename().string(),
                                         static_cast<long long>(std::time(nullptr)));
    std::filesystem::rename(path, kept, ec);
    if (ec)
      throw Error(
          fmt::format("{} is left from a served run that did not finish, and cannot be "
                      "moved aside: {}",
                      path.string(), ec.message()));
    fmt::print(stderr, "kvlab serve: the journal of a served run that did not finish: {}\n",
               kept.string());
  }
  return path;
}

serve::HttpServerOptions http_options(const ServeOptions& o) {
  serve::HttpServerOptions h;
  h.host = o.host;
  h.port = static_cast<std::uint16_t>(o.port);
  h.threads = o.http_threads;
  h.max_connections = o.max_connections;
  h.max_body_bytes = static_cast<std::int64_t>(o.max_body_mb * (1 << 20));
  h.read_timeout_s = o.read_timeout_s;
  h.error_body = [](int status, const std::string& message) {
    return serve::error_body(message, status == 413 ? "invalid_request_error" : "server_error", "",
                             status == 413 ? "body_too_large" : "too_many_connections");
  };
  return h;
}

void check_serve_options(const ServeOptions& o) {
  if (o.port < 0 || o.port > 65535) throw Error(fmt::format("--port {}: not in 0..65535", o.port));
  if (o.max_queued < 1) throw Error("--max-queued must be >= 1");
  if (o.max_connections < 1) throw Error("--max-connections must be >= 1");
  if (!(o.max_body_mb > 0) || o.max_body_mb > 1024)
    throw Error("--max-body-mb must be in (0, 1024]");
  // Bounded: a steady_clock deadline of 1e300 s (or inf) overflows and fires at once.
  if (!(o.read_timeout_s > 0) || o.read_timeout_s > kMaxTimeoutS)
    throw Error(fmt::format("--read-timeout {}: must be in (0, {}] seconds", o.read_timeout_s,
                            kMaxTimeoutS));
  if (o.http_threads < 1 || o.http_threads > 64) throw Error("--http-threads must be in 1..64");
  if (!(o.max_seconds >= 0) || o.max_seconds > kMaxServeSeconds)
    throw Error(fmt::format("--max-seconds {}: must be in [0, {:.0f}] (a year; 0: until a signal)",
                            o.max_seconds, kMaxServeSeconds));
  if (o.max_users < 1) throw Error("--max-users must be >= 1");
}

int serve(ServeOptions o) {
  check_serve_options(o);
  if (o.api_key.empty())
    if (const char* key = std::getenv("KVLAB_API_KEY")) o.api_key = key;
  std::vector<ExperimentRun> runs = load_experiment(o.file, o.changes, nullptr);
  if (runs.size() != 1) {
    std::vector<std::string> labels;
    for (const ExperimentRun& run : runs) labels.push_back(run.config.label);
    throw Error(fmt::format(
        "kvlab serve serves one run; {} expands to {}: {}. Pick one with --set (a key the file "
        "sweeps, set once, replaces the axis)",
        o.file, runs.size(), fmt::join(labels, "; ")));
  }
  validate_experiment(runs, false);
  ExperimentConfig& c = runs.front().config;
  // What the served run's record says: real arrivals, steps on the wall clock (the simulated
  // backend's paced by its profile), whatever clock the file replays on.
  c.clock = c.backend_kind == BackendKind::simulated ? EngineClock::paced : EngineClock::wall;
  const std::string experiment_text = read_experiment_text(o.file);
  ResultsFolder folder(results_path(o, c), ResultsFolder::Options{o.force, {o.file}});
  ModelText text = model_text(c);
  sigset_t signals;  // blocked before any thread starts: only wait_for_shutdown takes them
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  LiveOptions live;
  live.max_queued = o.max_queued;
  ServedExperiment served(c, live, text.stop_tokens);
  serve::OpenAiOptions api;
  api.model_name = o.model_name.empty() ? default_model_name(served.model().name) : o.model_name;
  api.api_key = o.api_key;
  api.max_sequence_tokens = served.kv_slots();
  api.ui = ui_detail(o.ui);
  api.max_users = o.max_users;
  api.journal = journal_path(folder);
  serve::OpenAiServer openai(served.engine(), served.model(), text.tokenizer.get(), text.chat, api);
  serve::HttpServerOptions http = http_options(o);
  http.on_refused = [&openai](int status) { openai.count_refusal(status); };
  serve::HttpServer server(std::move(http), [&openai](serve::HttpRequest r, auto reply) {
    openai.handle(std::move(r), std::move(reply));
  });
  if (!text.note.empty()) fmt::print(stderr, "kvlab serve: {}\n", text.note);
  const std::string replicas =
      c.disaggregated()
          ? fmt::format(", {} prefill replicas behind {}, {} decode behind {}", c.prefill_replicas,
                        c.router, c.replicas - c.prefill_replicas, c.decode_router)
      : c.replicas > 1 ? fmt::format(", {} replicas behind {}", c.replicas, c.router)
                       : "";
  fmt::print(stderr,
             "kvlab serve: {} on http://{}:{} (model \"{}\"{}{}); SIGTERM or Ctrl-C stops\n",
             c.name, o.host, server.port(), api.model_name, replicas,
             o.api_key.empty() ? "" : ", key needed");
  std::thread stopper([&] {
    const std::string why = wait_for_shutdown(signals, o.max_seconds);
    fmt::print(stderr, "kvlab serve: {}: {} the requests in flight\n", why,
               o.abort ? "aborting" : "draining");
    openai.set_draining();
    const ShutdownReport report = served.engine().shutdown(!o.abort);
    fmt::print(stderr, "kvlab serve: {} drained, {} aborted\n", report.drained, report.aborted);
    server.stop();
  });
  server.run();
  stopper.join();
  const std::string fault = served.engine().fault();
  write_served_run(o, experiment_text, folder, runs, served.finish(), api.journal);
  if (!fault.empty()) throw Error("the engine stopped: " + fault);
  return 0;
}

}  // namespace

void register_serve(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<ServeOptions>();
  auto* sub = app.add_subcommand(
      "serve", "Serve an experiment file's stack over the OpenAI API (HTTP, loopback by default)");
  sub->add_option("file", o->file, "Experiment file (TOML): one run")->required();
  sub->add_option("--set", o->changes.set, "Set a key: --set scheduler.name=priority (repeatable)");
  sub->add_option("--host", o->host, "Address to bind (default 127.0.0.1: this machine only)");
  sub->add_option("--port", o->port, "Port (default 8000; 0: any free port, printed)");
  sub->add_option("--api-key", o->api_key,
                  "Require 'Authorization: Bearer KEY' on every route but /health (or "
                  "KVLAB_API_KEY)");
  sub->add_option("--model-name", o->model_name,
                  "The model id clients name (default: the model's)");
  sub->add_option("--max-queued", o->max_queued,
                  "Requests waiting for the engine before a 429 (default 256)");
  sub->add_option("--max-connections", o->max_connections,
                  "Open connections before a 503 (default 2048)");
  sub->add_option("--max-body-mb", o->max_body_mb, "Largest request body, MiB (default 4)");
  sub->add_option("--read-timeout", o->read_timeout_s,
                  "Seconds a client has to send a request (and idle keep-alive; default 30)");
  sub->add_option("--http-threads", o->http_threads, "Threads for the connections (default 2)");
  sub->add_flag("--abort", o->abort, "At SIGTERM, cancel the requests in flight (default: drain)");
  sub->add_option("--max-seconds", o->max_seconds, "Shut down by itself after this long (tests)");
  sub->add_option("--ui", o->ui,
                  "What /ui shows: aggregate (default: batch, queue and step times, no client's "
                  "cache hits), full (every step's prefill, pool and requests: any client sees "
                  "other clients' prefix hits), off")
      ->check(CLI::IsMember({"aggregate", "full", "off"}));
  sub->add_option("--max-users", o->max_users,
                  "Distinct 'user' values the served run records before a new one is a 400 "
                  "(default 1000)");
  sub->add_option("--out", o->out,
                  "Results folder (default: [output] dir, or results/<name>_served)");
  sub->add_flag("--force", o->force, "Replace an earlier served run in the results folder");
  sub->callback([o, &exit_code]() { exit_code = serve(*o); });
}

}  // namespace kvlab::cli
