// libFuzzer: run records, the bytes an MPI rank sends rank 0 for each run of its share. A record
// decodes or is a kvlab::Error; one that decodes re-encodes to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kvlab/error.hpp"
#include "kvlab/experiment/distributed_sweep.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    const kvlab::RunRecord record = kvlab::decode_run_record(bytes);
    const kvlab::RunRecord again = kvlab::decode_run_record(kvlab::encode_run_record(record));
    if (again.files != record.files || again.index != record.index || again.error != record.error)
      std::abort();
  } catch (const kvlab::Error&) {
  }
  return 0;
}
