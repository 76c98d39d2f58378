// WeightMatrix storage: formats, rounding from fp32 (quantize_blocks: llama.cpp's
// quantize_row_*_ref), widening back (gguf_dequantize), and the compute weights of a model. The
// product is in weight_matmul.cpp.
#include "kvlab/cpu_reference/weight_matrix.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "interleaved.hpp"
#include "kvlab/block_quant.hpp"
#include "kvlab/dtype.hpp"
#include "kvlab/error.hpp"
#include "kvlab/memory_limit.hpp"
#include "kvlab/model/gguf.hpp"
#include "kvlab/model/gguf_model.hpp"
#include "panels.hpp"
#include "parallel.hpp"

namespace kvlab::cpu {
namespace {

struct FormatInfo {
  WeightFormat format;
  std::string_view name;
  GgufTensorType gguf_type;
  std::int64_t block_values, block_bytes;
};
constexpr FormatInfo kFormats[] = {
    {WeightFormat::f32, "f32", GgufTensorType::f32, 1, 4},
    {WeightFormat::f16, "f16", GgufTensorType::f16, 1, 2},
    {WeightFormat::bf16, "bf16", GgufTensorType::bf16, 1, 2},
    {WeightFormat::q8_0, "q8_0", GgufTensorType::q8_0, 32, 34},
    {WeightFormat::q4_0, "q4_0", GgufTensorType::q4_0, 32, 18},
    {WeightFormat::q4_1, "q4_1", GgufTensorType::q4_1, 32, 20},
    {WeightFormat::q5_0, "q5_0", GgufTensorType::q5_0, 32, 22},
    {WeightFormat::q5_1, "q5_1", GgufTensorType::q5_1, 32, 24},
};

constexpr bool choices_follow_formats() {
  for (std::size_t i = 0; i < std::size(kFormats); ++i)
    if (kWeightChoices[i + 1] != kFormats[i].name || kFormats[i].format != WeightFormat(i))
      return false;
  return std::size(kFormats) + 1 == kWeightChoices.size();
}
static_assert(choices_follow_formats(), "kWeightChoices lists the formats in enum order");
static_assert(static_cast<int>(WeightFormat::q5_1) - static_cast<int>(WeightFormat::q8_0) ==
                  static_cast<int>(BlockFormat::q5_1),
              "the Q weight formats follow BlockFormat's order");

const FormatInfo& info(WeightFormat format) {
  return kFormats[static_cast<std::size_t>(format)];
}

void quantize_row(WeightFormat format, std::span<const float> x, std::byte* out) {
  switch (format) {
    case WeightFormat::f32:
    case WeightFormat::f16:
    case WeightFormat::bf16: {
      const DType dtype = panels::float_dtype(format);
      convert_from_f32(dtype, x, {out, x.size() * dtype_size(dtype)});
      return;
    }
    default:
      break;
  }
  const auto bytes = static_cast<std::size_t>(static_cast<std::int64_t>(x.size()) /
                                              info(format).block_values * info(format).block_bytes);
  // The Q formats in both enums' order: q8_0, q4_0, q4_1, q5_0, q5_1.
  const auto block =
      static_cast<BlockFormat>(static_cast<int>(format) - static_cast<int>(WeightFormat::q8_0));
  quantize_blocks(block, x, {out, bytes});
}

void check_columns(WeightFormat format, std::int64_t cols) {
  if (cols <= 0 || cols % weight_format_block_values(format) != 0)
    throw Error(fmt::format("a {} matrix needs a positive multiple of {} columns, not {}",
                            weight_format_name(format), weight_format_block_values(format), cols));
}

}  // namespace

std::string_view weight_format_name(WeightFormat format) {
  return info(format).name;
}

std::optional<WeightFormat> weight_format_of_gguf_type(std::uint32_t type) {
  for (const auto& f : kFormats)
    if (static_cast<std::uint32_t>(f.gguf_type) == type) return f.format;
  return std::nullopt;
}

std::int64_t weight_format_block_values(WeightFormat format) {
  return info(format).block_values;
}
std::int64_t weight_format_block_bytes(WeightFormat format) {
  return info(format).block_bytes;
}
std::int64_t weight_row_bytes(WeightFormat format, std::int64_t cols) {
  return cols / info(format).block_values * info(format).block_bytes;
}

WeightMatrix WeightMatrix::quantize(const WeightMatrixView& source, WeightFormat format) {
  check_columns(format, source.cols);
  WeightMatrix m;
  m.format_ = format;
  m.rows_ = source.rows;
  m.cols_ = source.cols;
  auto storage = std::make_shared<std::vector<std::byte>>(static_cast<std::size_t>(m.bytes()));
  const std::int64_t row_bytes = m.row_bytes();
  parallel_for(m.rows_, [&](std::int64_t r) {
    quantize_row(format, source.row(r), storage->data() + r * row_bytes);
  });
  m.data_ = storage->data();
  m.owned_ = std::move(storage);
  return m;
}

WeightMatrix WeightMatrix::view(const WeightMatrixView& source) {
  WeightMatrix m;
  m.rows_ = source.rows;
  m.cols_ = source.cols;
  m.data_ = reinterpret_cast<const std::byte*>(source.data);
  return m;
}

WeightMatrix WeightMatrix::from_bytes(WeightFormat format, std::int64_t rows, std::int64_t cols,
                                      std::span<const std::byte> bytes) {
  check_columns(format, cols);
  if (rows < 0 || static_cast<std::int64_t>(bytes.size()) != rows * weight_row_bytes(format, cols))
    throw Error(fmt::format("{} bytes are not {} rows of {} {} values", bytes.size(), rows, cols,
                            weight_format_name(format)));
  WeightMatrix m;
  m.format_ = format;
  m.rows_ = rows;
  m.cols_ = cols;
  auto storage = std::make_shared<std::vector<std::byte>>(bytes.begin(), bytes.end());
  m.data_ = storage->data();
  m.owned_ = std::move(storage);
  return m;
}

WeightMatrix WeightMatrix::stack(std::span<const WeightMatrix> parts) {
  if (parts.empty()) return {};
  WeightMatrix m;
  m.format_ = parts[0].format_;
  m.cols_ = parts[0].cols_;
  auto storage = std::make_shared<std::vector<std::byte>>();
  for (const auto& part : parts) {
    if (part.format_ != m.format_ || part.cols_ != m.cols_ || part.layout_ != WeightLayout::rows)
      throw Error("internal: stacked weight matrices differ in format or columns");
    storage->insert(storage->end(), part.data_, part.data_ + part.bytes());
    m.rows_ += part.rows_;
  }
  m.data_ = storage->data();
  m.owned_ = std::move(storage);
  return m;
}

WeightMatrix WeightMatrix::widened_to_q8_0() const {
  if ((format_ != WeightFormat::q4_0 && format_ != WeightFormat::q5_0) ||
      layout_ != WeightLayout::rows)
    throw Error(fmt::format("internal: a {} matrix is not widened to Q8_0 exactly",
                            weight_format_name(format_)));
  const auto block =
      static_cast<BlockFormat>(static_cast<int>(format_) - static_cast<int>(WeightFormat::q8_0));
  const std::size_t in_bytes = block_bytes(block), out_bytes = block_bytes(BlockFormat::q8_0);
  const auto blocks = static_cast<std::size_t>(rows_ * cols_) / kBlockValues;
  std::vector<std::byte> out(blocks * out_bytes);
  float values[kBlockValues];
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::byte* in = data_ + b * in_bytes;
    std::byte* q8 = out.data() + b * out_bytes;
    dequantize_blocks(block, {in, in_bytes}, values);  // d (q - offset), exact in fp32
    const float d = block_field::f16(in);
    std::memcpy(q8, in, 2);  // the same fp16 scale
    for (std::size_t i = 0; i < kBlockValues; ++i) {
      const float q = values[i] / d;  // an integer in [-16, 15] (0 / 0 for d = 0: 0)
      q8[2 + i] =
          static_cast<std::byte>(static_cast<std::int8_t>(std::isfinite(q) ? std::lrint(q) : 0));
    }
  }
  return from_bytes(WeightFormat::q8_0, rows_, cols_, out);
}

