#pragma once
// Vidur's measured GPU operator timings (microsoft/vidur, MLSys'24, MIT licence; ../shared/data/
// vidur-profiling and its README): one decoder layer's operators by tokens and tensor parallelism
// (mlp.csv), attention by batch and KV length (attention_excerpt.csv, A100 only) and NCCL
// all-reduces by size and GPU count (network/<gpu>_dgx/all_reduce.csv). kvlab calibrate --vidur
// fits a profile's kernel terms to them and reports how far the cost model is from each one.
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/model_config.hpp"

namespace kvlab {

// mlp.csv's operators, one kernel each; `kvlab` names the cost model's operator it is priced as
// (CostModel::breakdown), `column` Vidur's time_stats column.
enum class VidurOperator {
  qkv_proj,
  o_proj,
  gate_up_proj,
  down_proj,
  input_norm,
  post_attention_norm,
  rope,
  activation,
  residual_add,
  embedding
};
inline constexpr int kVidurOperators = 10;
struct VidurOperatorName {
  const char* column;
  const char* kvlab;
};
inline constexpr std::array<VidurOperatorName, kVidurOperators> kVidurOperatorNames = {{
    {"attn_pre_proj", "qkv_proj"},
    {"attn_post_proj", "o_proj"},
    {"mlp_up_proj", "gate_up_proj"},
    {"mlp_down_proj", "down_proj"},
    {"input_layernorm", "rms_norm"},
    {"post_attention_layernorm", "rms_norm"},
    {"attn_rope", "rope"},
    {"mlp_act", "activation"},
    {"add", "residual_add"},
    {"emb", "embedding"},
}};

// One row of mlp.csv: the median seconds of each operator at `tokens` rows on one of
// `tensor_parallel` GPUs.
struct VidurLayerRow {
  std::int64_t tokens = 0;
  std::int64_t tensor_parallel = 1;
  std::array<double, kVidurOperators> seconds{};
};

// One row of attention_excerpt.csv (tensor parallelism 1): a decode of `batch` sequences with
// `kv_cache` keys each, or a prefill chunk of `chunk` tokens after `kv_cache` cached ones.
struct VidurAttentionRow {
  bool prefill = false;
  std::int64_t batch = 1, chunk = 0, kv_cache = 0;
  double seconds = 0;
};

struct VidurModel {
  std::string name;    // the folder: Llama-2-7b-hf, Meta-Llama-3-8B, ...
  ModelConfig config;  // one layer, from mlp.csv's shape columns
  std::vector<VidurLayerRow> layers;
  std::vector<VidurAttentionRow> attention;  // empty without an excerpt
  std::string attention_backend;             // FLASH_ATTENTION, FLASHINFER
};

// One all-reduce of `bytes` (fp16 elements x 2) over `gpus` GPUs of one node.
struct VidurAllReduceRow {
  std::int64_t gpus = 2;
  double bytes = 0, seconds = 0;
};

struct VidurData {
  std::string gpu;  // a100, h100
  std::filesystem::path root;
  std::vector<VidurModel> models;  // sorted by name
  std::vector<VidurAllReduceRow> allreduce;
  // The model named `name`; kvlab::Error listing the models else.
  const VidurModel& model(std::string_view name) const;
};

// `root`: the vidur-profiling folder (or its data/profiling); `gpu`: a100 or h100. Every file
// problem (missing, a column absent, a cell that is not a number) is a kvlab::Error naming the
// file and line.
VidurData load_vidur_data(const std::filesystem::path& root, std::string_view gpu);

}  // namespace kvlab
