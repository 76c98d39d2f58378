// The `cuda` backend plugin: the LLaMA forward on one GPU. Weights are uploaded once (fp32 or
// bf16); the KV cache lives in device memory indexed by the same slots the allocator plugins
// hand out (the host KvPool keeps only the bookkeeping and forwards copies here); every step
// uploads its tokens, positions, slots and each sequence's block table (block_table.hpp: a paged
// view's blocks, a contiguous one's single run) once and reuses them in every layer. Projections
// and the MLP are cuBLASLt GEMMs (lt_gemm.hpp) with fp32 accumulation; the residual stream stays
// fp32; logits come back to the host for the engine's sampler, or, when the engine asks
// (Backend::forward given choices), only each entry's token, chosen on the device. Decode steps
// whose tokens the device picks replay a CUDA graph per batch bucket (replay_graph).
#include "kvlab/eigen_core.hpp"  // first: before anything that includes <immintrin.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <map>
#include <utility>
#include <vector>

#include "device_buffers.hpp"
#include "kvlab/cpu_reference/ops.hpp"
#include "kvlab/cuda/block_table.hpp"
#include "kvlab/cuda/device.hpp"
#include "kvlab/cuda/kernels.hpp"
#include "kvlab/error.hpp"
#include "kvlab/plugin.hpp"
#include "lt_gemm.hpp"

namespace {

using kvlab::Error;
using kvlab::cuda::check;
using kvlab::cuda::DeviceBuffer;
using kvlab::cuda::Dtype;
using kvlab::cuda::GraphExec;
using kvlab::cuda::PinnedBuffer;

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(fmt::format("cuda backend: {}: cuBLAS status {}", what, static_cast<int>(status)));
}

// The batch sizes decode steps are captured as graphs for (a step pads up to one): 1, 2, 4,
// then multiples of 8 up to 512, as vLLM does; 0 (no graph) beyond.
std::int64_t graph_batch_bucket(std::int64_t count) {
  if (count <= 4)
    return static_cast<std::int64_t>(std::bit_ceil(static_cast<std::uint64_t>(count)));
  return count <= 512 ? (count + 7) / 8 * 8 : 0;
}

cudaDataType_t cuda_type(Dtype d) {
  return d == Dtype::f32 ? CUDA_R_32F : CUDA_R_16BF;
}

// A weight matrix on the device, converted to the compute dtype.
DeviceBuffer upload_matrix(const kvlab::WeightMatrixView& matrix, Dtype dtype) {
  const std::span<const float> values = matrix.values();
  DeviceBuffer buffer(values.size() * kvlab::cuda::dtype_bytes(dtype));
  if (dtype == Dtype::f32) {
    check(cudaMemcpy(buffer.get(), values.data(), values.size_bytes(), cudaMemcpyHostToDevice),
          "upload weights");
  } else {
    std::vector<Eigen::bfloat16> converted(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) converted[i] = Eigen::bfloat16(values[i]);
    check(cudaMemcpy(buffer.get(), converted.data(), converted.size() * sizeof(Eigen::bfloat16),
                     cudaMemcpyHostToDevice),
          "upload weights");
  }
  return buffer;
}

DeviceBuffer upload_floats(std::span<const float> values) {
  DeviceBuffer buffer(values.size_bytes());
  check(cudaMemcpy(buffer.get(), values.data(), values.size_bytes(), cudaMemcpyHostToDevice),
        "upload");
  return buffer;
}

struct DeviceLayer {
  DeviceBuffer attention_norm, w_qkv, wo, mlp_norm, w_gate_up, w_down;
};

class CudaBackend final : public kvlab::Backend, public kvlab::KvDeviceStorage {
 public:
  CudaBackend(const kvlab::PluginParams& params, const kvlab::PluginContext& context)
      : pool_(context.pool), window_(context.window) {
    if (context.weights == nullptr || context.pool == nullptr)
      throw Error("cuda backend: needs the model weights and the KV pool (a host bug)");
    const kvlab::cuda::DeviceProbe probe =
        kvlab::cuda::probe_device(static_cast<int>(params.integer("device")));
    if (!probe.available) throw Error(fmt::format("cuda backend: {}", probe.reason));
    check(cudaSetDevice(static_cast<int>(params.integer("device"))), "cudaSetDevice");
    read_params(params);
    const kvlab::ModelWeightsView& w = *context.weights;
    config_ = w.config;
    const kvlab::ModelConfig& c = config_;
    if (c.is_mla())
      throw Error(
          fmt::format("cuda backend: {} has latent attention (MLA), which only the cpu "
                      "reference runs so far",
                      c.name));
    if (c.is_gemma3())
      throw Error(
          fmt::format("cuda backend: {} is a Gemma 3 model (local:global layers, Q/K and "
                      "post norms, GeGLU), which only the cpu reference runs so far",
                      c.name));
    if (!kvlab::cuda::attention_supports(c.head_dim))
      throw Error(
          fmt::format("cuda backend: head_dim {} is not instantiated (16, 32, 48, 64, 80, "
                      "96, 128 or 256)",
                      c.head_dim));
    const kvlab::KvPoolShape& shape = pool_->shape();
    if (shape.kv_heads != c.num_key_value_heads || shape.head_dim != c.head_dim ||
        shape.layers != c.num_hidden_layers)
      throw Error("cuda backend: the KV pool does not match the model");

    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
    check(cublasCreate(&cublas_), "cublasCreate");
    check(cublasSetStream(cublas_, stream_), "cublasSetStream");
    // cuBLAS's own workspace, so that a GEMM inside a graph capture never allocates.
    cublas_workspace_.resize(std::size_t{32} << 20);
    check(cublasSetWorkspace(cublas_, cublas_workspace_.get(), cublas_workspace_.bytes()),
          "cublasSetWorkspace");
    if (use_lt_)
      check(lt_.init(cublas_workspace_.get(), cublas_workspace_.bytes()), "cublasLtCreate");
    upload_model(w);

    // One slot beyond the allocator's: where the padding rows of a graphed step, and entries that
    // do not write K/V (BatchEntry::writes_kv), write theirs.
    spare_slot_ = shape.slots;
    kv_format_ = device_kv_format(shape);
    slot_row_bytes_ =
        c.num_key_value_heads * kvlab::cuda::kv_row_bytes(kv_format_, dtype_, c.head_dim);
    layer_bytes_ = (shape.slots + 1) * slot_row_bytes_;
    const auto pool_bytes = static_cast<std::size_t>(shape.layers * layer_bytes_);
    k_pool_.resize(pool_bytes);
    v_pool_.resize(pool_bytes);
    check(cudaMemset(k_pool_.get(), 0, pool_bytes), "cudaMemset");
    check(cudaMemset(v_pool_.get(), 0, pool_bytes), "cudaMemset");
    pool_->attach_device(this);
  }

