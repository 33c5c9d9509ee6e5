// Status checks for the CUDA backend. Every CUDA runtime and cuBLAS(Lt) call goes through one of these macros, which
// throw nopad::Error naming the call's text, file:line and the library's error string; kernel launches are followed
// by NOPAD_CUDA_CHECK_LAUNCH() (cudaGetLastError: catches bad launch configurations at the launch, not later).
// cuda_malloc_or_throw turns an out-of-memory into a sentence with the bytes asked for and the free/total memory.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "core/error.h"

namespace nopad::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  fail("CUDA error in ", call, " at ", file, ":", line, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
       ")");
}

inline const char* cublas_status_text(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (bad argument or layout)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (type/layout/alignment combination)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  fail("cuBLAS error in ", call, " at ", file, ":", line, ": ", cublas_status_text(s), " (", static_cast<int>(s),
       ")");
}

// cudaMalloc with a readable out-of-memory message. `what` says what the memory is for.
inline void* cuda_malloc_or_throw(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // drop it from the last-error slot, or the next launch check would report it
    size_t free_b = 0, total_b = 0;
    const bool have_info = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    if (have_info)
      throw OutOfMemory(str_cat("out of GPU memory allocating ", bytes, " bytes (", static_cast<double>(bytes) / kGiB,
                                " GiB) for ", what, ": ", static_cast<double>(free_b) / kGiB, " GiB free of ",
                                static_cast<double>(total_b) / kGiB,
                                " GiB on the device; use a smaller micro-batch (fewer tokens per step)"));
    throw OutOfMemory(str_cat("out of GPU memory allocating ", bytes, " bytes for ", what));
  }
  if (err != cudaSuccess) throw_cuda_error(err, "cudaMalloc", __FILE__, __LINE__);
  return p;
}

}  // namespace nopad::cuda

#define NOPAD_CUDA_CHECK(call)                                                         \
  do {                                                                                 \
    const cudaError_t nopad_cuda_err_ = (call);                                        \
    if (nopad_cuda_err_ != cudaSuccess)                                                \
      ::nopad::cuda::throw_cuda_error(nopad_cuda_err_, #call, __FILE__, __LINE__);     \
  } while (0)

#define NOPAD_CUBLAS_CHECK(call)                                                       \
  do {                                                                                 \
    const cublasStatus_t nopad_cublas_st_ = (call);                                    \
    if (nopad_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                     \
      ::nopad::cuda::throw_cublas_error(nopad_cublas_st_, #call, __FILE__, __LINE__);  \
  } while (0)

// After every kernel launch: reports launch-configuration errors (and earlier asynchronous faults) here.
#define NOPAD_CUDA_CHECK_LAUNCH() NOPAD_CUDA_CHECK(cudaGetLastError())
