// The communicator data-parallel training talks through: host-memory collectives over MPI (CPU training, and the
// bootstrap of a GPU job), or a single process. The GPU's gradient all-reduce goes over NCCL (ops/cuda), bootstrapped
// through this interface (broadcast of the NCCL id).
//
// Contract:
//  - Every collective is called by every rank of the communicator, in the same order, with the same counts (except
//    where a call says otherwise); it returns when this rank's part is complete. Sums are element-wise, and every
//    rank receives the same bits (so data-parallel replicas of the weights stay identical); the order in which the
//    ranks' values are added is fixed, so a rerun with the same inputs gives the same bits.
//  - Errors (a peer gone, a transport failure) throw nopad::Error naming the operation and the rank; abort() ends
//    the whole job (every rank) with a message, for failures a rank cannot recover from alone.
//  - check_same_on_all_ranks() is how a job refuses to start when ranks disagree on what they run (config, data).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dist/launch.h"

namespace nopad::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "single", "mpi" or "tcp"

  virtual void all_reduce_sum(std::span<float> data) = 0;
  virtual void all_reduce_sum(std::span<double> data) = 0;
  virtual void all_reduce_sum(std::span<int64_t> data) = 0;
  virtual void all_reduce_max(std::span<double> data) = 0;
  // recv (size() * send.size() bytes) receives every rank's send, in rank order.
  virtual void all_gather(std::span<const uint8_t> send, std::span<uint8_t> recv) = 0;
  virtual void broadcast(std::span<uint8_t> data, int root) = 0;
  // Personalised exchange: send holds the bytes for rank 0, then rank 1, ... (send_bytes[r] each; send_bytes has
  // size() entries, the counts may differ per rank and per peer). recv is resized to the total received, in source
  // rank order, recv_bytes[r] = bytes from rank r.
  virtual void all_to_all_v(std::span<const uint8_t> send, std::span<const size_t> send_bytes,
                            std::vector<uint8_t>& recv, std::vector<size_t>& recv_bytes) = 0;
  virtual void barrier() = 0;
  // Ends the job on every rank after printing `why` (prefixed with this rank) to stderr.
  [[noreturn]] virtual void abort(int code, const std::string& why) = 0;
};

// One process: collectives are copies or no-ops.
std::unique_ptr<Communicator> make_single_communicator();

// True when this build has MPI (CMake found it: NOPAD_HAVE_MPI).
bool mpi_built();
// MPI_COMM_WORLD, initialising MPI on first use (finalised at exit). Throws naming what to do when the build has no
// MPI or MPI cannot start. The rank and size must match `expected` (what the launcher's environment said) when given.
std::unique_ptr<Communicator> make_mpi_communicator(const RankInfo* expected = nullptr);

// A torchrun-style job's host communicator over TCP (comm_tcp.cpp): rank 0 listens on info.master_port, the others
// connect to info.master_addr (retrying for up to timeout_s seconds); with info.agent_store (torchrun's own TCPStore
// at master_addr:master_port) rank 0 listens on a free port and the ranks find it through the store. Collectives go
// through rank 0 in rank order.
std::unique_ptr<Communicator> make_tcp_communicator(const RankInfo& info, double timeout_s);

// For a job launched as `info` says: single process -> make_single_communicator(); mpirun/srun -> MPI; torchrun ->
// TCP (bootstrap timeout NOPAD_BOOTSTRAP_TIMEOUT_S, 300 s by default).
std::unique_ptr<Communicator> make_communicator(const RankInfo& info);

// Every rank's `value`, indexed by rank (collective).
std::vector<uint64_t> all_gather_u64(Communicator& comm, uint64_t value);

// All-gathers `value` and throws, naming `what` and the ranks whose value differs from rank 0's, unless all are
// equal (e.g. a hash of the config and the data every rank loaded).
void check_same_on_all_ranks(Communicator& comm, uint64_t value, const std::string& what);

// 64-bit FNV-1a of bytes (for check_same_on_all_ranks).
uint64_t hash_bytes(std::span<const uint8_t> bytes, uint64_t seed = 0xcbf29ce484222325ull);
uint64_t hash_string(const std::string& s, uint64_t seed = 0xcbf29ce484222325ull);

// Moves samples between ranks for a balancing plan when each rank holds a different part of the data: each of this
// rank's samples (ids[i], the bytes payload[offsets[i] .. offsets[i+1])) goes to rank dest[i]; returns, sorted by id,
// the ids this rank receives and their payloads (recv_offsets: [received + 1]). One all_to_all_v; every sample
// arrives exactly once, at its destination.
struct SampleExchange {
  std::vector<uint64_t> ids;
  std::vector<uint8_t> payload;
  std::vector<size_t> offsets;  // [ids.size() + 1]
};
SampleExchange exchange_samples(Communicator& comm, std::span<const uint64_t> ids, std::span<const int32_t> dest,
                                std::span<const uint8_t> payload, std::span<const size_t> offsets);

}  // namespace nopad::dist