  ~CudaBackend() override {
    if (pool_ != nullptr && pool_->device() == this) pool_->attach_device(nullptr);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::int64_t vocab_size() const override { return config_.vocab_size; }
  kvlab::BackendCounters counters() const override { return {graph_captures_, graph_replays_}; }

  kvlab::ForwardResult forward(std::span<const kvlab::BatchEntry> batch,
                               std::span<const kvlab::TokenChoice> choices) override {
    for (const kvlab::BatchEntry& e : batch) {  // block tables of consecutive positions only
      if (e.view.has_holes() || e.scored_queries > 0 || !e.key_mask.empty())
        throw kvlab::Error(
            "the cuda backend reads consecutive positions, reports no attention scores and "
            "masks no keys: a KV policy's views need the cpu backend");
      if (e.logit_rows < 1 || e.logit_rows > static_cast<std::int64_t>(e.tokens.size()))
        throw kvlab::Error(fmt::format(
            "cuda backend: an entry of {} tokens asks for {} rows of logits (1 to its tokens)",
            e.tokens.size(), e.logit_rows));
    }
    chosen_logprobs_.clear();
    step_choices_.clear();
    step_logprob_counts_.clear();
    for (const kvlab::TokenChoice& c : choices) {
      step_choices_.push_back({c.temperature, c.top_p, c.uniform, c.top_k});
      step_logprob_counts_.push_back(c.logprobs);
    }
    StepShape step = stage_step(batch);  // 1. metadata
    if (step.rows == 0) return {};
    step.choosing = !choices.empty() && static_cast<std::int64_t>(choices.size()) == step.answers;
    const bool graphed = graphs_enabled_ && pad_for_graph(step);
    upload_step(step);  // 2. uploaded once
    grow_activations(step);
    if (!graphed || !replay_graph(step)) compute(step);  // 3.
    if (step.choosing) compute_logprobs(step);           // (outside the graphs: when asked)
    return read_out(step);                               // 4.
  }

  // KvDeviceStorage: the allocator's slot copies and the engine's swaps.
  void copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) override {
    const auto bytes = static_cast<std::size_t>(count * slot_row_bytes_);
    scratch_.resize(bytes);
    for (char* base : {k_pool_.get<char>(), v_pool_.get<char>()})
      for (std::int64_t l = 0; l < config_.num_hidden_layers; ++l) {
        char* layer = base + static_cast<std::size_t>(l * layer_bytes_);
        const auto from = static_cast<std::size_t>(source * slot_row_bytes_);
        const auto to = static_cast<std::size_t>(destination * slot_row_bytes_);
        // Through scratch: the ranges may overlap.
        check(
            cudaMemcpyAsync(scratch_.get(), layer + from, bytes, cudaMemcpyDeviceToDevice, stream_),
            "copy slots");
        check(cudaMemcpyAsync(layer + to, scratch_.get(), bytes, cudaMemcpyDeviceToDevice, stream_),
              "copy slots");
      }
    check(cudaStreamSynchronize(stream_), "copy slots");
  }

  // Swapped rows: fp32 from a pool in the compute dtype; a quantized pool's own bytes (the host
  // pool's rows of the same dtype), so a swap moves them exactly.
  std::int64_t host_row_bytes() const override {
    return kv_format_ == kvlab::cuda::KvFormat::compute
               ? config_.kv_dim() * static_cast<std::int64_t>(sizeof(float))
               : slot_row_bytes_;
  }
  void download(const std::vector<std::int64_t>& slots, std::byte* host) override {
    transfer(slots, host, true);
  }
  void upload(const std::vector<std::int64_t>& slots, const std::byte* host) override {
    transfer(slots, const_cast<std::byte*>(host), false);
  }

