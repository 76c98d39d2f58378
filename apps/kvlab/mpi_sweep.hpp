#pragma once
// The processes of `mpirun -n N kvlab run FILE` (or `srun kvlab run FILE` under Slurm): each
// rank runs its share of the sweep (balance_runs) and sends its runs' outcomes to rank 0, which
// writes the results folder. MPI starts only when a launcher started this process as one of
// several (its environment says so); otherwise there is one rank and no MPI. Built without MPI
// (no libopenmpi-dev), kvlab refuses to run as one of several processes instead of letting each
// run the whole sweep into the same folder.
#include <vector>

#include "kvlab/experiment/distributed_sweep.hpp"

namespace kvlab::cli {

class SweepRanks {
 public:
  SweepRanks();   // MPI_Init when launched as one of several processes
  ~SweepRanks();  // MPI_Finalize
  SweepRanks(const SweepRanks&) = delete;
  SweepRanks& operator=(const SweepRanks&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // True on every rank when `ok` is true on every rank (a collective: every rank calls it).
  bool all(bool ok) const;
  // Rank 0 returns every rank's records (its own first); the others send theirs, return {}.
  std::vector<RunRecord> gather(std::vector<RunRecord> mine) const;
  // Ends every rank of the job (an error that leaves the others waiting).
  [[noreturn]] void abort(int code) const;

 private:
  int rank_ = 0, size_ = 1;
  bool started_mpi_ = false;
};

}  // namespace kvlab::cli