std::int64_t WeightMatrix::bytes() const {
  if (layout_ == WeightLayout::rows) return rows_ * row_bytes();
  if (layout_ == WeightLayout::panels)
    return panels::panel_count(rows_) * panels::kPanelRows * cols_ *
           weight_format_block_bytes(format_);
  if (format_ == WeightFormat::bf16) return bf16::group_count(rows_) * bf16::kGroupRows * cols_ * 2;
  return q8::group_count(rows_) * (cols_ / q8::kBlockValues) *
         q8::group_block_layout(format_).bytes;
}

WeightMatrix WeightMatrix::packed_for(ActivationFormat activations) const {
  const bool q = weight_format_block_values(format_) == 32;
  const bool q8_kernel = format_ == WeightFormat::q8_0 || format_ == WeightFormat::q4_0 ||
                         format_ == WeightFormat::q4_1;  // Q5 rows keep fp32 activations
  if (layout_ != WeightLayout::rows) return *this;
  WeightMatrix m = *this;
  std::vector<std::byte> bytes;
  if (activations == ActivationFormat::q8 && q8_kernel) {
    bytes = q8::interleave(*this);
    m.layout_ = WeightLayout::interleaved;
  } else if (activations == ActivationFormat::bf16 && format_ == WeightFormat::bf16 &&
             cols_ % 4 == 0) {
    bytes = bf16::interleave(*this);
    m.layout_ = WeightLayout::interleaved;
  } else if (!q) {
    bytes = panels::pack(*this);
    m.layout_ = WeightLayout::panels;
  } else {
    return *this;
  }
  auto storage = std::make_shared<std::vector<std::byte>>(std::move(bytes));
  m.data_ = storage->data();
  m.owned_ = std::move(storage);
  return m;
}

