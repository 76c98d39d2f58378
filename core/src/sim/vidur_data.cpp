// Reading Vidur's profiling CSV files (kvlab/sim/vidur_data.hpp).
#include "kvlab/sim/vidur_data.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "../csv_fields.hpp"
#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {
namespace {

namespace fs = std::filesystem;

// A CSV file read whole: its columns by name, and each row's cells, with the file and line for
// messages.
class CsvTable {
 public:
  explicit CsvTable(const fs::path& file) : file_(file.string()) {
    std::ifstream in(file);
    if (!in) throw Error(fmt::format("{}: cannot be read", file_));
    std::string line;
    if (!std::getline(in, line)) throw Error(fmt::format("{}: empty (no header)", file_));
    const auto names = csv_header_names(csv_cells(line));
    for (std::size_t i = 0; i < names.size(); ++i) columns_.emplace(names[i], i);
    for (std::size_t number = 2; std::getline(in, line); ++number) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      rows_.push_back({number, csv_cells(line)});
      if (rows_.back().cells.size() != names.size())
        throw Error(fmt::format("{}:{}: {} cells, the header has {}", file_, number,
                                rows_.back().cells.size(), names.size()));
    }
  }
  std::size_t rows() const { return rows_.size(); }
  std::size_t column(const std::string& name) const {
    const auto it = columns_.find(name);
    if (it == columns_.end()) throw Error(fmt::format("{}: no column {}", file_, name));
    return it->second;
  }
  const std::string& text(std::size_t row, const std::string& name) const {
    return rows_[row].cells[column(name)];
  }
  double number(std::size_t row, const std::string& name) const {
    try {
      return parse_number<double>(text(row, name), name.c_str());
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}: {}", file_, rows_[row].line, e.what()));
    }
  }
  std::int64_t integer(std::size_t row, const std::string& name) const {
    const double v = number(row, name);
    if (v != static_cast<double>(static_cast<std::int64_t>(v)) || v < 0 || v > 1e12)
      throw Error(fmt::format("{}:{}: {} {} is not a count", file_, rows_[row].line, name, v));
    return static_cast<std::int64_t>(v);
  }
  // A count in [low, high] (shapes a cost model can price: no step of 2^40 sequences).
  std::int64_t count(std::size_t row, const std::string& name, std::int64_t low,
                     std::int64_t high) const {
    const std::int64_t v = integer(row, name);
    if (v < low || v > high)
      throw Error(fmt::format("{}:{}: {} {} is outside [{}, {}]", file_, rows_[row].line, name, v,
                              low, high));
    return v;
  }
  // A time column (milliseconds) in seconds, > 0.
  double seconds(std::size_t row, const std::string& name) const {
    const double ms = number(row, name);
    if (!(ms > 0) || ms > 1e6)
      throw Error(fmt::format("{}:{}: {} {} ms is not a time", file_, rows_[row].line, name, ms));
    return ms * 1e-3;
  }
  const std::string& file() const { return file_; }

 private:
  struct Row {
    std::size_t line;
    std::vector<std::string> cells;
  };
  std::string file_;
  std::map<std::string, std::size_t> columns_;
  std::vector<Row> rows_;
};

// One layer of the model mlp.csv's first row describes (vocabulary as Vidur pads it).
ModelConfig model_from_row(const CsvTable& t, const std::string& name) {
  ModelConfig m;
  m.name = name;
  m.hidden_size = t.count(0, "n_embd", 1, 1 << 20);
  m.num_attention_heads = t.count(0, "n_head", 1, 1 << 14);
  m.num_key_value_heads = t.count(0, "n_kv_head", 1, 1 << 14);
  m.intermediate_size = t.count(0, "n_expanded_embd", 1, 1 << 22);
  m.vocab_size = t.count(0, "vocab_size", 1, 1 << 24);
  if (m.hidden_size % m.num_attention_heads != 0 ||
      m.num_attention_heads % m.num_key_value_heads != 0)
    throw Error(fmt::format("{}: heads {} / {} do not divide hidden {}", t.file(),
                            m.num_attention_heads, m.num_key_value_heads, m.hidden_size));
  m.head_dim = m.hidden_size / m.num_attention_heads;
  m.num_hidden_layers = 1;
  m.max_position_embeddings = 1 << 20;
  m.size_only = true;
  return m;
}

