// The dense (linear) layer's device side: cuBLASLt products with cached plans (dense.h has the row-/column-major
// mapping), exact-erf GELU forward/backward kernels, and the first stage of the deterministic d_bias column sum.
// CPU twin: dense_forward / dense_backward in ops/cpu/cpu_backend.cpp.
//
// Why GELU is not a cuBLASLt epilogue: CUBLASLT_EPILOGUE_GELU(_BIAS) is the tanh approximation, while BERT's "gelu"
// (and the CPU twin) is the exact 0.5 x (1 + erf(x / sqrt 2)). So the GEMM writes pre_act through the BIAS epilogue
// and gelu_forward_kernel writes y from it (one extra bf16 read + write of [rows, n]).
#include <algorithm>

#include "ops/cuda/check.h"
#include "ops/cuda/dense.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {

// ------------------------------------------------------------------------------------------------ cuBLASLt

LtGemm::LtGemm() {
  NOPAD_CUBLAS_CHECK(cublasLtCreate(&handle_));
  workspace_ = cuda_malloc_or_throw(kWorkspaceBytes, "the cuBLASLt workspace");
}

LtGemm::~LtGemm() {
  // Destructors must not throw: statuses are ignored here (the process is tearing the backend down).
  for (auto& [key, plan] : plans_) {
    (void)key;
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.d) cublasLtMatrixLayoutDestroy(plan.d);
    if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

namespace {
// Largest power of two (<= 256) dividing the address: what the heuristic may assume about the pointer.
uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}
}  // namespace

LtGemm::Plan& LtGemm::plan_for(const GemmProblem& p) {
  const Key key = {p.trans_a,          p.trans_b, p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.d_fp32, p.bias != nullptr,
                   p.beta != 0.0f, alignment_of(p.a), alignment_of(p.b), alignment_of(p.d)};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;

  // New problem: build its descriptors and pick an algorithm (allocates: happens once per shape).
  Plan plan;
  const cudaDataType_t ab_type = CUDA_R_16BF, d_type = p.d_fp32 ? CUDA_R_32F : CUDA_R_16BF;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (p.bias) {
    NOPAD_CHECK(!p.d_fp32, "LtGemm: a bias epilogue is only used with bf16 outputs");
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                      sizeof bias_type));
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  }
  // Stored (pre-op) shapes, column-major: A is [k, m] when transposed, else [m, k]; likewise B.
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, ab_type, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, ab_type, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, d_type, p.m, p.n, p.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t al_a = alignment_of(p.a), al_b = alignment_of(p.b), al_d = alignment_of(p.d);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.d);
    cublasLtMatmulDescDestroy(plan.desc);
    if (st != CUBLAS_STATUS_SUCCESS) throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    fail("cuBLASLt has no algorithm for the product m=", p.m, " n=", p.n, " k=", p.k, " (transa ", p.trans_a,
         ", transb ", p.trans_b, ", lda ", p.lda, ", ldb ", p.ldb, ", ldd ", p.ldd, ", ", p.d_fp32 ? "fp32" : "bf16",
         " output, bias ", p.bias != nullptr, ", alignments ", al_a, "/", al_b, "/", al_d, " bytes)");
  }
  plan.algo = result.algo;
  return plans_.emplace(key, plan).first->second;
}

void LtGemm::run(const GemmProblem& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return;
  NOPAD_CHECK(p.k > 0 || p.beta != 0.0f, "LtGemm: k = 0 with beta = 0 would leave D unwritten");
  if (p.k == 0) return;  // D += 0
  Plan& plan = plan_for(p);
  if (p.bias)  // the pointer is per call; setting an attribute allocates nothing
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  const float alpha = 1.0f, beta = p.beta;
  NOPAD_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, p.a, plan.a, p.b, plan.b, &beta, p.d, plan.d, p.d,
                                    plan.d, &plan.algo, workspace_, kWorkspaceBytes, stream));
}

// ------------------------------------------------------------------------------------------------ elementwise

namespace {

constexpr int kThreads = 256;

// Vectorised over 8 elements where the pointers allow it, scalar tail otherwise.
__global__ void gelu_forward_kernel(const bf* __restrict__ pre, bf* __restrict__ y, int64_t count, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < count / 8; i += stride) {
      float v[8];
      load8(pre + i * 8, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = gelu_erf(v[e]);
      store8(y + i * 8, v);
    }
    i = count / 8 * 8 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // tail
  }
  for (; i < count; i += stride) y[i] = __float2bfloat16_rn(gelu_erf(__bfloat162float(pre[i])));
}

__global__ void gelu_backward_kernel(const bf* __restrict__ dy, const bf* __restrict__ pre, bf* __restrict__ dpre,
                                     int64_t count, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < count / 8; i += stride) {
      float d[8], x[8];
      load8(dy + i * 8, d);
      load8(pre + i * 8, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] *= gelu_erf_grad(x[e]);
      store8(dpre + i * 8, d);
    }
    i = count / 8 * 8 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  for (; i < count; i += stride)
    dpre[i] = __float2bfloat16_rn(__bfloat162float(dy[i]) * gelu_erf_grad(__bfloat162float(pre[i])));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int elementwise_blocks(int64_t count) {
  // Grid-stride loops: enough blocks to fill the GPU many times over, capped so huge tensors loop.
  return static_cast<int>(std::clamp<int64_t>((count / 8 + kThreads - 1) / kThreads, 1, 65536));
}

// partial[c][j] = sum over rows of chunk c of m[r][j]; rows in a fixed order.
__global__ void column_sum_partial_kernel(const bf* __restrict__ m, int64_t rows, int32_t n, int64_t rows_per_chunk,
                                          float* __restrict__ partial) {
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += __bfloat162float(m[r * n + j]);
  partial[static_cast<int64_t>(blockIdx.y) * n + j] = s;
}

}  // namespace

void launch_gelu_forward(const bf* pre, bf* y, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  gelu_forward_kernel<<<elementwise_blocks(count), kThreads, 0, stream>>>(pre, y, count,
                                                                           aligned16(pre) && aligned16(y));
  NOPAD_CUDA_CHECK_LAUNCH();
}

void launch_gelu_backward(const bf* dy, const bf* pre, bf* dpre, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  gelu_backward_kernel<<<elementwise_blocks(count), kThreads, 0, stream>>>(
      dy, pre, dpre, count, aligned16(dy) && aligned16(pre) && aligned16(dpre));
  NOPAD_CUDA_CHECK_LAUNCH();
}

int column_sum_chunks(int64_t rows) {
  // ~64 rows per chunk, at most 256 chunks: the second stage then reads at most 256 partials per column.
  return static_cast<int>(std::clamp<int64_t>((rows + 63) / 64, 1, 256));
}

void launch_column_sum_partial(const bf* m, int64_t rows, int32_t n, int chunks, float* partial,
                               cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(ceil_div(n, kThreads)), static_cast<unsigned>(chunks));
  column_sum_partial_kernel<<<grid, kThreads, 0, stream>>>(m, rows, n, rows_per_chunk, partial);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