void WeightMatrix::dequantize_rows(std::int64_t first, std::int64_t count, float* out) const {
  if (layout_ == WeightLayout::panels)
    return panels::dequantize_panel_rows(*this, first, count, out);
  if (interleaved() && format_ == WeightFormat::bf16)
    return bf16::dequantize_interleaved_rows(*this, first, count, out);
  if (interleaved()) return q8::dequantize_interleaved_rows(*this, first, count, out);
  const auto values = static_cast<std::size_t>(count * cols_);
  gguf_dequantize(static_cast<std::uint32_t>(info(format_).gguf_type),
                  {row(first), static_cast<std::size_t>(count * row_bytes())}, {out, values});
}

RowMatrix WeightMatrix::dequantize() const {
  RowMatrix out(rows_, cols_);
  dequantize_rows(0, rows_, out.data());
  return out;
}

std::int64_t ComputeWeights::bytes() const {
  std::int64_t total = output_projection.bytes();
  for (const auto& l : layers)
    total += l.w_qkv.bytes() + l.wo.bytes() + l.w_gate_up.bytes() + l.w_down.bytes();
  return total;
}

ComputeWeights compute_weights(const ModelWeightsView& weights, WeightFormat format) {
  // A matrix whose rows are not whole blocks of `format` stays f32 (as llama.cpp's quantizer
  // leaves such tensors in a wider type).
  std::int64_t kept = 0;
  auto convert = [&](const WeightMatrixView& m) {
    if (format == WeightFormat::f32 || m.cols % weight_format_block_values(format) != 0) {
      kept += format != WeightFormat::f32;
      return WeightMatrix::view(m);
    }
    return WeightMatrix::quantize(m, format);
  };
  ComputeWeights out;
  for (const auto& l : weights.layers)
    out.layers.push_back(
        {convert(l.w_qkv), convert(l.wo), convert(l.w_gate_up), convert(l.w_down)});
  out.output_projection = convert(weights.output_projection);
  out.description = std::string(weight_format_name(format));
  if (kept > 0)
    out.description += fmt::format(" ({} matrices kept f32: rows not whole {}-value blocks)", kept,
                                   weight_format_block_values(format));
  return out;
}