std::vector<VidurLayerRow> layer_rows(const CsvTable& t) {
  std::vector<VidurLayerRow> rows;
  for (std::size_t r = 0; r < t.rows(); ++r) {
    VidurLayerRow row;
    row.tokens = t.count(r, "num_tokens", 1, 1 << 24);
    row.tensor_parallel = t.count(r, "num_tensor_parallel_workers", 1, 1024);
    for (int op = 0; op < kVidurOperators; ++op)
      row.seconds[static_cast<std::size_t>(op)] =
          t.seconds(r, fmt::format("time_stats.{}.median",
                                   kVidurOperatorNames[static_cast<std::size_t>(op)].column));
    rows.push_back(row);
  }
  return rows;
}

void read_attention(const fs::path& file, VidurModel& model) {
  const CsvTable t(file);
  for (std::size_t r = 0; r < t.rows(); ++r) {
    if (t.integer(r, "num_tensor_parallel_workers") != 1) continue;
    VidurAttentionRow row;
    row.prefill = t.text(r, "is_prefill") == "True";
    row.batch = t.count(r, "batch_size", 1, 1 << 16);
    row.chunk = t.count(r, "prefill_chunk_size", 0, 1 << 24);
    row.kv_cache = t.count(r, "kv_cache_size", 0, 1 << 24);
    row.seconds = t.seconds(
        r, row.prefill ? "time_stats.attn_prefill.median" : "time_stats.attn_decode.median");
    if ((row.prefill && row.chunk < 1) || (!row.prefill && row.kv_cache < 1))
      throw Error(fmt::format("{}: an attention row of batch {}, chunk {}, {} cached",
                              file.string(), row.batch, row.chunk, row.kv_cache));
    model.attention.push_back(row);
    model.attention_backend = t.text(r, "attention_backend");
  }
  const std::string prefix = "AttentionBackend.";
  if (model.attention_backend.starts_with(prefix)) model.attention_backend.erase(0, prefix.size());
}

// All-reduces inside one node (devices_per_node == num_workers): a DGX's NVSwitch.
std::vector<VidurAllReduceRow> allreduce_rows(const fs::path& file) {
  const CsvTable t(file);
  std::vector<VidurAllReduceRow> rows;
  for (std::size_t r = 0; r < t.rows(); ++r) {
    const std::int64_t gpus = t.count(r, "num_workers", 1, 1024);
    if (t.text(r, "collective") != "all_reduce" || gpus < 2 ||
        t.integer(r, "devices_per_node") != gpus)
      continue;
    rows.push_back({gpus, 2.0 * static_cast<double>(t.count(r, "size", 1, std::int64_t{1} << 40)),
                    t.seconds(r, "time_stats.all_reduce.median")});
  }
  return rows;
}

}  // namespace

const VidurModel& VidurData::model(std::string_view name) const {
  std::vector<std::string> names;
  for (const VidurModel& m : models) {
    if (m.name == name) return m;
    names.push_back(m.name);
  }
  throw Error(fmt::format("Vidur's {} profiles have no model {}; they have {}", gpu, name,
                          join_names(names)));
}

VidurData load_vidur_data(const fs::path& root, std::string_view gpu) {
  if (gpu != "a100" && gpu != "h100")
    throw Error(fmt::format("Vidur GPU \"{}\": choose a100 or h100", gpu));
  VidurData data;
  data.gpu = std::string(gpu);
  data.root = fs::exists(root / "data" / "profiling") ? root / "data" / "profiling" : root;
  const fs::path compute = data.root / "compute" / data.gpu;
  std::error_code ec;
  if (!fs::is_directory(compute, ec))
    throw Error(
        fmt::format("{}: not Vidur's profiling folder (no compute/{}/; give the "
                    "vidur-profiling folder of ../shared/data)",
                    root.string(), data.gpu));
  for (const auto& org : fs::directory_iterator(compute))
    for (const auto& folder : fs::directory_iterator(org.path())) {
      const fs::path mlp = folder.path() / "mlp.csv";
      if (!fs::exists(mlp)) continue;
      const CsvTable t(mlp);
      if (t.rows() == 0) throw Error(fmt::format("{}: no rows", mlp.string()));
      VidurModel model;
      model.name = folder.path().filename().string();
      model.config = model_from_row(t, model.name);
      model.layers = layer_rows(t);
      if (fs::exists(folder.path() / "attention_excerpt.csv"))
        read_attention(folder.path() / "attention_excerpt.csv", model);
      data.models.push_back(std::move(model));
    }
  std::sort(data.models.begin(), data.models.end(),
            [](const VidurModel& a, const VidurModel& b) { return a.name < b.name; });
  const fs::path network = data.root / "network" / (data.gpu + "_dgx") / "all_reduce.csv";
  if (fs::exists(network)) data.allreduce = allreduce_rows(network);
  if (data.models.empty())
    throw Error(fmt::format("{}: no <org>/<model>/mlp.csv", compute.string()));
  return data;
}

}  // namespace kvlab
