// libFuzzer: config.json of a Hugging Face checkpoint (transformers 4 and 5 styles, RoPE
// parameters, token ids). A parsed config must also survive what kvlab computes from it.
#include <cstdint>

#include "fuzz_input_file.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model/kv_memory.hpp"
#include "kvlab/model_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kvlab::ModelConfig config =
        kvlab::parse_model_config(kvlab::fuzz::as_text(data, size), "fuzz.json");
    (void)config.parameter_count();
    (void)kvlab::forward_flops(config, 1, 1);
    (void)kvlab::rope_inverse_frequencies(config);
    kvlab::KvMemoryQuery query;
    query.seq_len = config.max_position_embeddings;
    (void)kvlab::kv_memory(config, query);
    (void)kvlab::parse_model_config(kvlab::model_config_to_json(config), "round trip");
  } catch (const kvlab::Error&) {
  }
  return 0;
}
