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
//             D = dW fp32 (stored [k,n], ldd k), beta = 1. (bf16 or fp16 A/B with fp32 C/D under
//             CUBLAS_COMPUTE_32F is one of cuBLASLt's supported type combinations.)
//             With bias_grad set, the BGRADB epilogue also writes (=, not +=) bias_grad[n] = sum over the k rows of
//             op(B), i.e. the column sums of dpre: d_bias without a separate pass (the caller adds it into d_bias).
//   GELU: the forward saves gelu'(pre) for the backward (ops.h), which cuBLASLt's GELU epilogues cannot write (they
//             save pre); the GELU products go through nopad's own GEMM (gemm_sm90.h) or the BIAS epilogue plus the
//             GELU kernel (dense.cu).
// Element types: A, B, a 16-bit D and the bias are all bf16 (CUDA_R_16BF) or all fp16 (CUDA_R_16F) (GemmProblem::
// type); the weight-gradient D is fp32; accumulation is fp32 (CUBLAS_COMPUTE_32F) for both.
// Algorithms are chosen once per problem (element type, shape, transposes, leading dimensions, output type, epilogue,
// beta != 0, pointer alignments) with cublasLtMatmulAlgoGetHeuristic and cached together with their descriptors, so a call on
// a known shape allocates nothing. A problem the heuristic has no algorithm for is cached as such too: try_run then
// returns false at once, so a caller's fallback costs no repeated heuristic queries.
//
// This header also holds KernelVariants: the selectable implementations of the memory-bound ops (LayerNorm family,
// GELU, d_bias, softmax cross-entropy). Host-only, so the GPU tests (.cpp) can switch them.
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
  cudaDataType_t type = CUDA_R_16BF;  // of A, B, the bias and a 16-bit D: CUDA_R_16BF or CUDA_R_16F
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // 16-bit (type)
  int64_t lda = 0;
  const void* b = nullptr;  // 16-bit (type)
  int64_t ldb = 0;
  void* d = nullptr;  // 16-bit (type), or fp32 when d_fp32
  int64_t ldd = 0;
  bool d_fp32 = false;
  float beta = 0.0f;           // 0: D is written without being read (poisoned outputs stay safe)
  const void* bias = nullptr;  // 16-bit (type) [m], or null (16-bit D only)
  float* bias_grad = nullptr;  // fp32 [n] written by the BGRADB epilogue (fp32 D only; not with bias)
};

// ------------------------------------------------------------------------------------------------ kernel variants
// Each memory-bound op keeps its first implementation selectable next to the newer one, so that one GPU run can time
// both (tests/cuda/test_cuda_ops.cpp, CudaPerf.*) and check both against the CPU twin (CudaOps.*). Process-wide;
// CudaBackend reads it at every op call. Every combination computes the same values up to fp32 summation order.
struct LnVariant {
  // false: warp per row, 4 rows per 128-thread block, one row in flight per warp, grid min(rows/4, 2 x SMs) in the
  // backward. true: the row-group kernel (layernorm.cu): a group of threads per row, each block walks a contiguous
  // range of rows with the next row's loads in flight, dropout drawn once per row.
  bool row_group = true;
  int vectors = 0;        // row group: 16-byte vectors (8 features) per thread, 1, 2 or 4; 0 = by hidden size
  int blocks_per_sm = 0;  // row group: blocks per SM in the grid; 0 = as many as fit (the backward: see layernorm.cu)
  // Bias + dropout + residual LayerNorm only (the plain and embedding LayerNorms ignore it): 0 = the kernels above.
  // Row group with one vector per thread: 2, 3 or 4 = the pipelined kernel, whose rows' inputs are copied global ->
  // shared (cp.async) that many rows ahead, so several rows per block are in flight without registers to hold them.
  // Warp per row (forward only): 2 = the pipelined warp-per-row kernel (each block walks a range of rows, the next
  // row of each warp in flight in shared memory; blocks_per_sm caps its grid).
  int stages = 0;
};
enum class BiasGradPath {
  kSeparate,  // dGELU pass, then a separate column-sum pass over dpre (the first implementation)
  kOnePass,   // one pass: dpre = dy * gelu' written and its column sums taken from registers (without GELU: the
              // column-sum pass alone, 16-byte loads)
  kEpilogue,  // the dW product's BGRADB epilogue (falls back to kOnePass where cuBLASLt has no algorithm for it)
};
// Defaults: the fastest of each pair on an H200 at BERT-large sizes (CudaPerf.*, 2026-11-23: T = 24,657, H = 1024,
// dropout 0.1; docs/performance.md): LayerNorm forward warp-per-row 0.061 ms vs row-group 0.077-0.091; backward
// row-group v1 0.104 ms vs warp-per-row 0.191 (embedding backward 0.187 vs 0.588); wide GELU 0.116 vs 0.141; FFN-in
// backward with d_bias one-pass 0.815 ms vs separate 0.856 vs epilogue 0.881 (QKV: 0.477 / 0.470 / 0.527); softmax
// CE from registers (MLM forward 1.15 vs 1.23 ms); CE backward a block per row (H100, 2026-11-24, with the padded
// decoder: the flat grid's per-element division made it 0.89 ms of the MLM backward at M = 7,400 rows; the earlier
// 7.71 ms "per row" figure was the unaligned decoder's bias-gradient epilogue measured in the same variant set).
// 2026-11-25 (H200, same sizes): the residual LayerNorm backward pipelined with 2 stages, 0.085 ms against the
// row-group kernel's 0.102 (2-4 stages within 2%), 1.4-1.6 ms less per BERT-large batch-128 step; its forward
// pipelined warp-per-row, 0.052 ms against 0.060 (the embedding and plain LayerNorms keep the kernels above).
struct KernelVariants {
  LnVariant ln_forward{false, 0, 0, 2};
  LnVariant ln_backward{true, 1, 0, 2};
  bool gelu_forward_wide = true;  // GELU forward: 4 vectors per thread, all loads issued first (false: 1 vector)
  BiasGradPath dense_bias_grad = BiasGradPath::kOnePass;
  bool softmax_ce_registers = true;  // softmax CE: one read of the logits row into registers (false: three passes)
  bool ce_backward_rows = true;      // CE backward: a block per row, 4-byte vectors (false: flat grid, scalar)
  // GELU forward: nopad's sm_90a GEMM (gemm_sm90.h) with the GELU in the epilogue (y and gelu' from one product)
  // where the device and the shapes allow it (n % 256, k % 64), else the cuBLASLt product + the wide GELU kernel.
  bool gelu_gemm = true;
  // GELU backward (dense_backward_through_act): the same GEMM applying the saved gelu' and taking the d_bias column
  // partials in the FFN-out dx product's epilogue (the weight transposed first), else the cuBLASLt product + the
  // one-pass scale kernel. Measured in docs/performance.md ("the saved GELU derivative").
  bool dgelu_gemm = true;
  // attention_backward's d_qkv_bias: the FMHA kernels sum the columns of d_qkv as they write it (FmhaParams::
  // d_qkv_bias), else the one-pass column-sum kernel reads d_qkv afterwards (what dense_backward's d_bias costs).
  bool qkv_bias_in_attention = true;
  // attention_output_backward: the FMHA backward's first pass (D, lse2, the zeroed dQ accumulator) done by the
  // attention-output dx product (nopad's sm_90a GEMM, its epilogue and idle warps) instead of a memory-bound pass, else
  // the cuBLASLt product and the pass.
  bool attention_prep_gemm = true;
};
KernelVariants& kernel_variants();  // dense.cu
// How the last dense_backward with a d_bias obtained it (set by CudaBackend; tests read it to see whether the
// epilogue ran or fell back).
BiasGradPath& last_bias_grad_path();
// How the last dense_forward / dense_backward_through_act with a GELU applied it: kGemmSm90 (nopad's GEMM with the
// GELU / scale epilogue), kKernel (the cuBLASLt product and elementwise kernels). Tests read it to see which path ran.
enum class GeluPath { kKernel, kGemmSm90 };
GeluPath& last_gelu_path();
// Whether the last attention_output_backward ran fused (its first pass in the d_ctx product: KernelVariants::
// attention_prep_gemm) or as the two ops. Tests read it.
bool& last_attention_output_fused();

class LtGemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  // Creates the handle and the 32 MiB workspace. autotune: 1 on, 0 off, -1 = the environment (NOPAD_GEMM_AUTOTUNE=1
  // turns it on; off by default).
  explicit LtGemm(int autotune = -1);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  void run(const GemmProblem& p, cudaStream_t stream);  // throws when cuBLASLt has no algorithm
  bool try_run(const GemmProblem& p, cudaStream_t stream);  // false (nothing enqueued) when it has none
  // Autotuning (off by default): the token count T changes every step, so exact shapes keep appearing; tuning is done
  // per size class (the problem with each of m, n, k rounded up to 1/8 of its power of two: size_class()). The first
  // exact shape of a class times the heuristic's first kCandidates algorithms on its real operands (into a scratch D
  // where D is accumulated into) and the fastest becomes the class's algorithm; later shapes of the class take it when
  // cuBLASLt accepts it for them (cublasLtMatmulAlgoCheck, host only), else their heuristic's first. The GPU is waited
  // for once per new class. Measured on an H200 (BERT-large, batch 128, 20 steps after 5 warm-up,
  // docs/performance.md): 265.6 ms/step with it, 225.4 without; new classes keep appearing in the timed steps and
  // the chosen algorithms win too little to pay for the timing runs, hence off unless asked for. Again on an H100
  // (2026-11-26, 30 warm-up steps): 211.0 against 205.4-207.1 ms; the winners change with T and the clock.
  // NOPAD_GEMM_TUNE_LOG=1 prints each tuned class's candidate times, NOPAD_GEMM_TUNE_REPS the timed calls each.
  struct TuningStats {
    int shapes = 0;        // size classes tuned
    int reused = 0;        // exact shapes that took their class's tuned algorithm
    int changed = 0;       // where a candidate other than the heuristic's first won
    double first_ms = 0;   // summed time of the heuristic's first choice, one call per shape
    double chosen_ms = 0;  // summed time of the chosen ones
  };
  const TuningStats& tuning_stats() const { return tuning_; }

 private:
  static constexpr int kCandidates = 8;  // heuristic results timed on a shape's first use
  using Key = std::array<int64_t, 17>;
  struct Plan {
    Key key{};  // the exact problem
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool found = false;  // false: cached "no algorithm" (descriptors destroyed)
    bool tuned = false;  // algo is the fastest of the candidates (or the heuristic's first, autotuning off)
    int num_candidates = 0;
    cublasLtMatmulAlgo_t candidates[kCandidates]{};
  };
  static Key size_class(const Key& exact);  // m, n, k (key fields 3-5) rounded up: see the autotuning note
  Plan& plan_for(const GemmProblem& p);
  void enqueue(Plan& plan, const GemmProblem& p, cudaStream_t stream);

  void tune(Plan& plan, const GemmProblem& p, cudaStream_t stream);
  bool autotune_ = false;
  TuningStats tuning_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Plan> plans_;
  std::map<Key, cublasLtMatmulAlgo_t> tuned_;  // size class -> the algorithm its tuning chose
};

}  // namespace nopad::cuda
