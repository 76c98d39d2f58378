#pragma once
// The experiment file's TOML between its parser (experiment_config.cpp) and the sweep's
// expansion (sweep_points.cpp): internal to the experiment library.
#include <toml++/toml.h>

#include <string>
#include <vector>

#include "kvlab/experiment/experiment.hpp"

namespace kvlab {

// One sweep point's whole table (the sweep and --set applied) to its config; every problem is
// a kvlab::Error "file:line:column: why".
ExperimentConfig parse_config(const toml::table& root, const std::string& file);

// Sets a dotted key ("scheduler.params.max_batch") in the table, creating tables on the way;
// `origin` names the setter in errors ("--set ...", "[[sweep]] key").
void set_dotted(toml::table& root, const std::string& key, const toml::node& value,
                const std::string& origin);

// One [[sweep]] table of the file, checked: the key, its values (into `root`), its zip group
// ("axis:KEY" when it has none).
struct SweepTable {
  std::string key;
  const toml::array* values = nullptr;
  std::string group;
};
std::vector<SweepTable> read_sweep_tables(const toml::table& root, const std::string& file);

// A value as a label shows it: a string bare, anything else as TOML.
std::string value_text(const toml::node& node);

}  // namespace kvlab
