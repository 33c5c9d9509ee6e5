// Tensor maps (the descriptors the Hopper tensor copy engine reads) of row-major 2D matrices in global memory, for
// the kernels that load, store or reduce boxes of them by TMA (gemm_sm90.cu, fmha_backward.cu). Host-only; encoding
// allocates nothing and touches no device state. cuTensorMapEncodeTiled is a driver function, reached through the
// runtime's entry-point query once per process.
#pragma once
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "ops/cuda/check.h"

namespace nopad::cuda {

// The map of base [rows, cols] (elements of `type`, rows row_bytes apart) read or written in boxes of box_rows x
// box_cols elements with the given shared-memory swizzle. `what` names the matrix in errors.
inline CUtensorMap tensor_map_2d(CUtensorMapDataType type, const void* base, uint64_t rows, uint64_t cols,
                                 uint64_t row_bytes, uint32_t box_cols, uint32_t box_rows, CUtensorMapSwizzle swizzle,
                                 CUtensorMapL2promotion promotion, const char* what) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    NOPAD_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    NOPAD_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(&map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  NOPAD_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r), ") for ", what, " [",
              rows, ", ", cols, "]");
  return map;
}

}  // namespace nopad::cuda
