#pragma once
// Pieces shared by the kvlab subcommands.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvlab/experiment/experiment.hpp"
#include "kvlab/experiment/model_source.hpp"
#include "kvlab/experiment/results_folder.hpp"
#include "kvlab/experiment/sweep_report.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/plugin_params.hpp"
#include "kvlab/sim/hardware_profile.hpp"

namespace kvlab::cli {

// "1, 2,3" -> {1, 2, 3}. Throws kvlab::Error naming the bad item and its position.
std::vector<std::int32_t> parse_token_ids(const std::string& text);

// "block_size=16" -> {"block_size", 16}: a plugin parameter from the command line (integers,
// reals, booleans and quoted strings as TOML reads them; anything else is a string). Throws
// kvlab::Error when there is no "key=".
std::pair<std::string, ParamValue> parse_param(const std::string& text);

// 1073741824 -> "1.00 GiB"
std::string human_bytes(double bytes);

// A long command's progress on stderr: `line` rewritten in place on a terminal (`last`: then
// left standing), a line each otherwise; and its ETA from `done` of `total` units since `start`
// ("?" before the first).
void print_progress_line(const std::string& line, bool last = false);
std::string eta_text(double done, double total, std::chrono::steady_clock::time_point start);

// A text file's contents (WikiText-2 for perplexity and eval); kvlab::Error naming the data set
// to install when it is one kvlab knows and it is missing.
std::string read_text(const std::string& path);

// An experiment file's text as it was run (the results folder keeps a copy). Throws
// kvlab::Error when it cannot be read.
std::string read_experiment_text(const std::string& file);

// The results folder's index files (summary.md, runs.json, manifest.json, experiment.toml) into
// its staging folder, then the folder into place; prints its notes and where it is.
void finish_results(ResultsFolder& folder, const SweepReport& report, const std::string& file,
                    const std::string& experiment_text, const CommandLineChanges& changes,
                    std::size_t runs, int ranks);

void register_generate(CLI::App& app);
void register_model(CLI::App& app);
void register_memory(CLI::App& app);
void register_calibrate(CLI::App& app);

// Opens `path` for writing, its folder made first; kvlab::Error naming what failed.
std::ofstream open_output_file(const std::string& path);
// A profile file: `header` (comment lines, each "# ..."), then the profile's TOML.
void write_profile_file(const std::string& path, const std::string& header,
                        const HardwareProfile& profile);

// kvlab calibrate --vidur (cmd_calibrate_vidur.cpp).
struct VidurCalibration {
  std::string folder, gpu, profile, out, name, report, attention_model, attention_from;
  std::string carry_from;  // --carry-from: no fit, another GPU's kernel terms (same silicon)
  std::vector<std::string> fit_models{"Llama-2-7b-hf", "CodeLlama-34b-Instruct-hf"};
};
void run_calibrate_vidur(const VidurCalibration& options);
void run_calibrate_carry(const VidurCalibration& options);
void register_cost(CLI::App& app);
void register_plugins(CLI::App& app);
void register_metrics(CLI::App& app);
void register_view(CLI::App& app);
void register_perplexity(CLI::App& app);
void register_eval(CLI::App& app);
// run and check; a failed check sets exit_code.
void register_run(CLI::App& app, int& exit_code);
void register_serve(CLI::App& app, int& exit_code);

}  // namespace kvlab::cli
