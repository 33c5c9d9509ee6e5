// Which process of a data-parallel job this is, read from the launcher's environment: mpirun (Open MPI, MPICH/PMI),
// Slurm's srun, or torchrun-style variables. One process per GPU; the GPU is chosen from the local rank.
//
// Contract: detect_rank_info() looks at, in this order, Open MPI (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK /
// _LOCAL_SIZE), MPICH / Intel MPI (PMI_RANK / PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS), Slurm (SLURM_PROCID /
// SLURM_NTASKS / SLURM_LOCALID, local size from SLURM_NTASKS_PER_NODE when it is one number), then torchrun
// (RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT). The first family whose rank and
// size are both set wins; none set means a single process. Values that are not integers, or a rank outside
// [0, size), are errors naming the variable and what to fix. A torchrun-style job needs MASTER_ADDR and
// MASTER_PORT (its bootstrap point) when WORLD_SIZE > 1. TORCHELASTIC_USE_AGENT_STORE (True/False, 1/0, any case)
// says whether MASTER_ADDR:MASTER_PORT is torchrun's own TCPStore (then the ranks meet through it, with
// TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT naming this job's attempt) or a port for rank 0 to listen on.
#pragma once
#include <functional>
#include <string>

namespace nopad::dist {

struct RankInfo {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_size = 1;  // within this node; local_size 0 when the launcher does not say
  std::string launcher = "single";     // "single", "mpi", "slurm" or "torchrun"
  std::string master_addr;             // torchrun: where rank 0 listens for the bootstrap, or the agent's store
  int master_port = 0;
  bool agent_store = false;            // torchrun: MASTER_ADDR:MASTER_PORT is the agent's TCPStore (not for listening)
  std::string run_id;                  // torchrun: TORCHELASTIC_RUN_ID ("none" when not set)
  int restart_count = 0;               // torchrun: TORCHELASTIC_RESTART_COUNT (the attempt)
  bool distributed() const { return world_size > 1; }
};

// An environment lookup: the variable's value, or nullptr when it is not set (std::getenv's contract).
using EnvLookup = std::function<const char*(const char*)>;

RankInfo detect_rank_info(const EnvLookup& env);
RankInfo detect_rank_info();  // from the process environment

// CPU threads for a process whose user chose none: the cores divided among the job's ranks on this node (a launcher
// starts one process per rank, and each taking every core oversubscribes the node), at least 1. A launcher that does
// not say how many ranks share the node counts as one.
int default_cpu_threads(const RankInfo& info, int cores);
int default_cpu_threads();  // for this process (its environment) and this machine's cores

// "rank 3 of 8 (local 1 of 4, mpi)": for logs.
std::string describe(const RankInfo& info);

}  // namespace nopad::dist