 private:
  void read_params(const kvlab::PluginParams& params) {
    const std::string& dtype = params.string("dtype");
    if (dtype != "f32" && dtype != "bf16")
      throw Error(fmt::format("cuda backend: dtype \"{}\": choose f32 or bf16", dtype));
    dtype_ = dtype == "f32" ? Dtype::f32 : Dtype::bf16;
    split_keys_ = static_cast<std::int32_t>(params.integer("split_keys"));
    tensor_cores_ = params.boolean("tensor_cores");
    graphs_enabled_ = params.boolean("cuda_graphs");
    const std::string& gemm = params.string("gemm");
    if (gemm != "cublaslt" && gemm != "cublas")
      throw Error(fmt::format("cuda backend: gemm \"{}\": choose cublaslt or cublas", gemm));
    use_lt_ = gemm == "cublaslt";
  }

  // The device pool's rows for the host pool's dtype: kv_cache.dtype "f32" (the default) keeps
  // K/V in the compute dtype; "fp8" and "int8" quantize them on write.
  static kvlab::cuda::KvFormat device_kv_format(const kvlab::KvPoolShape& shape) {
    if (shape.hadamard_rotated)
      throw Error(
          "cuda backend: a Hadamard-rotated KV pool (kv_cache.hadamard) needs the cpu "
          "backend, which rotates its queries to match");
    if (shape.splits_dtypes())
      throw Error(fmt::format(
          "cuda backend: K in {} and V in {}: the device pool keeps K and V in one dtype",
          kvlab::dtype_short_name(shape.dtype), kvlab::dtype_short_name(shape.dtype_of(true))));
    switch (shape.dtype) {
      case kvlab::DType::dtype_f32:
        return kvlab::cuda::KvFormat::compute;
      case kvlab::DType::dtype_f8_e4m3:
        return kvlab::cuda::KvFormat::fp8_e4m3;
      case kvlab::DType::dtype_kv_int8:
        return kvlab::cuda::KvFormat::int8;
      default:
        throw Error(fmt::format(
            "cuda backend: kv_cache.dtype \"{}\": the device pool holds \"f32\" (K/V in the "
            "backend's dtype), \"fp8\" or \"int8\"",
            kvlab::dtype_short_name(shape.dtype)));
    }
  }

  // The weights in the compute dtype (norms fp32) and RoPE's cos/sin tables (fp32).
  void upload_model(const kvlab::ModelWeightsView& w) {
    const kvlab::ModelConfig& c = config_;
    embedding_ = upload_matrix(w.embedding, dtype_);
    if (!c.tie_word_embeddings) lm_head_ = upload_matrix(w.output_projection, dtype_);
    final_norm_ = upload_floats(w.final_norm);
    for (const auto& layer : w.layers) {
      DeviceLayer d;
      d.attention_norm = upload_floats(layer.attention_norm);
      d.w_qkv = upload_matrix(layer.w_qkv, dtype_);
      d.wo = upload_matrix(layer.wo, dtype_);
      d.mlp_norm = upload_floats(layer.mlp_norm);
      d.w_gate_up = upload_matrix(layer.w_gate_up, dtype_);
      d.w_down = upload_matrix(layer.w_down, dtype_);
      layers_.push_back(std::move(d));
    }
    const kvlab::cpu::RopeTable rope(c);
    std::vector<float> cos, sin;  // (max_positions, head_dim / 2) each
    for (std::int64_t p = 0; p < c.max_position_embeddings; ++p)
      for (std::int64_t i = 0; i < c.head_dim / 2; ++i) {
        cos.push_back(rope.cos(p, i));
        sin.push_back(rope.sin(p, i));
      }
    rope_cos_ = upload_floats(cos);
    rope_sin_ = upload_floats(sin);
  }

  // Rows (new tokens) and sequences of one step, and the attention launch's bounds.
  struct StepShape {
    std::int64_t rows = 0, count = 0;  // count: entries, padding included
    std::int64_t sequences = 0;        // the batch's entries
    // rows of logits (and of choices): each entry's logit_rows, padding included (a graphed
    // decode step's: count); answers: the batch's own, which the caller gets
    std::int64_t outputs = 0, answers = 0;
    std::int32_t max_keys = 0, max_queries = 0;
    bool choosing = false;  // the device picks the tokens (forward was given choices)
  };

  // One entry's new tokens, their positions and the slots their K/V go to (walking its extents;
  // the spare slot for an entry that does not write K/V).
  void stage_new_tokens(const kvlab::BatchEntry& e) {
    std::int64_t position = e.view.first_position;
    std::size_t j = 0;
    for (const kvlab::KvExtent& extent : e.view.extents) {
      for (; j < e.tokens.size(); ++j) {
        const std::int64_t p = e.start_position + static_cast<std::int64_t>(j);
        if (p >= position + extent.length) break;
        tokens_.push_back(e.tokens[j]);
        positions_.push_back(static_cast<std::int32_t>(p));
        new_slots_.push_back(e.writes_kv ? extent.start_slot + (p - position) : spare_slot_);
      }
      position += extent.length;
    }
    if (j != e.tokens.size())
      throw Error(fmt::format("cuda backend: position {} has no slot in its sequence's view",
                              e.start_position + static_cast<std::int64_t>(j)));
  }

