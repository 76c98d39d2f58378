#include "mpi_sweep.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvlab/error.hpp"

#if KVLAB_HAVE_MPI
#include <mpi.h>
#endif

namespace kvlab::cli {
namespace {

// How many processes a launcher started this one among: Open MPI's mpirun, a PMI launcher
// (MPICH's, Slurm's PMI-2), or a Slurm job step (srun); 1 when none did.
long launched_processes() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const char* value = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(value, &end, 10);
      if (end != value && n > 1) return n;
    }
  return 1;
}

#if KVLAB_HAVE_MPI
constexpr int kCountTag = 1, kRecordTag = 2;
constexpr std::uint64_t kChunk = std::uint64_t{1} << 30;  // MPI counts are int: send in pieces

void send_bytes(const std::string& bytes, int tag) {
  const std::uint64_t size = bytes.size();
  MPI_Send(&size, 1, MPI_UINT64_T, 0, tag, MPI_COMM_WORLD);
  for (std::uint64_t at = 0; at < size; at += kChunk)
    MPI_Send(bytes.data() + at, static_cast<int>(std::min(kChunk, size - at)), MPI_BYTE, 0, tag,
             MPI_COMM_WORLD);
}

std::string receive_bytes(int from, int tag) {
  std::uint64_t size = 0;
  MPI_Recv(&size, 1, MPI_UINT64_T, from, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  std::string bytes(size, '\0');
  for (std::uint64_t at = 0; at < size; at += kChunk)
    MPI_Recv(bytes.data() + at, static_cast<int>(std::min(kChunk, size - at)), MPI_BYTE, from, tag,
             MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  return bytes;
}
#endif

}  // namespace

SweepRanks::SweepRanks() {
  const long processes = launched_processes();
#if KVLAB_HAVE_MPI
  if (processes > 1) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      MPI_Init(nullptr, nullptr);
      started_mpi_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
#else
  if (processes > 1)
    throw Error(fmt::format(
        "this process is one of {} started by a launcher (mpirun, srun), but kvlab was built "
        "without MPI: each would run the whole sweep into the same folder. Install "
        "libopenmpi-dev (scripts/setup.sh does) and rebuild, or run one process",
        processes));
#endif
}

SweepRanks::~SweepRanks() {
#if KVLAB_HAVE_MPI
  if (started_mpi_) MPI_Finalize();
#endif
}

bool SweepRanks::all(bool ok) const {
#if KVLAB_HAVE_MPI
  if (size_ > 1) {
    int mine = ok ? 1 : 0, every = 0;
    MPI_Allreduce(&mine, &every, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return every == 1;
  }
#endif
  return ok;
}

std::vector<RunRecord> SweepRanks::gather(std::vector<RunRecord> mine) const {
#if KVLAB_HAVE_MPI
  if (size_ > 1) {
    if (rank_ != 0) {
      send_bytes(std::to_string(mine.size()), kCountTag);
      for (const RunRecord& record : mine) send_bytes(encode_run_record(record), kRecordTag);
      return {};
    }
    for (int from = 1; from < size_; ++from) {
      const std::string count = receive_bytes(from, kCountTag);
      for (unsigned long i = 0, n = std::stoul(count); i < n; ++i)
        mine.push_back(decode_run_record(receive_bytes(from, kRecordTag)));
    }
  }
#endif
  return mine;
}

void SweepRanks::abort(int code) const {
#if KVLAB_HAVE_MPI
  if (size_ > 1) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::exit(code);
}

}  // namespace kvlab::cli
