// Byte-level BPE encoding speed on 1 MB inputs: one letter repeated (a single pre-token piece of
// 1,048,576 bytes: the case that was quadratic) and real text. The tokenizer comes from
// KVLAB_BENCH_TOKENIZER (a .gguf file or a model folder; default: the SmolLM-shaped fixture),
// the text from KVLAB_BENCH_TEXT (default: the repository's prompt sets, repeated to 1 MB).
// tests/bench/compare_tokenizer_llamacpp.py sets both and times llama.cpp's llama-tokenize on
// the same files (docs/benchmarks.md).
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "kvlab/model/tokenizer.hpp"

namespace {

constexpr std::size_t kBytes = 1 << 20;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

const kvlab::Tokenizer& bench_tokenizer() {
  static const auto lookup = [] {
    const char* path = std::getenv("KVLAB_BENCH_TOKENIZER");
    return kvlab::find_tokenizer(path != nullptr ? path
                                                 : KVLAB_FIXTURES_DIR "/tokenizer/smollm.gguf");
  }();
  return *lookup.tokenizer;
}

std::string real_text() {
  const char* path = std::getenv("KVLAB_BENCH_TEXT");
  std::string text =
      read_text(path != nullptr ? path : KVLAB_DATA_DIR "/prompts/mt_bench_questions.jsonl");
  if (text.empty()) return std::string(kBytes, 'x');
  std::string out;
  while (out.size() < kBytes) out += text;
  out.resize(kBytes);
  while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back();
  if (!out.empty() && static_cast<unsigned char>(out.back()) >= 0xC0) out.pop_back();
  return out;
}

void encode(benchmark::State& state, const std::string& text) {
  const kvlab::Tokenizer& tokenizer = bench_tokenizer();
  std::size_t tokens = 0;
  for (auto _ : state) {
    const auto ids = tokenizer.encode(text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
}

void EncodeOneLetter(benchmark::State& state) {
  encode(state, std::string(kBytes, 'a'));
}
void EncodeRealText(benchmark::State& state) {
  static const std::string text = real_text();
  encode(state, text);
}

BENCHMARK(EncodeOneLetter)->Unit(benchmark::kMillisecond);
BENCHMARK(EncodeRealText)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