  // The step's metadata (tokens, positions, each new token's slot, each sequence's block table
  // and AttentionEntry, each sequence's last row), staged and uploaded once.
  StepShape stage_step(std::span<const kvlab::BatchEntry> batch) {
    const kvlab::ModelConfig& c = config_;
    tokens_.clear();
    positions_.clear();
    new_slots_.clear();
    block_table_.clear();
    entries_.clear();
    prefill_entries_.clear();
    last_rows_.clear();
    std::int32_t max_keys = 0, max_queries = 0;
    for (const auto& e : batch) {
      kvlab::cuda::AttentionEntry a;
      a.first_row = static_cast<std::int32_t>(tokens_.size());
      a.queries = static_cast<std::int32_t>(e.tokens.size());
      a.start_position = static_cast<std::int32_t>(e.start_position);
      a.first_position = static_cast<std::int32_t>(e.view.first_position);
      const std::int64_t end = e.start_position + static_cast<std::int64_t>(e.tokens.size());
      if (end > c.max_position_embeddings)
        throw Error(fmt::format("position {} is beyond the context of {}", end - 1, c.name));
      const kvlab::cuda::BlockLayout layout = kvlab::cuda::block_layout(e.view);
      a.block_shift = layout.shift;
      a.lead = layout.lead;
      a.table_offset = static_cast<std::int64_t>(block_table_.size());
      kvlab::cuda::append_block_table(e.view, layout, block_table_);
      stage_new_tokens(e);
      for (std::int64_t r = e.logit_rows; r >= 1; --r)  // its last logit_rows, in position order
        last_rows_.push_back(
            static_cast<std::int32_t>(static_cast<std::int64_t>(tokens_.size()) - r));
      if (a.queries == 1) max_keys = std::max(max_keys, a.start_position - a.first_position + 1);
      max_queries = std::max(max_queries, a.queries);
      if (a.queries > 1) prefill_entries_.push_back(static_cast<std::int32_t>(entries_.size()));
      entries_.push_back(a);
    }
    StepShape step;
    step.rows = static_cast<std::int64_t>(tokens_.size());
    step.count = step.sequences = static_cast<std::int64_t>(batch.size());
    step.outputs = step.answers = static_cast<std::int64_t>(last_rows_.size());
    step.max_keys = max_keys;
    step.max_queries = max_queries;
    if (step.count > 65535)
      throw Error(fmt::format(
          "cuda backend: a step of {} sequences; attention takes at most 65,535 per launch",
          step.count));
    return step;
  }

  // A decode step whose tokens the device picks runs as a CUDA graph captured for its batch
  // bucket (graph_batch_bucket) and split bucket: the step is padded to the bucket with rows
  // that write K/V to the spare slot and whose attention entries have no query (every kernel
  // skips them; their rows' values are never read), and its decode grid covers a power of two
  // splits (empty splits return at once). False (nothing changed) when the step does not
  // qualify.
  bool pad_for_graph(StepShape& step) {
    const std::int64_t bucket = graph_batch_bucket(step.count);
    if (!step.choosing || step.max_queries != 1 || bucket == 0) return false;
    for (std::int64_t r = step.count; r < bucket; ++r) {
      kvlab::cuda::AttentionEntry padding;
      padding.first_row = static_cast<std::int32_t>(r);
      padding.queries = 0;
      entries_.push_back(padding);
      tokens_.push_back(0);
      positions_.push_back(0);
      new_slots_.push_back(spare_slot_);
      last_rows_.push_back(static_cast<std::int32_t>(r));
      step_choices_.push_back({});  // greedy
    }
    step.rows = step.count = step.outputs = bucket;
    const auto splits = static_cast<std::uint64_t>((step.max_keys + split_keys_ - 1) / split_keys_);
    step.max_keys = static_cast<std::int32_t>(std::bit_ceil(splits)) * split_keys_;
    return true;
  }

  // The step's metadata and token choices to the device. A buffer that must grow takes twice
  // what it needs, so graphs are not invalidated step after step.
  void upload_step(const StepShape& step) {
    to_device(tokens_, d_tokens_);
    to_device(positions_, d_positions_);
    to_device(new_slots_, d_new_slots_);
    to_device(block_table_, d_block_table_);
    to_device(entries_, d_entries_);
    to_device(last_rows_, d_last_rows_);
    to_device(prefill_entries_, d_prefill_entries_, false);  // graphs hold decodes only
    if (!step.choosing) return;
    to_device(step_choices_, d_choices_);
    grow(d_chosen_, static_cast<std::size_t>(step.outputs) * sizeof(std::int32_t));
    host_chosen_.resize(static_cast<std::size_t>(step.outputs) * sizeof(std::int32_t));
  }

