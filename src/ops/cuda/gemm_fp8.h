// FP8 matrix products through cuBLASLt for the dense layer's three products (per BERT layer: QKV, attention output,
// FFN in, FFN out), row-major as nopad stores them. Inputs are fp8 tensors quantised with q = fp8(x * scale)
// (ops/cuda/fp8_cast.h); each operand comes with the device pointer to its scale_inv = 1 / scale, which goes to
// CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER: cuBLASLt computes D = scale_a scale_b (op(A) op(B)) +
// bias + beta C with fp32 accumulation (CUBLAS_COMPUTE_32F, scale type fp32), so passing the inverse scales gives the
// product of the dequantised values (Transformer Engine passes scale_inv the same way, cublaslt_gemm.cu).
//
// The "TN" rule: on Hopper (and Ada) cuBLASLt's FP8 kernels take A transposed and B not (cublasLtMatmul's FP8
// requirements), i.e. both operands K-major: each stored column of the column-major problem runs along the reduction.
// Row-major [r, c] is column-major [c, r], so (m, n, K of the column-major problem; "copy" = a transposed fp8 copy that
// the cast kernel writes, launch_fp8_cast's q_t):
//   forward  y[rows,n] = x[rows,k] W[n,k]^T        -> y^T[n,rows] = W^T x^T:  A = W [n,k] as stored (lda k, T),
//            m = n, n = rows, K = k                   B = x [rows,k] as stored (ldb k, N); no copy needed.
//   dgrad    dx[rows,k] = dy[rows,n] W[n,k]        -> dx^T[k,rows] = W^T dy^T: A = W^T [k,n] (lda n, T): the
//            m = k, n = rows, K = n                   transposed copy of W; B = dy [rows,n] as stored (ldb n, N).
//   wgrad    dW[n,k] (+)= dy[rows,n]^T x[rows,k]   -> dW^T[k,n] = x^T dy:     A = x^T [k,ld_t] (lda ld_t, T) and
//            m = k, n = n, K = ld_t                   B = dy^T [n,ld_t] (ldb ld_t, N): both transposed copies, their
//                                                     rows zero-padded from rows to ld_t (a multiple of 16).
// Types (HYBRID): forward E4M3 x E4M3; dgrad and wgrad A = E4M3 (W^T, x^T), B = E5M2 (dy, dy^T). cuBLASLt has no
// E5M2 x E5M2 product (refused here). Outputs: forward and dgrad bf16 (C = D, beta allowed: 0 writes without reading,
// 1 accumulates); wgrad fp32, accumulated with beta = 1 as nopad's bf16 path does (LtGemm), or beta = 0.
// Alignment (refused with a message naming the product and the value): every matrix pointer 16-byte aligned, FP8
// leading dimensions (k for the forward, n for dgrad, ld_t for wgrad) multiples of 16 (TE checks lda/ldb % 16 for FP8;
// PyTorch's scaled_mm the same), output leading dimensions of 16 bytes (n % 8 for bf16 y, k % 8 for bf16 dx, k % 4
// for fp32 dW), bias 16-byte aligned, each scale_inv pointer 256-byte aligned (cuBLASLt refuses scale pointers at
// small offsets of one array; ops/cuda/fp8_cast.h's kFp8ScalarStride). rows is free in the forward and dgrad (the column count of the column-major
// problem); the weight gradient's reduction over rows is padded by the copies instead.
//
// Epilogues: the forward takes CUBLASLT_EPILOGUE_BIAS with a bf16 bias (cuBLAS has no FP8 product with an fp32 bias:
// TE casts the bias to bf16, transformer_engine/pytorch/module/linear.py; MLPerf BERT's FP8 layers use BIAS and
// GELU_AUX_BIAS on the forward). Not offered here:
//   GELU_AUX / GELU_AUX_BIAS, DGELU, DGELU_BGRAD: cuBLASLt's GELU is the tanh form and saves pre, while nopad saves
//     gelu'(pre) and also uses the exact erf GELU (dense.h); the same reason the bf16 path does not use them.
//   BGRADB (d_bias in the wgrad product): it would sum the quantised dy; TE never passes a bias to an FP8 wgrad (its
//     linear.py: "bias" only when not fp8) and takes d_bias from the bf16 gradient in the cast kernel instead.
// probe_epilogues() asks the heuristic which of these cuBLASLt offers with FP8 operands on this GPU (test
// Fp8Gemm.EpilogueProbe prints the table; docs/fp8.md records it).
//
// Fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM): when on, the FP8 tensor cores' partial sums are not promoted to
// fp32 periodically (cublasLt.h), and those keep about 14 bits (DeepSeek-V3 technical report, arXiv:2412.19437,
// section 3.3, "Increasing Accumulation Precision", measured on H800). Defaults: on for the forward (K = 1024 or 4096),
// off for dgrad and wgrad (wgrad reduces over all the tokens, ~93,000 rows), which is Transformer Engine's default
// (module/base.py: _2X_ACC_FPROP = False, _2X_ACC_DGRAD = _2X_ACC_WGRAD = True, where "2X_ACC" = split accumulator =
// fast accumulation off; cublaslt_gemm.cu sets FAST_ACCUM = !use_split_accumulator). NVIDIA's MLPerf BERT turns it
// on for all three (training_results_v3.1 .../pytorch/te_layers.py: _2X_ACC_FPROP = _2X_ACC_DGRAD = _2X_ACC_WGRAD =
// False); each call can choose (dev/fp8/gemm_bench.cu times both).
//
// Plans (descriptors + the heuristic's algorithm) are cached per problem as in dense.cu (LtGemm); the scale and bias
// pointers are set per call (no allocation); one 32 MiB workspace allocated at construction. FP8 tensor-core products
// need compute capability 8.9 or newer: on older GPUs (A100: 8.0) every product throws a nopad::Error saying so.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fp8.h"

