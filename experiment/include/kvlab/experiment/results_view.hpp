#pragma once
// kvlab view: a results folder as one self-contained HTML page that replays every step (the
// batch, the KV pool slot by slot, each request's lane) of its runs, two of them side by side
// on one clock. The page embeds its data, its script and Chart.js: it opens with no network.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlab {

struct ResultsViewOptions {
  // Events past this many in a run: the defer events (a waiting request left waiting, each step)
  // are summed per step and reason instead; the others are kept.
  std::int64_t most_events = 200'000;
  // When set: each file the data was read from (the page must never be written over one).
  std::vector<std::filesystem::path>* files_read = nullptr;
};

// The page's data for a results folder that kvlab run wrote: each run's steps (steps.csv),
// requests (requests.csv without the token times), events (events.jsonl) and step frames
// (frames.jsonl). kvlab::Error naming the file and line for a folder or file it cannot read.
// Only the folder's own regular files are read (a symbolic link is an error, never followed),
// each JSON value at most 32 deep and 256 MiB, each line at most 64 MiB.
nlohmann::json results_view_data(const std::filesystem::path& folder,
                                 const ResultsViewOptions& options = {});

// The page around `data`; `live`: it polls the server it came from (kvlab serve's /ui) for
// more steps instead of holding them all.
std::string results_view_html(const nlohmann::json& data, bool live = false);
// The same around data already written as JSON text (kvlab serve's, made by LiveEngine).
std::string results_view_html(std::string data_json, bool live);

// A CSV row's cells: commas split them, double quotes enclose cells holding commas or quotes
// ("" inside is one quote), as requests.csv writes reject reasons. kvlab::Error on a quote left
// open.
std::vector<std::string> csv_row_cells(std::string_view line);

// A CSV field as RFC 4180 writes it: as it is, or quoted (quotes doubled) when it holds a
// comma, a quote or a line break. kvlab's CSV writers pass every string a user or client gave
// (tenant names, reasons) through it.
std::string csv_field(std::string_view text);

}  // namespace kvlab