  // The step's activations and attention workspace (buffers grow only).
  void grow_activations(const StepShape& step) {
    const kvlab::ModelConfig& c = config_;
    const std::size_t e = kvlab::cuda::dtype_bytes(dtype_);
    const std::int64_t rows = step.rows, count = step.count, dim = c.hidden_size, q_dim = c.q_dim(),
                       qkv_dim = q_dim + 2 * c.kv_dim(), ffn = c.intermediate_size;
    grow(x_, static_cast<std::size_t>(rows * dim) * sizeof(float));
    grow(normed_, static_cast<std::size_t>(rows * dim) * e);
    grow(qkv_, static_cast<std::size_t>(rows * qkv_dim) * e);
    grow(attention_, static_cast<std::size_t>(rows * q_dim) * e);
    grow(projected_, static_cast<std::size_t>(rows * dim) * e);
    grow(gate_up_, static_cast<std::size_t>(rows * 2 * ffn) * e);
    grow(hidden_, static_cast<std::size_t>(rows * ffn) * e);
    grow(last_, static_cast<std::size_t>(step.outputs * dim) * sizeof(float));
    grow(logits_, static_cast<std::size_t>(step.outputs * c.vocab_size) * sizeof(float));
    grow(workspace_,
         static_cast<std::size_t>(kvlab::cuda::attention_workspace_floats(
             count, c.num_attention_heads, c.head_dim, std::max(step.max_keys, 1), split_keys_)) *
             sizeof(float));
  }

  // Grows a buffer the forward reads or writes; if it moves, every captured graph is stale.
  void grow(DeviceBuffer& buffer, std::size_t bytes) {
    if (buffer.resize(bytes)) graphs_.clear();
  }