namespace nopad::cuda {

struct Fp8ForwardArgs {  // y[rows, n] = x_scale_inv w_scale_inv x[rows, k] W[n, k]^T + bias[n] + beta y
  int64_t rows = 0, n = 0, k = 0;
  const uint8_t* x = nullptr;  // [rows, k]
  Fp8Format x_format = Fp8Format::kE4M3;
  const float* x_scale_inv = nullptr;
  const uint8_t* w = nullptr;  // [n, k]
  Fp8Format w_format = Fp8Format::kE4M3;
  const float* w_scale_inv = nullptr;
  bf16* y = nullptr;            // [rows, n]
  const bf16* bias = nullptr;   // [n] or null
  float beta = 0.0f;
  bool fast_accum = true;
};

struct Fp8DgradArgs {  // dx[rows, k] = dy_scale_inv w_scale_inv dy[rows, n] W[n, k] + beta dx
  int64_t rows = 0, n = 0, k = 0;
  const uint8_t* dy = nullptr;  // [rows, n]
  Fp8Format dy_format = Fp8Format::kE5M2;
  const float* dy_scale_inv = nullptr;
  const uint8_t* w_t = nullptr;  // [k, n]: the transposed copy of W
  Fp8Format w_format = Fp8Format::kE4M3;
  const float* w_scale_inv = nullptr;
  bf16* dx = nullptr;  // [rows, k]
  float beta = 0.0f;
  bool fast_accum = false;
};

struct Fp8WgradArgs {  // dW[n, k] = dy_scale_inv x_scale_inv dy[rows, n]^T x[rows, k] + beta dW (fp32)
  int64_t rows = 0, n = 0, k = 0;
  int64_t ld_t = 0;  // leading dimension of both copies: >= rows, a multiple of 16; entries rows..ld_t-1 are zero
  const uint8_t* dy_t = nullptr;  // [n, ld_t]: the transposed copy of dy
  Fp8Format dy_format = Fp8Format::kE5M2;
  const float* dy_scale_inv = nullptr;
  const uint8_t* x_t = nullptr;  // [k, ld_t]: the transposed copy of x
  Fp8Format x_format = Fp8Format::kE4M3;
  const float* x_scale_inv = nullptr;
  float* dw = nullptr;  // [n, k]
  float beta = 1.0f;
  bool fast_accum = false;
};

class Fp8Gemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  Fp8Gemm();  // the handle, the workspace, and the current device's compute capability
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // Whether this GPU has FP8 tensor cores (compute capability >= 8.9); when not, the products throw.
  bool supported() const { return cc_major_ * 10 + cc_minor_ >= 89; }
  void forward(const Fp8ForwardArgs& a, cudaStream_t stream);
  void dgrad(const Fp8DgradArgs& a, cudaStream_t stream);
  void wgrad(const Fp8WgradArgs& a, cudaStream_t stream);

  // For each epilogue, whether the heuristic has an algorithm for the FP8 column-major problem D[m, n] = A^T B (A, B
  // K-major, K = k), for three type combinations. Host only (no product runs); needs supported().
  struct EpilogueSupport {
    std::string name;
    bool e4m3_e4m3_bf16 = false;  // the forward's types (bias bf16)
    bool e4m3_e5m2_bf16 = false;  // dgrad's
    bool e4m3_e5m2_fp32 = false;  // wgrad's (bias / bias gradient bf16)
  };
  std::vector<EpilogueSupport> probe_epilogues(int64_t m, int64_t n, int64_t k);

 private:
  // One column-major problem D[m, n] = sa sb op_T(A)[m, K] B[K, n] + bias + beta D, A stored [K, m] (lda), B [K, n]
  // (ldb), both fp8.
  struct Problem {
    const char* what = "";
    cudaDataType_t a_type{}, b_type{}, d_type{};
    int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldd = 0;
    const void* a = nullptr;
    const void* b = nullptr;
    void* d = nullptr;
    const float* a_scale = nullptr;
    const float* b_scale = nullptr;
    const void* bias = nullptr;  // bf16 [m]
    float beta = 0.0f;
    bool fast_accum = false;
  };
  using Key = std::array<int64_t, 15>;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool found = false;
  };
  void check_supported(const char* what) const;
  void run(const Problem& p, cudaStream_t stream);
  Plan& plan_for(const Problem& p);
  // Whether the heuristic has an algorithm (stored in *algo when not null); alignments of A, B and C = D in bytes.
  bool heuristic_has(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                     cublasLtMatrixLayout_t d, const std::array<uint32_t, 3>& alignments, cublasLtMatmulAlgo_t* algo);

  int cc_major_ = 0, cc_minor_ = 0;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace nopad::cuda
