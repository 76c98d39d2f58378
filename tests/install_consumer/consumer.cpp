// Uses kvlab::core and kvlab::cpu_reference through the installed headers and libraries.
#include <cstdio>

#include "kvlab/cpu_reference/reference_model.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/model_config.hpp"

int main() {
  const kvlab::ModelConfig config = kvlab::model_preset("tiny");
  kvlab::cpu::ReferenceModel model(kvlab::cpu::random_llama_weights(config, 7));
  const std::int32_t prompt[] = {1, 2, 3};
  const auto logits = model.forward(prompt);
  const auto memory = kvlab::kv_memory(kvlab::model_preset("llama-7b"), {.seq_len = 2048});
  std::printf("logits %ldx%ld, llama-7b KV per request %lld bytes\n",
              static_cast<long>(logits.rows()), static_cast<long>(logits.cols()),
              static_cast<long long>(memory.bytes_per_request));
  return logits.cols() == config.vocab_size && memory.bytes_per_request == (1LL << 30) ? 0 : 1;
}