  // The forward's launches from the embedding to the logits (and the device's token choice).
  void compute(const StepShape& step) {
    const kvlab::ModelConfig& c = config_;
    check(kvlab::cuda::launch_embedding(
              {d_tokens_.get<std::int32_t>(), embedding_.get(), x_.get<float>(), step.rows,
               c.hidden_size, c.vocab_size, dtype_},
              stream_),
          "embedding");
    check(kvlab::cuda::launch_rms_norm(
              {x_.get<float>(), c.hidden_size, layers_.front().attention_norm.get<float>(),
               normed_.get(), step.rows, c.hidden_size, static_cast<float>(c.rms_norm_eps), dtype_},
              stream_),
          "rms_norm");
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) run_layer(l, step);
    final_logits(step.outputs);
    if (step.choosing)
      check(kvlab::cuda::launch_sample_rows(logits_.get<float>(), step.outputs, c.vocab_size,
                                            d_choices_.get<kvlab::cuda::RowSampling>(),
                                            d_chosen_.get<std::int32_t>(), stream_),
            "sample");
  }

  // The log-probabilities the step's choices ask for (TokenChoice::logprobs >= 0), from the
  // logits and the chosen tokens still on the device: (sequences, 1 + K) entries, K the most
  // asked. Nothing when none asks.
  void compute_logprobs(const StepShape& step) {
    const std::int32_t most =
        *std::max_element(step_logprob_counts_.begin(), step_logprob_counts_.end());
    logprob_width_ = most < 0 ? 0 : 1 + most;
    if (logprob_width_ == 0) return;
    to_device(step_logprob_counts_, d_logprob_counts_, false);
    const auto entries = static_cast<std::size_t>(step.answers * logprob_width_);
    if (d_logprobs_.bytes() < entries * sizeof(kvlab::cuda::LogprobEntry))
      d_logprobs_.resize(2 * entries * sizeof(kvlab::cuda::LogprobEntry));
    check(kvlab::cuda::launch_row_logprobs(logits_.get<float>(), step.answers, config_.vocab_size,
                                           d_chosen_.get<std::int32_t>(),
                                           d_logprob_counts_.get<std::int32_t>(), logprob_width_,
                                           d_logprobs_.get<kvlab::cuda::LogprobEntry>(), stream_),
          "logprobs");
  }

  // Launches the graph captured for this step's (batch, split) bucket, capturing it first if
  // there is none. False when capture fails: graphs are then off for this backend (said once on
  // stderr) and the caller launches the step directly; nothing ran meanwhile.
  bool replay_graph(const StepShape& step) {
    const auto key = std::pair{step.count, step.max_keys};
    auto found = graphs_.find(key);
    if (found == graphs_.end()) {
      cudaGraphExec_t exec = capture_graph(step);
      if (exec == nullptr) return false;
      found = graphs_.emplace(key, GraphExec(exec)).first;
      ++graph_captures_;
    }
    check(cudaGraphLaunch(found->second.get(), stream_), "cudaGraphLaunch");
    ++graph_replays_;
    return true;
  }

  cudaGraphExec_t capture_graph(const StepShape& step) {
    cudaGraph_t graph = nullptr;
    std::string failure;
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      failure = "cudaStreamBeginCapture";
    } else {
      try {
        compute(step);
      } catch (const Error& e) {
        failure = e.what();
      }
      if (cudaStreamEndCapture(stream_, &graph) != cudaSuccess && failure.empty())
        failure = "cudaStreamEndCapture";
    }
    cudaGraphExec_t exec = nullptr;
    if (failure.empty() && cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
      failure = "cudaGraphInstantiate";
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (failure.empty()) return exec;
    (void)cudaGetLastError();  // the failed capture's error is not the next launch's
    graphs_enabled_ = false;
    graphs_.clear();
    std::fprintf(stderr, "kvlab: cuda backend: CUDA graph capture failed (%s); steps run without\n",
                 failure.c_str());
    return nullptr;
  }

  // One decoder layer over the step's rows, in place on the fp32 residual stream x_. normed_
  // holds the layer's attention-normed input (the previous layer's last launch); the layer ends
  // with its residual add fused into the next layer's attention norm.
  void run_layer(std::int64_t l, const StepShape& step) {
    const kvlab::ModelConfig& c = config_;
    const std::int64_t rows = step.rows, dim = c.hidden_size, q_dim = c.q_dim(),
                       kv_dim = c.kv_dim(), qkv_dim = q_dim + 2 * kv_dim, ffn = c.intermediate_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const DeviceLayer& layer = layers_[static_cast<std::size_t>(l)];
    char* qkv = qkv_.get<char>();
    gemm(normed_.get(), rows, dim, layer.w_qkv.get(), qkv_dim, qkv, cuda_type(dtype_));
    char* k_layer = k_pool_.get<char>() + static_cast<std::size_t>(l * layer_bytes_);
    char* v_layer = v_pool_.get<char>() + static_cast<std::size_t>(l * layer_bytes_);
    check(kvlab::cuda::launch_rope_kv_write(
              {qkv, qkv_dim, d_positions_.get<std::int32_t>(), rope_cos_.get<float>(),
               rope_sin_.get<float>(), d_new_slots_.get<std::int64_t>(), k_layer, v_layer, rows,
               c.num_attention_heads, c.num_key_value_heads, c.head_dim, dtype_, kv_format_},
              stream_),
          "rope + kv_write");
    attend(qkv, k_layer, v_layer, step);
    gemm(attention_.get(), rows, q_dim, layer.wo.get(), dim, projected_.get(), cuda_type(dtype_));
    check(kvlab::cuda::launch_add_rms_norm(
              {x_.get<float>(), projected_.get(), layer.mlp_norm.get<float>(), normed_.get(), rows,
               dim, eps, dtype_},
              stream_),
          "residual + rms_norm");
    gemm(normed_.get(), rows, dim, layer.w_gate_up.get(), 2 * ffn, gate_up_.get(),
         cuda_type(dtype_));
    check(kvlab::cuda::launch_swiglu({gate_up_.get(), hidden_.get(), rows, ffn, dtype_}, stream_),
          "swiglu");
    gemm(hidden_.get(), rows, ffn, layer.w_down.get(), dim, projected_.get(), cuda_type(dtype_));
    if (l + 1 == c.num_hidden_layers) {  // the final norm reads only each sequence's last row
      check(kvlab::cuda::launch_residual_add({x_.get<float>(), projected_.get(), rows, dim, dtype_},
                                             stream_),
            "residual");
      return;
    }
    check(kvlab::cuda::launch_add_rms_norm(
              {x_.get<float>(), projected_.get(),
               layers_[static_cast<std::size_t>(l + 1)].attention_norm.get<float>(), normed_.get(),
               rows, dim, eps, dtype_},
              stream_),
          "residual + rms_norm");
  }

  // Attention of the step's queries (rotated in qkv) over one layer's K/V pool.
  void attend(char* qkv, char* k_layer, char* v_layer, const StepShape& step) {
    const kvlab::ModelConfig& c = config_;
    kvlab::cuda::AttentionParams a;
    a.q = qkv;
    a.q_row_stride = c.q_dim() + 2 * c.kv_dim();
    a.k_pool = k_layer;
    a.v_pool = v_layer;
    a.block_table = d_block_table_.get<std::int64_t>();
    a.entries = d_entries_.get<kvlab::cuda::AttentionEntry>();
    a.entry_count = static_cast<std::int32_t>(step.count);
    a.max_keys = step.max_keys;
    a.max_queries = step.max_queries;
    a.prefill_entries = d_prefill_entries_.get<std::int32_t>();
    a.prefill_count = static_cast<std::int32_t>(prefill_entries_.size());
    a.out = attention_.get();
    a.heads = c.num_attention_heads;
    a.kv_heads = c.num_key_value_heads;
    a.head_dim = c.head_dim;
    a.window = window_;
    a.split_keys = split_keys_;
    a.workspace = workspace_.get<float>();
    a.dtype = dtype_;
    a.tensor_cores = tensor_cores_;
    a.kv_format = kv_format_;
    check(kvlab::cuda::launch_attention(a, stream_), "attention");
  }

  // Each entry's last row: final norm and LM head (fp32 logits).
  void final_logits(std::int64_t count) {
    const kvlab::ModelConfig& c = config_;
    const std::int64_t dim = c.hidden_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    check(kvlab::cuda::launch_gather_rows(x_.get<float>(), d_last_rows_.get<std::int32_t>(),
                                          last_.get<float>(), count, dim, stream_),
          "gather");
    check(kvlab::cuda::launch_rms_norm({last_.get<float>(), dim, final_norm_.get<float>(),
                                        normed_.get(), count, dim, eps, dtype_},
                                       stream_),
          "final norm");
    gemm(normed_.get(), count, dim, c.tie_word_embeddings ? embedding_.get() : lm_head_.get(),
         c.vocab_size, logits_.get(), CUDA_R_32F);
  }

  // The step's result to the host: each sequence's token when the device chose them
  // (given choices: 4 bytes per sequence, not 4 x vocab), else its logits.
  kvlab::ForwardResult read_out(const StepShape& step) {
    if (step.choosing) {
      const std::size_t id_bytes = static_cast<std::size_t>(step.answers) * sizeof(std::int32_t);
      check(cudaMemcpyAsync(host_chosen_.get<std::int32_t>(), d_chosen_.get(), id_bytes,
                            cudaMemcpyDeviceToHost, stream_),
            "download chosen tokens");
      std::vector<kvlab::cuda::LogprobEntry> logprobs(
          static_cast<std::size_t>(step.answers * logprob_width_));
      if (!logprobs.empty())
        check(cudaMemcpyAsync(logprobs.data(), d_logprobs_.get(),
                              logprobs.size() * sizeof(kvlab::cuda::LogprobEntry),
                              cudaMemcpyDeviceToHost, stream_),
              "download logprobs");
      check(cudaStreamSynchronize(stream_), "forward");
      for (const auto& [token, logprob] : logprobs) chosen_logprobs_.push_back({token, logprob});
      return kvlab::ForwardResult::of_tokens(
          {host_chosen_.get<std::int32_t>(), static_cast<std::size_t>(step.answers)},
          chosen_logprobs_, static_cast<std::size_t>(logprob_width_));
    }
    const std::int64_t values = step.answers * config_.vocab_size;
    const std::size_t logit_bytes = static_cast<std::size_t>(values) * sizeof(float);
    host_logits_.resize(logit_bytes);
    check(cudaMemcpyAsync(host_logits_.get<float>(), logits_.get(), logit_bytes,
                          cudaMemcpyDeviceToHost, stream_),
          "download logits");
    check(cudaStreamSynchronize(stream_), "forward");
    return kvlab::ForwardResult::of_logits(
        {host_logits_.get<float>(), static_cast<std::size_t>(values)});
  }

  // Pageable source: cudaMemcpyAsync has copied it out when it returns.
  // graphs_read_it: the buffer is one a captured graph reads (its moving makes them stale).
  template <typename T>
  void to_device(const std::vector<T>& values, DeviceBuffer& buffer, bool graphs_read_it = true) {
    const std::size_t bytes = values.size() * sizeof(T);
    if (bytes > buffer.bytes()) {
      if (graphs_read_it)
        grow(buffer, 2 * bytes);
      else
        buffer.resize(2 * bytes);
    }
    if (bytes == 0) return;
    check(cudaMemcpyAsync(buffer.get(), values.data(), bytes, cudaMemcpyHostToDevice, stream_),
          "upload step metadata");
  }

  // Y (rows, out) = X (rows, in) W^T, W (out, in) row-major: column-major Y^T = W^T^T X^T. On
  // cuBLASLt (lt_gemm.hpp), or cublasGemmEx (`gemm = "cublas"`, or a shape Lt has no algorithm
  // for); fp32 accumulation either way.
  void gemm(const void* x, std::int64_t rows, std::int64_t in, const void* w, std::int64_t out,
            void* y, cudaDataType_t y_type) {
    if (use_lt_) {
      const cublasStatus_t status =
          lt_.run({rows, in, out, cuda_type(dtype_), y_type}, x, w, y, stream_);
      if (status == CUBLAS_STATUS_SUCCESS) return;
      if (status != CUBLAS_STATUS_NOT_SUPPORTED) check(status, "cublasLtMatmul");
    }
    const float alpha = 1.0f, beta = 0.0f;
    check(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                       static_cast<int>(rows), static_cast<int>(in), &alpha, w, cuda_type(dtype_),
                       static_cast<int>(in), x, cuda_type(dtype_), static_cast<int>(in), &beta, y,
                       y_type, static_cast<int>(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  }

  // Host buffer (layers, 2 [K, V], slots, host_row_bytes) <-> the device pool's slots: one
  // gather (or scatter) launch over every layer, then one conversion to (from) fp32 for a pool in
  // the compute dtype, one copy.
  void transfer(const std::vector<std::int64_t>& slots, std::byte* host, bool to_host) {
    const auto n = static_cast<std::int64_t>(slots.size());
    if (n == 0) return;
    const auto packed_bytes =
        static_cast<std::size_t>(config_.num_hidden_layers * 2 * n * slot_row_bytes_);
    scratch_.resize(packed_bytes);
    to_device(slots, d_transfer_slots_, false);
    kvlab::cuda::SlotRowsParams rows;
    rows.k_pool = k_pool_.get();
    rows.v_pool = v_pool_.get();
    rows.layer_bytes = layer_bytes_;
    rows.layers = config_.num_hidden_layers;
    rows.slots = d_transfer_slots_.get<std::int64_t>();
    rows.count = n;
    rows.row_bytes = slot_row_bytes_;
    rows.packed = scratch_.get();
    if (kv_format_ != kvlab::cuda::KvFormat::compute) {
      transfer_bytes(rows, host, packed_bytes, to_host);
      return;
    }
    const std::int64_t elements = config_.num_hidden_layers * 2 * n * config_.kv_dim();
    const std::size_t float_bytes = static_cast<std::size_t>(elements) * sizeof(float);
    staging_floats_.resize(float_bytes);
    if (to_host) {
      check(kvlab::cuda::launch_copy_slot_rows(rows, stream_), "swap out");
      check(kvlab::cuda::launch_convert_to_f32(scratch_.get(), staging_floats_.get<float>(),
                                               elements, dtype_, stream_),
            "swap out");
      check(cudaMemcpyAsync(host, staging_floats_.get(), float_bytes, cudaMemcpyDeviceToHost,
                            stream_),
            "swap out");
      check(cudaStreamSynchronize(stream_), "swap out");
    } else {
      check(cudaMemcpyAsync(staging_floats_.get(), host, float_bytes, cudaMemcpyHostToDevice,
                            stream_),
            "swap in");
      check(kvlab::cuda::launch_convert_from_f32(staging_floats_.get<float>(), scratch_.get(),
                                                 elements, dtype_, stream_),
            "swap in");
      rows.to_pool = true;
      check(kvlab::cuda::launch_copy_slot_rows(rows, stream_), "swap in");
      check(cudaStreamSynchronize(stream_), "swap in");
    }
  }
  // A quantized pool's rows as they are: gather and copy out, or copy in and scatter.
  void transfer_bytes(kvlab::cuda::SlotRowsParams& rows, std::byte* host, std::size_t bytes,
                      bool to_host) {
    const char* what = to_host ? "swap out" : "swap in";
    if (to_host) {
      check(kvlab::cuda::launch_copy_slot_rows(rows, stream_), what);
      check(cudaMemcpyAsync(host, scratch_.get(), bytes, cudaMemcpyDeviceToHost, stream_), what);
    } else {
      check(cudaMemcpyAsync(scratch_.get(), host, bytes, cudaMemcpyHostToDevice, stream_), what);
      rows.to_pool = true;
      check(kvlab::cuda::launch_copy_slot_rows(rows, stream_), what);
    }
    check(cudaStreamSynchronize(stream_), what);
  }

  kvlab::KvPool* pool_;
  std::int64_t window_;
  kvlab::ModelConfig config_;
  Dtype dtype_ = Dtype::f32;
  std::int32_t split_keys_ = 256;
  bool tensor_cores_ = true;
  bool use_lt_ = true;  // GEMMs on cuBLASLt (gemm = "cublaslt")
  kvlab::cuda::LtGemm lt_;
  // CUDA graphs of decode steps, by (padded batch, max_keys of the split bucket); a buffer that
  // moves clears them (grow). graphs_enabled_ turns off for good if a capture fails.
  bool graphs_enabled_ = true;
  std::map<std::pair<std::int64_t, std::int32_t>, GraphExec> graphs_;
  std::int64_t graph_captures_ = 0, graph_replays_ = 0;
  std::int64_t spare_slot_ = 0;  // the pool's slot beyond the allocator's
  DeviceBuffer cublas_workspace_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer embedding_, lm_head_, final_norm_, rope_cos_, rope_sin_;
  std::vector<DeviceLayer> layers_;
  kvlab::cuda::KvFormat kv_format_ = kvlab::cuda::KvFormat::compute;
  std::int64_t slot_row_bytes_ = 0;  // kv_heads x kv_row_bytes: one slot of one layer, K or V
  std::int64_t layer_bytes_ = 0;     // (slots + 1) x slot_row_bytes_
  DeviceBuffer k_pool_, v_pool_;     // (layers, slots + 1, kv_heads, kv_row_bytes) each
  DeviceBuffer x_, normed_, qkv_, attention_, projected_, gate_up_, hidden_, last_, logits_,
      workspace_, scratch_, staging_floats_;
  DeviceBuffer d_tokens_, d_positions_, d_new_slots_, d_block_table_, d_entries_, d_last_rows_,
      d_prefill_entries_, d_transfer_slots_;
  PinnedBuffer host_logits_, host_chosen_;
  DeviceBuffer d_chosen_, d_choices_;
  // The running forward's token choices (empty: it returns logits).
  std::vector<kvlab::cuda::RowSampling> step_choices_;
  // Their log-probabilities: how many each choice asks for (-1: none), this forward's width
  // (1 + the most asked; 0: none) and the result on the host.
  std::vector<std::int32_t> step_logprob_counts_;
  std::int64_t logprob_width_ = 0;
  DeviceBuffer d_logprob_counts_, d_logprobs_;
  std::vector<kvlab::TokenLogprob> chosen_logprobs_;
  std::vector<std::int32_t> tokens_, positions_, last_rows_;
  std::vector<std::int32_t> prefill_entries_;  // indices into entries_ with more than one query
  std::vector<std::int64_t> new_slots_, block_table_;
  std::vector<kvlab::cuda::AttentionEntry> entries_;
};

const kvlab::ParamSpec kParams[] = {
    {"dtype", kvlab::ParamType::param_string,
     "weights, activations and KV cache: f32 or bf16 (fp32 accumulation either way)", "\"f32\"", 0,
     0},
    {"device", kvlab::ParamType::param_integer, "CUDA device index", "0", 0, 1024},
    {"split_keys", kvlab::ParamType::param_integer,
     "keys per split of decode attention (flash-decoding)", "256", 16, 1 << 20},
    {"gemm", kvlab::ParamType::param_string,
     "GEMM library: cublaslt (a plan per shape from its heuristic) or cublas (cublasGemmEx)",
     "\"cublaslt\"", 0, 0},
    {"cuda_graphs", kvlab::ParamType::param_boolean,
     "decode steps whose tokens the device picks replay a CUDA graph captured per batch-size "
     "bucket",
     "true", 0, 1},
    {"tensor_cores", kvlab::ParamType::param_boolean,
     "bf16 attention on tensor cores (mma.sync) where head_dim allows; false: CUDA cores", "true",
     0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::backend, CudaBackend, "cuda",
             "the LLaMA forward on an NVIDIA GPU: cuBLAS GEMMs, paged/extent attention kernels, "
             "device KV pool",
             kParams)
