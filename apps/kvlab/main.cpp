// kvlab: the command-line front end. Each subcommand lives in its own cmd_*.cpp.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "cli_common.hpp"
#include "kvlab/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"kvlab: a testbed for the KV cache and continuous batching"};
  app.set_version_flag("--version", std::string(KVLAB_VERSION));
  app.require_subcommand(1);
  kvlab::cli::register_generate(app);
  kvlab::cli::register_model(app);
  kvlab::cli::register_memory(app);
  try {
    app.parse(argc, argv);  // subcommands run from their callbacks
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kvlab::Error& e) {
    fmt::print(stderr, "kvlab: error: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvlab: internal error: {}\n", e.what());
    return 3;
  }
  return 0;
}
