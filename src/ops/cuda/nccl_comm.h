// The GPUs' collective for data-parallel training: an NCCL communicator over the ranks of a host communicator
// (dist::Communicator, MPI), one GPU per rank. Declared without CUDA or NCCL headers; built with the CUDA backend, and
// functional where CMake found NCCL (NOPAD_HAVE_NCCL), else every entry throws saying how to get it.
//
// Contract:
//  - make_nccl_comm is collective over `host`: rank 0 creates the NCCL id, the host communicator broadcasts it, every
//    rank joins on its current CUDA device (the caller sets it). Blocking; call it at setup, not inside a step.
//  - all_reduce_sum enqueues an in-place fp32 sum on `stream` and returns: no host synchronisation. Every rank gets
//    the same bits (NCCL's ring/tree all-reduce ends with every rank holding the one reduced copy).
//    all_reduce_sum_bf16 is the same over bf16 elements (NCCL adds in fp32 and rounds each partial sum to bf16).
//  - wait_for(event, ...) is the host's wait for work that includes collectives: it polls the event and NCCL's
//    asynchronous error state; on an NCCL error, or when `timeout_s` passes with the event not complete (a peer rank
//    died or hangs), it aborts the communicator (ncclCommAbort, which also releases the stream) and throws
//    nopad::Error naming this rank, what was waited for and what to check.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "dist/comm.h"

struct CUevent_st;
struct CUstream_st;

namespace nopad::cuda {

class NcclComm {
 public:
  virtual ~NcclComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void all_reduce_sum(float* data, size_t count, CUstream_st* stream) = 0;
  virtual void all_reduce_sum_bf16(void* data, size_t count, CUstream_st* stream) = 0;
  virtual void wait_for(CUevent_st* event, double timeout_s, const std::string& what) = 0;
};

// True when this build has NCCL.
bool nccl_built();
// max_ctas > 0 caps the thread blocks (SMs) an NCCL collective occupies (ncclConfig_t::maxCTAs), so buckets reduced
// during backward take fewer SMs from the compute beside them; 0 leaves NCCL's default (measured best on 2 H200s).
std::unique_ptr<NcclComm> make_nccl_comm(dist::Communicator& host, int max_ctas = 0);

}  // namespace nopad::cuda