namespace {

// Tensor `hf_name` of `file` as stored (rows in Hugging Face order); nullopt when its type has
// no WeightFormat.
std::optional<WeightMatrix> stored_matrix(const GgufFile& file, const ModelConfig& config,
                                          const std::string& hf_name) {
  const auto name = gguf_tensor_name(hf_name, config.post_norms);
  const GgufTensorInfo* tensor = name ? file.find_tensor(*name) : nullptr;
  if (tensor == nullptr)
    throw Error(fmt::format("GGUF model {} has no tensor {} (for {})", file.path().string(),
                            name.value_or("?"), hf_name));
  const auto format = weight_format_of_gguf_type(tensor->type);
  const auto shape = tensor->row_major_shape();
  if (!format || shape.size() != 2) return std::nullopt;
  const std::span<const std::byte> bytes = file.bytes(*tensor);
  const bool permuted = !config.is_gemma3();  // Gemma's Q and K rows are stored as they are
  const bool is_q = permuted && hf_name.ends_with("q_proj.weight"),
             is_k = permuted && hf_name.ends_with("k_proj.weight");
  if (!is_q && !is_k) return WeightMatrix::from_bytes(*format, shape[0], shape[1], bytes);
  // Undo llama.cpp's permute(): GGUF row h*hd + 2i + j holds Hugging Face row h*hd + j*hd/2 + i.
  const std::int64_t hd = config.head_dim, half = hd / 2;
  const std::int64_t row_bytes = weight_row_bytes(*format, shape[1]);
  std::vector<std::byte> reordered(bytes.size());
  for (std::int64_t r = 0; r < shape[0]; ++r) {
    const std::int64_t h = r / hd, i = (r % hd) % half, j = (r % hd) / half;
    std::memcpy(reordered.data() + r * row_bytes, bytes.data() + (h * hd + 2 * i + j) * row_bytes,
                static_cast<std::size_t>(row_bytes));
  }
  return WeightMatrix::from_bytes(*format, shape[0], shape[1], reordered);
}

// Parts of one stack stored as Q8_0 and as Q4_0 or Q5_0 (Gemma 3's Q4_K_M file: q and k Q5_0, v
// Q8_0 in half its layers): the narrower ones widened to Q8_0, exactly. Returns how many.
std::int64_t widen_beside_q8_0(std::vector<WeightMatrix>& parts) {
  const auto q8 = [](const WeightMatrix& m) { return m.format() == WeightFormat::q8_0; };
  const auto narrow = [](const WeightMatrix& m) {
    return m.format() == WeightFormat::q4_0 || m.format() == WeightFormat::q5_0;
  };
  if (std::none_of(parts.begin(), parts.end(), q8) ||
      !std::all_of(parts.begin(), parts.end(),
                   [&](const WeightMatrix& m) { return q8(m) || narrow(m); }))
    return 0;
  std::int64_t widened = 0;
  for (WeightMatrix& m : parts)
    if (narrow(m)) {
      m = m.widened_to_q8_0();
      ++widened;
    }
  return widened;
}

}  // namespace

