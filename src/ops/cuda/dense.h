// cuBLASLt matrix products for the CUDA backend (dense.cu), and the elementwise/column-sum kernels of the dense op.
//
// Row-major <-> column-major mapping. cuBLASLt is column-major; a row-major [r, c] matrix with leading dimension c
// is, byte for byte, the column-major [c, r] matrix with leading dimension c (its transpose). So every row-major
// product below is issued as the column-major product of the transposed views:
//   forward   y[rows,n] = x[rows,k] W[n,k]^T    ->  y^T[n,rows] = op_T(W^T[k,n]) x^T[k,rows]
//             m = n, n = rows, k = k; A = W (stored [k,n], lda k, TRANSA = T); B = x (stored [k,rows], ldb k, N);
//             D = y (stored [n,rows], ldd n); bias[n] = a bias per row of D (CUBLASLT_EPILOGUE_BIAS).
//   backward  dx[rows,k] = dpre[rows,n] W[n,k]  ->  dx^T[k,rows] = W^T[k,n] dpre^T[n,rows]
//             m = k, n = rows, k = n; A = W (stored [k,n], lda k, N); B = dpre (stored [n,rows], ldb n, N);
//             D = dx (stored [k,rows], ldd k); beta = 1 when accumulating into dx.
//   backward  dW[n,k] += dpre^T x               ->  dW^T[k,n] += x^T[k,rows] op_T(dpre^T[n,rows])
//             m = k, n = n, k = rows; A = x (stored [k,rows], lda k, N); B = dpre (stored [n,rows], ldb n, T);
//             D = dW fp32 (stored [k,n], ldd k), beta = 1. (bf16 A/B with fp32 C/D under CUBLAS_COMPUTE_32F is one
//             of cuBLASLt's supported type combinations.)
// Algorithms are chosen once per problem (shape, transposes, leading dimensions, output type, epilogue, beta != 0,
// pointer alignments) with cublasLtMatmulAlgoGetHeuristic and cached together with their descriptors, so a call on
// a known shape allocates nothing.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>

namespace nopad::cuda {

// One column-major problem D[m, n] = alpha op(A)[m, k] op(B)[k, n] (+ bias[m] per row) + beta D.
struct GemmProblem {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // bf16
  int64_t lda = 0;
  const void* b = nullptr;  // bf16
  int64_t ldb = 0;
  void* d = nullptr;  // bf16, or fp32 when d_fp32
  int64_t ldd = 0;
  bool d_fp32 = false;
  float beta = 0.0f;           // 0: D is written without being read (poisoned outputs stay safe)
  const void* bias = nullptr;  // bf16 [m], or null (bf16 D only)
};

class LtGemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  LtGemm();  // creates the handle and the 32 MiB workspace
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  void run(const GemmProblem& p, cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  using Key = std::array<int64_t, 14>;
  Plan& plan_for(const GemmProblem& p);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace nopad::cuda
