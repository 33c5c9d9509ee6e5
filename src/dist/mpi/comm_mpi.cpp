// The MPI communicator (see dist/comm.h): MPI_COMM_WORLD with errors returned (MPI_ERRORS_RETURN) and turned into
// nopad::Error naming the call and the rank. MPI is initialised on first use and finalised at exit. Built only where
// CMake finds MPI (NOPAD_HAVE_MPI).
// The C API only: Open MPI and MPICH pull in their deprecated C++ bindings otherwise (and with them a link
// dependency on libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>

#include "core/error.h"
#include "dist/comm.h"

namespace nopad::dist {
namespace {

void check_mpi(int rc, const char* call, int rank) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail(call, " failed on rank ", rank, ": ", std::string(msg, static_cast<size_t>(len)),
       " (a peer process may have died; check the other ranks' logs)");
}

void finalize_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

// Element counts per call fit MPI's int; larger spans go in chunks.
constexpr size_t kMaxChunk = static_cast<size_t>(INT_MAX) / 2;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      NOPAD_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed (code ", rc, "): start the job with mpirun or srun");
      std::atexit(finalize_at_exit);
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_reduce_sum(std::span<float> d) override { reduce(d.data(), d.size(), MPI_FLOAT, MPI_SUM, "sum"); }
  void all_reduce_sum(std::span<double> d) override { reduce(d.data(), d.size(), MPI_DOUBLE, MPI_SUM, "sum"); }
  void all_reduce_sum(std::span<int64_t> d) override { reduce(d.data(), d.size(), MPI_INT64_T, MPI_SUM, "sum"); }
  void all_reduce_max(std::span<double> d) override { reduce(d.data(), d.size(), MPI_DOUBLE, MPI_MAX, "max"); }

  void all_gather(std::span<const uint8_t> send, std::span<uint8_t> recv) override {
    NOPAD_CHECK(recv.size() == send.size() * static_cast<size_t>(size_), "all_gather: receive buffer of ",
                recv.size(), " bytes for ", send.size(), " bytes from each of ", size_, " ranks");
    NOPAD_CHECK(send.size() <= kMaxChunk, "all_gather of ", send.size(), " bytes per rank: too large");
    check_mpi(MPI_Allgather(send.data(), static_cast<int>(send.size()), MPI_BYTE, recv.data(),
                            static_cast<int>(send.size()), MPI_BYTE, MPI_COMM_WORLD),
              "MPI_Allgather", rank_);
  }
  void broadcast(std::span<uint8_t> data, int root) override {
    NOPAD_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " outside [0, ", size_, ")");
    for (size_t at = 0; at < data.size(); at += kMaxChunk) {
      const size_t n = std::min(kMaxChunk, data.size() - at);
      check_mpi(MPI_Bcast(data.data() + at, static_cast<int>(n), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast", rank_);
    }
  }
  void all_to_all_v(std::span<const uint8_t> send, std::span<const size_t> send_bytes, std::vector<uint8_t>& recv,
                    std::vector<size_t>& recv_bytes) override {
    const size_t w = static_cast<size_t>(size_);
    NOPAD_CHECK(send_bytes.size() == w, "all_to_all_v: ", send_bytes.size(), " send counts for ", w, " ranks");
    NOPAD_CHECK(std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0}) == send.size(),
                "all_to_all_v: the send counts do not add up to the send buffer");
    std::vector<uint64_t> out(send_bytes.begin(), send_bytes.end()), in(w);
    check_mpi(MPI_Alltoall(out.data(), 1, MPI_UINT64_T, in.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD), "MPI_Alltoall",
              rank_);
    recv_bytes.assign(in.begin(), in.end());
    std::vector<int> sc(w), sd(w), rc(w), rd(w);
    size_t s_at = 0, r_at = 0;
    for (size_t r = 0; r < w; ++r) {
      NOPAD_CHECK(s_at + send_bytes[r] <= kMaxChunk && r_at + recv_bytes[r] <= kMaxChunk,
                  "all_to_all_v: more than ", kMaxChunk, " bytes in one exchange");
      sc[r] = static_cast<int>(send_bytes[r]);
      sd[r] = static_cast<int>(s_at);
      rc[r] = static_cast<int>(recv_bytes[r]);
      rd[r] = static_cast<int>(r_at);
      s_at += send_bytes[r];
      r_at += recv_bytes[r];
    }
    recv.resize(r_at);
    check_mpi(MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(), rc.data(), rd.data(), MPI_BYTE,
                            MPI_COMM_WORLD),
              "MPI_Alltoallv", rank_);
  }
  void barrier() override { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier", rank_); }
  [[noreturn]] void abort(int code, const std::string& why) override {
    std::fprintf(stderr, "nopad rank %d: %s\n", rank_, why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; in case it does
  }

 private:
  // Floating-point sums go to rank 0 and back (MPI_Reduce + MPI_Bcast) rather than through MPI_Allreduce, whose
  // algorithms (recursive doubling) may add in a different order on different ranks: data-parallel training needs
  // every rank to hold the same bits, or the ranks' weights drift apart. Integer sums and maxima are exact either way.
  void reduce(void* data, size_t count, MPI_Datatype type, MPI_Op op, const char* what) {
    int bytes = 0;
    MPI_Type_size(type, &bytes);
    const bool via_root = op == MPI_SUM && (type == MPI_FLOAT || type == MPI_DOUBLE);
    auto* p = static_cast<uint8_t*>(data);
    for (size_t at = 0; at < count; at += kMaxChunk) {
      const size_t n = std::min(kMaxChunk, count - at);
      uint8_t* chunk = p + at * static_cast<size_t>(bytes);
      if (via_root) {
        check_mpi(MPI_Reduce(rank_ == 0 ? MPI_IN_PLACE : chunk, chunk, static_cast<int>(n), type, op, 0,
                             MPI_COMM_WORLD),
                  "MPI_Reduce (sum)", rank_);
        check_mpi(MPI_Bcast(chunk, static_cast<int>(n), type, 0, MPI_COMM_WORLD), "MPI_Bcast (sum)", rank_);
      } else {
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, chunk, static_cast<int>(n), type, op, MPI_COMM_WORLD),
                  what[0] == 's' ? "MPI_Allreduce (sum)" : "MPI_Allreduce (max)", rank_);
      }
    }
  }
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool mpi_built() { return true; }

std::unique_ptr<Communicator> make_mpi_communicator(const RankInfo* expected) {
  auto comm = std::make_unique<MpiCommunicator>();
  if (expected != nullptr)
    NOPAD_CHECK(comm->rank() == expected->rank && comm->size() == expected->world_size, "MPI says rank ",
                comm->rank(), " of ", comm->size(), " but the launcher's environment says ", describe(*expected),
                ": start every process with the same launcher");
  return comm;
}

}  // namespace nopad::dist