ComputeWeights gguf_compute_weights(const std::filesystem::path& gguf_path,
                                    const ModelWeightsView& weights) {
  const GgufFile file = GgufFile::open(gguf_path);
  ModelConfig config = gguf_model_config(file);
  // (a view of the file's first layers, a self-speculative draft's, reads them as stored)
  if (config.hidden_size != weights.config.hidden_size ||
      config.num_hidden_layers < weights.config.num_hidden_layers ||
      config.vocab_size != weights.config.vocab_size)
    throw Error(fmt::format("internal: the weights given are not those of {}", gguf_path.string()));
  std::vector<std::string> formats, converted;
  std::int64_t widened = 0;
  auto note = [&](const WeightMatrix& m) {
    const std::string name(weight_format_name(m.format()));
    if (std::find(formats.begin(), formats.end(), name) == formats.end()) formats.push_back(name);
    return m;
  };
  // The stack of `hf_names` as stored, or `fallback` (the fp32 values) multiplied as they are.
  auto matrix = [&](std::initializer_list<std::string> hf_names, const WeightMatrixView& fallback) {
    std::vector<WeightMatrix> parts;
    std::int64_t rows = 0;
    for (const auto& n : hf_names) {
      auto part = stored_matrix(file, config, n);
      if (!part) break;
      rows += part->rows();
      parts.push_back(std::move(*part));
    }
    widened += widen_beside_q8_0(parts);
    if (std::any_of(parts.begin(), parts.end(),
                    [&](const WeightMatrix& m) { return m.format() != parts[0].format(); }))
      parts.clear();
    // Every part stored in one fast format, and together the shape of the served matrix (K/V
    // heads converted by an attention variant are not what the file holds).
    if (parts.size() == hf_names.size() && rows == fallback.rows &&
        parts[0].cols() == fallback.cols)
      return note(parts.size() == 1 ? parts[0] : WeightMatrix::stack(parts));
    converted.push_back(*hf_names.begin());
    return note(WeightMatrix::view(fallback));  // the fp32 values the reference uses
  };
  ComputeWeights out;
  for (std::size_t l = 0; l < weights.layers.size(); ++l) {
    const LayerWeightsView& w = weights.layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    out.layers.push_back({
        matrix({p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight"},
               w.w_qkv),
        matrix({p + "self_attn.o_proj.weight"}, w.wo),
        matrix({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, w.w_gate_up),
        matrix({p + "mlp.down_proj.weight"}, w.w_down),
    });
  }
  out.output_projection =
      matrix({config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"},
             weights.output_projection);
  out.description = fmt::format("gguf native ({})", fmt::join(formats, ", "));
  if (widened > 0)
    out.description +=
        fmt::format("; {} Q4_0/Q5_0 parts widened to Q8_0 beside Q8_0 ones (exact)", widened);
  if (!converted.empty())
    out.description += fmt::format(
        "; {} matrices multiplied in fp32 (stored in a type without a kernel, stacked with "
        "another type, or K/V heads converted)",
        converted.size());
  return out;
}

ComputeWeights with_activations(ComputeWeights weights, ActivationFormat activations,
                                std::optional<std::uint64_t> memory_bytes) {
  std::vector<WeightMatrix*> matrices{&weights.output_projection};
  for (auto& l : weights.layers)
    for (WeightMatrix* m : {&l.w_qkv, &l.wo, &l.w_gate_up, &l.w_down}) matrices.push_back(m);
  std::uint64_t view_bytes = 0;
  for (const WeightMatrix* m : matrices)
    if (m->is_view()) view_bytes += static_cast<std::uint64_t>(m->bytes());
  const bool pack_views = 2 * view_bytes <= memory_bytes.value_or(allocatable_bytes());
  std::int64_t interleaved = 0, kept_views = 0;
  for (WeightMatrix* m : matrices) {
    if (m->is_view() && !pack_views) {
      ++kept_views;
      continue;
    }
    *m = m->packed_for(activations);
    interleaved += m->interleaved();
  }
  weights.activations = activations;
  if (activations != ActivationFormat::f32)
    weights.description +=
        fmt::format(", {} activations ({} matrices)",
                    activations == ActivationFormat::q8 ? "8-bit" : "bf16", interleaved);
  if (kept_views > 0)
    weights.description += fmt::format(
        "; {} fp32 matrices multiplied as row-major views (no memory for packed copies beside "
        "the reference's values)",
        kept_views);
  return weights;
}

ComputeWeights select_compute_weights(const ModelWeightsView& weights,
                                      std::optional<WeightFormat> format,
                                      ActivationFormat activations) {
  const std::filesystem::path source(weights.source);
  ComputeWeights out = format ? compute_weights(weights, *format)
                       : source.extension() == ".gguf"
                           ? gguf_compute_weights(source, weights)
                           : compute_weights(weights, WeightFormat::f32);
  return with_activations(std::move(out), activations);
}

ComputeWeights select_compute_weights(const ModelWeightsView& weights, std::string_view choice,
                                      std::string_view activations) {
  const auto activation_format = activation_format_from_name(activations);
  if (!activation_format)
    throw Error(fmt::format("unknown activation format \"{}\": {}", activations,
                            fmt::join(kActivationChoices, ", ")));
  const auto format = weight_format_from_name(choice);
  if (!format && choice != "stored")
    throw Error(
        fmt::format("unknown weight format \"{}\": {} (stored: a GGUF file's own types, "
                    "f32 otherwise)",
                    choice, fmt::join(kWeightChoices, ", ")));
  return select_compute_weights(weights, format, *activation_format);
}

}  // namespace kvlab::cpu
