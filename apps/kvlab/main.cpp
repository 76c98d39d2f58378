// kvlab: the command-line front end. Each subcommand lives in its own cmd_*.cpp.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>

#include "cli_common.hpp"
#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) makes a write fail with EFBIG, reported like a full disk,
  // instead of killing kvlab with SIGXFSZ halfway through a results folder.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"kvlab: a testbed for the KV cache and continuous batching"};
  app.set_version_flag("--version", std::string(KVLAB_VERSION));
  app.require_subcommand(1);
  kvlab::cli::register_generate(app);
  kvlab::cli::register_model(app);
  kvlab::cli::register_memory(app);
  kvlab::cli::register_calibrate(app);
  kvlab::cli::register_cost(app);
  kvlab::cli::register_plugins(app);
  kvlab::cli::register_metrics(app);
  kvlab::cli::register_view(app);
  kvlab::cli::register_perplexity(app);
  kvlab::cli::register_eval(app);
  int exit_code = 0;
  kvlab::cli::register_run(app, exit_code);
  kvlab::cli::register_serve(app, exit_code);
  if (argc > 1 && argv[1][0] != '-') {  // name an unknown command (CLI11 only says one is required)
    std::vector<std::string> commands;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
      commands.push_back(sub->get_name());
    if (std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
      std::string message = fmt::format("kvlab: error: unknown command \"{}\"", argv[1]);
      if (auto near = kvlab::nearest_name(argv[1], commands))
        message += fmt::format(" (did you mean \"{}\"?)", *near);
      fmt::print(stderr, "{}; commands: {}\n", message, kvlab::join_names(commands));
      return 2;
    }
  }
  try {
    app.parse(argc, argv);  // subcommands run from their callbacks
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // a usage error: exit 2, as docs/cli.md says
    fmt::print(stderr, "kvlab: error: {}\nRun with --help for more information.\n", e.what());
    return 2;
  } catch (const kvlab::Error& e) {
    fmt::print(stderr, "kvlab: error: {}\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {  // a size no check caught: still the input's, not a bug
    fmt::print(stderr,
               "kvlab: error: out of memory: the input asks for more than this machine holds "
               "(sizes and limits: docs/experiments.md)\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvlab: internal error: {}\n", e.what());
    return 3;
  } catch (...) {  // a plugin's throw that no boundary caught: still one message, no abort
    fmt::print(stderr, "kvlab: internal error: an exception that is not a std::exception\n");
    return 3;
  }
  return exit_code;
}
