// NcclComm over NCCL (nccl_comm.h). Without NCCL in the build, make_nccl_comm throws with what to do.
#include "ops/cuda/nccl_comm.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>

#include "core/error.h"
#include "ops/cuda/check.h"

#ifdef NOPAD_HAVE_NCCL
#include <nccl.h>
#endif

namespace nopad::cuda {

#ifdef NOPAD_HAVE_NCCL

namespace {

[[noreturn]] void throw_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  fail("NCCL error in ", call, " at ", file, ":", line, ": ", ncclGetErrorString(r),
       last && *last ? std::string(" (") + last + ")" : std::string());
}
#define NOPAD_NCCL_CHECK(call)                                              \
  do {                                                                      \
    const ncclResult_t nopad_nccl_r_ = (call);                              \
    if (nopad_nccl_r_ != ncclSuccess) throw_nccl(nopad_nccl_r_, #call, __FILE__, __LINE__); \
  } while (0)

class Nccl final : public NcclComm {
 public:
  Nccl(dist::Communicator& host, int max_ctas) : rank_(host.rank()), size_(host.size()) {
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (rank_ == 0) NOPAD_NCCL_CHECK(ncclGetUniqueId(&id));
    host.broadcast(std::span<uint8_t>(reinterpret_cast<uint8_t*>(&id), sizeof id), 0);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    if (max_ctas > 0) {
      config.minCTAs = 1;
      config.maxCTAs = max_ctas;
    }
    NOPAD_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config));
  }
  ~Nccl() override {
    // No throwing while tearing down; an aborted communicator is already gone.
    if (comm_ && !aborted_) (void)ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* data, size_t count, CUstream_st* stream) override {
    NOPAD_CHECK(!aborted_, "NCCL communicator of rank ", rank_, " was aborted after an earlier error");
    if (count == 0) return;
    NOPAD_NCCL_CHECK(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream));
  }
  void all_reduce_sum_bf16(void* data, size_t count, CUstream_st* stream) override {
    NOPAD_CHECK(!aborted_, "NCCL communicator of rank ", rank_, " was aborted after an earlier error");
    if (count == 0) return;
    NOPAD_NCCL_CHECK(ncclAllReduce(data, data, count, ncclBfloat16, ncclSum, comm_, stream));
  }

  void wait_for(CUevent_st* event, double timeout_s, const std::string& what) override {
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) NOPAD_CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      NOPAD_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess) {
        abort_comm();
        fail("rank ", rank_, " of ", size_, ": NCCL reported ", ncclGetErrorString(async), " while waiting for ",
             what, " (a peer rank failed or the network between the GPUs did); the job stops");
      }
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (timeout_s > 0 && waited > timeout_s) {
        abort_comm();
        fail("rank ", rank_, " of ", size_, ": ", what, " did not finish within ", timeout_s,
             " s (dist.timeout_s): a peer rank died or hangs, or its GPU stopped; the job stops. Check the other "
             "ranks' logs");
      }
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::milliseconds(2)) pause *= 2;
    }
  }

 private:
  void abort_comm() {
    if (!aborted_) {
      aborted_ = true;
      (void)ncclCommAbort(comm_);
    }
  }
  int rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};

}  // namespace

bool nccl_built() { return true; }
std::unique_ptr<NcclComm> make_nccl_comm(dist::Communicator& host, int max_ctas) {
  NOPAD_CHECK(max_ctas >= 0, "NCCL max CTAs must be >= 0, got ", max_ctas);
  return std::make_unique<Nccl>(host, max_ctas);
}

#else

bool nccl_built() { return false; }
std::unique_ptr<NcclComm> make_nccl_comm(dist::Communicator& host, int max_ctas) {
  fail("data-parallel training on GPUs needs NCCL, and this build has none: install NCCL (libnccl-dev) or point ",
       "NCCL_ROOT at it and rebuild, or train on the CPU (--set train.device=cpu)");
}

#endif

}  // namespace nopad::cuda
