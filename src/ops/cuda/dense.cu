// The dense (linear) layer's device side: cuBLASLt products with cached plans (dense.h has the row-/column-major
// mapping; the BGRADB epilogue gives d_bias from the dW product), the GELU forward kernels (y and the saved
// derivative gelu'(pre) from the product's pre-activation), the one-pass scale + column-sum kernel (dpre = dy *
// gelu'), the first stage of the separate deterministic d_bias column sum, and the process-wide KernelVariants. CPU
// twin: dense_forward / dense_backward in ops/cpu/cpu_backend.cpp.
//
// GELU: what the forward saves for the backward is the derivative gelu'(pre), not pre (ops.h), so the backward's
// activation step is one multiply: in nopad's own GEMM (gemm_sm90.h) the forward writes y and gelu' from its
// epilogue and the FFN-out dx product applies the saved derivative in its epilogue. The cuBLASLt path (other GPUs,
// shapes gemm_sm90 does not take) writes pre through the BIAS epilogue and a GELU kernel overwrites it with gelu'(pre)
// while writing y (cuBLASLt's own GELU epilogues save pre, and only for the tanh form). erff compiles to ~20
// FMA-pipe instructions and one MUFU, so the pass is bandwidth-bound as long as enough loads are in flight (the wide
// kernel).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "ops/cuda/check.h"
#include "ops/cuda/dense.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {

// ------------------------------------------------------------------------------------------------ cuBLASLt

LtGemm::LtGemm(int autotune) {
  const char* env = std::getenv("NOPAD_GEMM_AUTOTUNE");
  autotune_ = autotune >= 0 ? autotune != 0 : env != nullptr && std::string_view(env) == "1";
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

namespace {
// x rounded up to a multiple of 1/8 of the largest power of two <= x (x <= 16 unchanged): at most 12.5% above x,
// so the classes of a run whose token count moves by a few percent are few, and fixed feature sizes (1024, 3072,
// 4096) are their own class.
int64_t round_size_class(int64_t x) {
  if (x <= 16) return x;
  int64_t pow2 = 1;
  while (pow2 * 2 <= x) pow2 *= 2;
  const int64_t step = pow2 / 8;
  return (x + step - 1) / step * step;
}
}  // namespace

LtGemm::Key LtGemm::size_class(const Key& exact) {
  Key k = exact;
  for (int i = 3; i <= 5; ++i) k[i] = round_size_class(exact[i]);  // m, n, k
  return k;
}

LtGemm::Plan& LtGemm::plan_for(const GemmProblem& p) {
  const Key key = {p.type,           p.trans_a,         p.trans_b,    p.m,         p.n,
                   p.k,                p.lda,             p.ldb,        p.ldd,       p.d_fp32,
                   p.bias != nullptr,  p.beta != 0.0f,    alignment_of(p.a), alignment_of(p.b), alignment_of(p.d),
                   p.bias_grad != nullptr, p.bias_grad ? alignment_of(p.bias_grad) : 0};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;

  // New problem: build its descriptors and pick an algorithm (allocates: happens once per shape).
  NOPAD_CHECK(!(p.bias && p.bias_grad), "LtGemm: a bias and a bias gradient in one product");
  NOPAD_CHECK(p.type == CUDA_R_16BF || p.type == CUDA_R_16F, "LtGemm: element type ", static_cast<int>(p.type),
              " is neither bf16 nor fp16");
  Plan plan;
  plan.key = key;
  const cudaDataType_t ab_type = p.type, d_type = p.d_fp32 ? CUDA_R_32F : p.type;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (p.bias) {
    NOPAD_CHECK(!p.d_fp32, "LtGemm: a bias epilogue is only used with 16-bit outputs");
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = p.type;
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                      sizeof bias_type));
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  }
  if (p.bias_grad) {  // column sums of op(B) over the k dimension, fp32 (the output type), written
    NOPAD_CHECK(p.d_fp32, "LtGemm: the BGRADB epilogue is only used with fp32 outputs");
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BGRADB;
    const cudaDataType_t grad_type = CUDA_R_32F;
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &grad_type,
                                                      sizeof grad_type));
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias_grad,
                                                      sizeof p.bias_grad));
  }
  // Stored (pre-op) shapes, column-major: A is [k, m] when transposed, else [m, k]; likewise B.
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, ab_type, p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, ab_type, p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, d_type, p.m, p.n, p.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t al_a = alignment_of(p.a), al_b = alignment_of(p.b), al_d = alignment_of(p.d);
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
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
    st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, kCandidates,
                                        results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  // An epilogue the library does not offer for this problem may be reported as NOT_SUPPORTED rather than as 0
  // results: for a bias-gradient product both mean "no algorithm" (the caller falls back).
  if (p.bias_grad && st == CUBLAS_STATUS_NOT_SUPPORTED) {
    st = CUBLAS_STATUS_SUCCESS;
    found = 0;
  }
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.d);
    cublasLtMatmulDescDestroy(plan.desc);
    if (st != CUBLAS_STATUS_SUCCESS) throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    return plans_.emplace(key, Plan{}).first->second;  // cached "no algorithm"
  }
  plan.algo = results[0].algo;
  for (int i = 0; i < found && i < kCandidates; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan.candidates[plan.num_candidates++] = results[i].algo;
  plan.found = true;
  plan.tuned = !autotune_ || plan.num_candidates <= 1;
  if (!plan.tuned) {  // the size class's algorithm, when it has one and cuBLASLt accepts it for this exact shape
    const auto cls = tuned_.find(size_class(key));
    if (cls != tuned_.end()) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle_, plan.desc, plan.a, plan.b, plan.d, plan.d, &cls->second, &check) ==
              CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kWorkspaceBytes) {
        plan.algo = cls->second;
        ++tuning_.reused;
      }
      plan.tuned = true;  // either way: no timing run for a shape whose class was tuned
    }
  }
  return plans_.emplace(key, plan).first->second;
}

// Times each candidate algorithm on this call's operands and keeps the fastest. D is written by the timing runs; where
// the product accumulates into D (beta != 0) they write a scratch copy instead, so the caller's D is untouched until
// its own run. A candidate the library refuses at run time is skipped. Setup-time only: it allocates and waits.
void LtGemm::tune(Plan& plan, const GemmProblem& p, cudaStream_t stream) {
  plan.tuned = true;
  void* d = p.d;
  void* scratch = nullptr;
  if (p.beta != 0.0f) {
    const size_t bytes = static_cast<size_t>(p.ldd) * static_cast<size_t>(p.n) * (p.d_fp32 ? 4 : 2);
    scratch = cuda_malloc_or_throw(bytes, "a GEMM autotuning scratch output");
    NOPAD_CUDA_CHECK(cudaMemsetAsync(scratch, 0, bytes, stream));
    d = scratch;
  }
  cudaEvent_t ev[2] = {nullptr, nullptr};
  NOPAD_CUDA_CHECK(cudaEventCreate(&ev[0]));
  NOPAD_CUDA_CHECK(cudaEventCreate(&ev[1]));
  const float alpha = 1.0f, beta = p.beta;
  // NOPAD_GEMM_TUNE_REPS: timed calls per candidate (default 3); NOPAD_GEMM_TUNE_LOG=1: one stderr line per tuned
  // class with every candidate's time, so a run shows what tuning would win per shape.
  static const int kReps = [] {
    const char* e = std::getenv("NOPAD_GEMM_TUNE_REPS");
    if (e == nullptr) return 3;
    char* end = nullptr;
    const long r = std::strtol(e, &end, 10);
    NOPAD_CHECK(end != e && *end == '\0' && r >= 1 && r <= 1000, "NOPAD_GEMM_TUNE_REPS=", e,
                ": expected a whole number of timed calls per candidate from 1 to 1000 (unset: 3)");
    return static_cast<int>(r);
  }();
  static const bool kLog = [] {
    const char* e = std::getenv("NOPAD_GEMM_TUNE_LOG");
    return e != nullptr && std::string_view(e) == "1";
  }();
  std::string log;
  double best_ms = 0, first_ms = -1;
  int best = -1;
  for (int c = 0; c < plan.num_candidates; ++c) {
    const cublasLtMatmulAlgo_t* algo = &plan.candidates[c];
    auto once = [&] {
      return cublasLtMatmul(handle_, plan.desc, &alpha, p.a, plan.a, p.b, plan.b, &beta, d, plan.d, d, plan.d, algo,
                            workspace_, kWorkspaceBytes, stream);
    };
    if (once() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; refused: not a candidate
    NOPAD_CUDA_CHECK(cudaEventRecord(ev[0], stream));
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    for (int r = 0; r < kReps && st == CUBLAS_STATUS_SUCCESS; ++r) st = once();
    NOPAD_CUDA_CHECK(cudaEventRecord(ev[1], stream));
    NOPAD_CUDA_CHECK(cudaEventSynchronize(ev[1]));
    if (st != CUBLAS_STATUS_SUCCESS) continue;
    float ms = 0;
    NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    const double per_call = static_cast<double>(ms) / kReps;
    if (kLog) log += " " + std::to_string(c) + ":" + std::to_string(per_call);
    if (c == 0) first_ms = per_call;
    if (best < 0 || per_call < best_ms) {
      best_ms = per_call;
      best = c;
    }
  }
  (void)cudaEventDestroy(ev[0]);
  (void)cudaEventDestroy(ev[1]);
  if (scratch) NOPAD_CUDA_CHECK(cudaFree(scratch));
  NOPAD_CUDA_CHECK(cudaGetLastError());
  if (kLog)
    std::fprintf(stderr, "gemm tune m=%lld n=%lld k=%lld ta=%d tb=%d bias=%d bgrad=%d fp32=%d beta=%g best=%d ms:%s\n",
                 static_cast<long long>(p.m), static_cast<long long>(p.n), static_cast<long long>(p.k),
                 static_cast<int>(p.trans_a), static_cast<int>(p.trans_b), p.bias != nullptr ? 1 : 0,
                 p.bias_grad != nullptr ? 1 : 0, static_cast<int>(p.d_fp32), static_cast<double>(p.beta), best,
                 log.c_str());
  if (best < 0) return;  // every candidate refused at run time: keep the heuristic's first (enqueue will report it)
  plan.algo = plan.candidates[best];
  tuned_[size_class(plan.key)] = plan.algo;
  ++tuning_.shapes;
  tuning_.changed += best != 0;
  tuning_.first_ms += first_ms >= 0 ? first_ms : best_ms;
  tuning_.chosen_ms += best_ms;
}

void LtGemm::enqueue(Plan& plan, const GemmProblem& p, cudaStream_t stream) {
  // The pointers are per call; setting an attribute allocates nothing.
  if (p.bias)
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  if (p.bias_grad)
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias_grad,
                                                      sizeof p.bias_grad));
  if (!plan.tuned) tune(plan, p, stream);
  const float alpha = 1.0f, beta = p.beta;
  NOPAD_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, p.a, plan.a, p.b, plan.b, &beta, p.d, plan.d, p.d,
                                    plan.d, &plan.algo, workspace_, kWorkspaceBytes, stream));
}

void LtGemm::run(const GemmProblem& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return;
  NOPAD_CHECK(p.k > 0 || p.beta != 0.0f, "LtGemm: k = 0 with beta = 0 would leave D unwritten");
  NOPAD_CHECK(p.k > 0 || p.bias_grad == nullptr, "LtGemm: k = 0 would leave the bias gradient unwritten");
  if (p.k == 0) return;  // D += 0
  Plan& plan = plan_for(p);
  if (!plan.found)
    fail("cuBLASLt has no algorithm for the product m=", p.m, " n=", p.n, " k=", p.k, " (transa ", p.trans_a,
         ", transb ", p.trans_b, ", lda ", p.lda, ", ldb ", p.ldb, ", ldd ", p.ldd, ", ",
         p.type == CUDA_R_16F ? "fp16" : "bf16", " inputs, ", p.d_fp32 ? "fp32" : "16-bit", " output, bias ",
         p.bias != nullptr, ", bias gradient ", p.bias_grad != nullptr, ", alignments ",
         alignment_of(p.a), "/", alignment_of(p.b), "/", alignment_of(p.d), " bytes)");
  enqueue(plan, p, stream);
}

bool LtGemm::try_run(const GemmProblem& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0 || p.k == 0) return false;  // nothing the caller could rely on gets written
  Plan& plan = plan_for(p);
  if (!plan.found) return false;
  enqueue(plan, p, stream);
  return true;
}

// ------------------------------------------------------------------------------------------------ variants

// The process-wide variants: the defaults of dense.h, except that NOPAD_GELU_GEMM=0|1, NOPAD_DGELU_GEMM=0|1,
// NOPAD_QKV_BIAS_IN_ATTENTION=0|1 and NOPAD_ATTN_PREP_GEMM=0|1 set gelu_gemm / dgelu_gemm / qkv_bias_in_attention /
// attention_prep_gemm, and NOPAD_LN_FWD_STAGES / NOPAD_LN_BWD_STAGES = 0|2|3|4 pick the residual LayerNorm's
// forward / backward kernel (the pipelined row-group kernel with that many stages; 0: the forward's default, the
// backward's register-prefetch row-group kernel), NOPAD_LN_FWD_WARP_PIPE=0|1 the warp-per-row forward without / with
// its pipeline (so one build can time the model both ways, scripts/bench.sh VARIANT_RUNS). A malformed value stops
// the run with a message.
namespace {
int ln_stages_from_env(const char* name) {
  const char* e = std::getenv(name);
  const std::string_view s = e != nullptr ? std::string_view(e) : std::string_view();
  NOPAD_CHECK(s == "0" || s == "2" || s == "3" || s == "4", name, "=", s,
              ": expected 0 (see ops/cuda/dense.cu) or 2, 3, 4 (pipeline stages of the pipelined LayerNorm kernel)");
  return s[0] - '0';
}
}  // namespace
KernelVariants& kernel_variants() {
  static KernelVariants v = [] {
    KernelVariants k;
    if (std::getenv("NOPAD_LN_FWD_STAGES") != nullptr) {
      const int stages = ln_stages_from_env("NOPAD_LN_FWD_STAGES");
      if (stages != 0) k.ln_forward = LnVariant{true, 1, 0, stages};
    }
    if (const char* e = std::getenv("NOPAD_LN_FWD_WARP_PIPE"))  // 0: the warp-per-row kernel without the pipeline
      k.ln_forward = LnVariant{false, 0, 0, std::string_view(e) != "0" ? 2 : 0};
    if (std::getenv("NOPAD_LN_BWD_STAGES") != nullptr) {
      const int stages = ln_stages_from_env("NOPAD_LN_BWD_STAGES");
      k.ln_backward = LnVariant{true, 1, 0, stages};  // 0: the register-prefetch row-group kernel
    }
    if (const char* e = std::getenv("NOPAD_GELU_GEMM")) k.gelu_gemm = std::string_view(e) != "0";
    if (const char* e = std::getenv("NOPAD_DGELU_GEMM")) k.dgelu_gemm = std::string_view(e) != "0";
    if (const char* e = std::getenv("NOPAD_QKV_BIAS_IN_ATTENTION")) k.qkv_bias_in_attention = std::string_view(e) != "0";
    if (const char* e = std::getenv("NOPAD_ATTN_PREP_GEMM")) k.attention_prep_gemm = std::string_view(e) != "0";
    return k;
  }();
  return v;
}
GeluPath& last_gelu_path() {
  static GeluPath path = GeluPath::kKernel;
  return path;
}
BiasGradPath& last_bias_grad_path() {
  static BiasGradPath path = BiasGradPath::kSeparate;
  return path;
}
bool& last_attention_output_fused() {
  static bool fused = false;
  return fused;
}

// ------------------------------------------------------------------------------------------------ elementwise

namespace {

constexpr int kThreads = 256;

// First implementation: one 16-byte vector per thread per grid-stride step, scalar tail (or all scalar when the
// pointers are not 16-byte aligned). pre_grad holds pre on entry and gelu'(pre) on exit; y = gelu(pre).
template <class T, bool kTanh>
__global__ void gelu_forward_kernel(T* __restrict__ pre_grad, T* __restrict__ y, int64_t count, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < count / 8; i += stride) {
      float v[8], g[8];
      load8(pre_grad + i * 8, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = gelu_and_grad_fn<kTanh>(v[e], g[e]);
      store8(y + i * 8, v);
      store8(pre_grad + i * 8, g);
    }
    i = count / 8 * 8 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // tail
  }
  for (; i < count; i += stride) {
    float g;
    y[i] = from_f32<T>(gelu_and_grad_fn<kTanh>(to_f32(pre_grad[i]), g));
    pre_grad[i] = from_f32<T>(g);
  }
}

// Wide: a thread owns kWideVecs vectors spaced one block apart (each warp access stays 512 contiguous bytes) and
// issues all their loads before the first erf, so 64 bytes per thread are in flight while it computes. The pass is
// then limited by memory, not by the latency of one load followed by ~200 instructions of erf. Pointers 16-byte
// aligned; the count % 8 tail is done by block 0.
constexpr int kWideVecs = 4;
template <class T, bool kTanh>
__global__ void __launch_bounds__(kThreads) gelu_forward_wide_kernel(T* __restrict__ pre_grad, T* __restrict__ y,
                                                                     int64_t count) {
  const int64_t nvec = count / 8;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kWideVecs + threadIdx.x;
  Vec8<T> in[kWideVecs];
#pragma unroll
  for (int u = 0; u < kWideVecs; ++u)
    if (base + u * kThreads < nvec) in[u] = ld16(pre_grad + (base + u * kThreads) * 8);
#pragma unroll
  for (int u = 0; u < kWideVecs; ++u) {
    if (base + u * kThreads >= nvec) continue;
    Vec8<T> out, grad;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const float2 f = to_f32x2(in[u].h[h]);
      float ga, gb;
      const float ya = gelu_and_grad_fn<kTanh>(f.x, ga), yb = gelu_and_grad_fn<kTanh>(f.y, gb);
      out.h[h] = from_f32x2<T>(ya, yb);
      grad.h[h] = from_f32x2<T>(ga, gb);
    }
    st16(y + (base + u * kThreads) * 8, out);
    st16(pre_grad + (base + u * kThreads) * 8, grad);
  }
  if (blockIdx.x == 0 && threadIdx.x < count - nvec * 8) {
    const int64_t i = nvec * 8 + threadIdx.x;
    float g;
    y[i] = from_f32<T>(gelu_and_grad_fn<kTanh>(to_f32(pre_grad[i]), g));
    pre_grad[i] = from_f32<T>(g);
  }
}

// out = dy * scale elementwise (the backward of a saved activation derivative).
template <class T>
__global__ void scale_kernel(const T* __restrict__ dy, const T* __restrict__ scale, T* __restrict__ out,
                             int64_t count, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    for (; i < count / 8; i += stride) {
      float d[8], g[8];
      load8(dy + i * 8, d);
      load8(scale + i * 8, g);
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] *= g[e];
      store8(out + i * 8, d);
    }
    i = count / 8 * 8 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  for (; i < count; i += stride) out[i] = from_f32<T>(to_f32(dy[i]) * to_f32(scale[i]));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int elementwise_blocks(int64_t count) {
  // Grid-stride loops: enough blocks to fill the GPU many times over, capped so huge tensors loop.
  return static_cast<int>(std::clamp<int64_t>((count / 8 + kThreads - 1) / kThreads, 1, 65536));
}

// partial[c][j] = sum over rows of chunk c of m[r][j]; rows in a fixed order.
template <class T>
__global__ void column_sum_partial_kernel(const T* __restrict__ m, int64_t rows, int32_t n, int64_t ld,
                                          int64_t rows_per_chunk, float* __restrict__ partial) {
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) s += to_f32(m[r * ld + j]);
  partial[static_cast<int64_t>(blockIdx.y) * n + j] = s;
}

// The one-pass d_bias kernel over a [rows, n] matrix (n % 8 == 0, 16-byte aligned): block (strip, chunk) covers
// columns [256 strip, 256 strip + 256) and rows [kGradRowsPerChunk chunk, ...). Warp w of the block reads rows
// r0 + w, r0 + w + 8, ... (512 contiguous bytes per warp and row; kGradUnroll rows' loads issued together), lane l owns
// columns 8l..8l+7 of the strip. kScale: dpre = dy * scale is written (16-bit). kColSum: each thread sums its
// columns of dpre before the 16-bit rounding (the twin sums its fp32 dpre) over its rows in increasing order, then the
// block adds its 8 warps in warp order into partial[chunk][j]: a fixed order for a given rows and n.
constexpr int kGradCols = 256, kGradWarps = 8, kGradUnroll = 4, kGradRowsPerChunk = 128;
template <class T, bool kScale, bool kColSum>
__global__ void __launch_bounds__(kGradWarps * 32) dense_grad_pass_kernel(const T* __restrict__ dy,
                                                                          const T* __restrict__ scale,
                                                                          T* __restrict__ dpre, int64_t rows,
                                                                          int32_t n, float* __restrict__ partial) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int32_t j0 = blockIdx.x * kGradCols + lane * 8;
  const bool active = j0 < n;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kGradRowsPerChunk;
  const int64_t r1 = r0 + kGradRowsPerChunk < rows ? r0 + kGradRowsPerChunk : rows;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int64_t r = r0 + warp; r < r1; r += kGradWarps * kGradUnroll) {
    Vec8<T> d[kGradUnroll], x[kGradUnroll];
#pragma unroll
    for (int u = 0; u < kGradUnroll; ++u) {
      const int64_t rr = r + u * kGradWarps;
      if (active && rr < r1) {
        d[u] = ld16(dy + rr * n + j0);
        if constexpr (kScale) x[u] = ld16(scale + rr * n + j0);
      }
    }
#pragma unroll
    for (int u = 0; u < kGradUnroll; ++u) {
      const int64_t rr = r + u * kGradWarps;
      if (!(active && rr < r1)) continue;
      float v[8];
      unpack8(d[u], v);
      if constexpr (kScale) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const float2 f = to_f32x2(x[u].h[h]);
          v[2 * h] *= f.x;
          v[2 * h + 1] *= f.y;
        }
        store8(dpre + rr * n + j0, v);
      }
      if constexpr (kColSum) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += v[i];
      }
    }
  }
  if constexpr (kColSum) {
    __shared__ float red[kGradWarps][kGradCols];
#pragma unroll
    for (int i = 0; i < 8; ++i) red[warp][lane * 8 + i] = acc[i];
    __syncthreads();
    const int32_t j = blockIdx.x * kGradCols + threadIdx.x;  // blockDim.x == kGradCols
    if (j < n) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kGradWarps; ++w) s += red[w][threadIdx.x];
      partial[static_cast<int64_t>(blockIdx.y) * n + j] = s;
    }
  }
}

}  // namespace

template <class T, bool kTanh>
void gelu_forward_impl(T* pre_grad, T* y, int64_t count, bool wide, cudaStream_t stream) {
  if (wide && aligned16(pre_grad) && aligned16(y)) {
    const int64_t blocks = std::max<int64_t>(1, (count / 8 + kThreads * kWideVecs - 1) / (kThreads * kWideVecs));
    NOPAD_CHECK(blocks <= 0x7fffffff, "GELU forward over ", count, " elements: too many blocks");
    gelu_forward_wide_kernel<T, kTanh><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(pre_grad, y, count);
  } else {
    gelu_forward_kernel<T, kTanh><<<elementwise_blocks(count), kThreads, 0, stream>>>(
        pre_grad, y, count, aligned16(pre_grad) && aligned16(y));
  }
}

template <class T>
void launch_gelu_forward(T* pre_grad, T* y, int64_t count, bool wide, bool tanh, cudaStream_t stream) {
  if (count <= 0) return;
  if (tanh)
    gelu_forward_impl<T, true>(pre_grad, y, count, wide, stream);
  else
    gelu_forward_impl<T, false>(pre_grad, y, count, wide, stream);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_scale(const T* dy, const T* scale, T* out, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  const bool vec = aligned16(dy) && aligned16(scale) && aligned16(out);
  scale_kernel<T><<<elementwise_blocks(count), kThreads, 0, stream>>>(dy, scale, out, count, vec);
  NOPAD_CUDA_CHECK_LAUNCH();
}

int column_sum_chunks(int64_t rows) {
  // ~64 rows per chunk, at most 256 chunks: the second stage then reads at most 256 partials per column.
  return static_cast<int>(std::clamp<int64_t>((rows + 63) / 64, 1, 256));
}

template <class T>
void launch_column_sum_partial(const T* m, int64_t rows, int32_t n, int64_t ld, int chunks, float* partial,
                               cudaStream_t stream) {
  if (n <= 0) return;
  NOPAD_CHECK(ld >= n, "column sums: row stride ", ld, " below the row length ", n);
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  const dim3 grid(static_cast<unsigned>(ceil_div(n, kThreads)), static_cast<unsigned>(chunks));
  column_sum_partial_kernel<T><<<grid, kThreads, 0, stream>>>(m, rows, n, ld, rows_per_chunk, partial);
  NOPAD_CUDA_CHECK_LAUNCH();
}

bool dense_grad_pass_supported(int32_t n, const void* dy, const void* pre, const void* dpre) {
  return n > 0 && n % 8 == 0 && aligned16(dy) && (pre == nullptr || aligned16(pre)) &&
         (dpre == nullptr || aligned16(dpre));
}

int dense_grad_chunks(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, ceil_div(rows, kGradRowsPerChunk)));
}

template <class T>
void launch_dense_grad_pass(const T* dy, const T* scale, T* dpre, int64_t rows, int32_t n, float* partial,
                            cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  NOPAD_CHECK(dense_grad_pass_supported(n, dy, scale, dpre), "dense gradient pass needs n % 8 == 0 (got ", n,
              ") and 16-byte aligned pointers");
  NOPAD_CHECK((scale == nullptr) == (dpre == nullptr), "dense gradient pass: scale and dpre go together");
  const int chunks = dense_grad_chunks(rows);
  NOPAD_CHECK(chunks <= 65535, "dense gradient pass over ", rows, " rows: more than 65535 row chunks");
  const dim3 grid(static_cast<unsigned>(ceil_div(n, kGradCols)), static_cast<unsigned>(chunks));
  constexpr int kT = kGradWarps * 32;
  if (scale && partial)
    dense_grad_pass_kernel<T, true, true><<<grid, kT, 0, stream>>>(dy, scale, dpre, rows, n, partial);
  else if (scale)
    dense_grad_pass_kernel<T, true, false><<<grid, kT, 0, stream>>>(dy, scale, dpre, rows, n, nullptr);
  else if (partial)
    dense_grad_pass_kernel<T, false, true><<<grid, kT, 0, stream>>>(dy, nullptr, nullptr, rows, n, partial);
  else
    return;  // nothing asked for
  NOPAD_CUDA_CHECK_LAUNCH();
}

// The launchers of both element types.
#define NOPAD_DENSE_INSTANTIATE(T)                                                                                \
  template void launch_gelu_forward<T>(T*, T*, int64_t, bool, bool, cudaStream_t);                                \
  template void launch_scale<T>(const T*, const T*, T*, int64_t, cudaStream_t);                                   \
  template void launch_column_sum_partial<T>(const T*, int64_t, int32_t, int64_t, int, float*, cudaStream_t);     \
  template void launch_dense_grad_pass<T>(const T*, const T*, T*, int64_t, int32_t, float*, cudaStream_t);
NOPAD_DENSE_INSTANTIATE(bf)
NOPAD_DENSE_INSTANTIATE(hf)
#undef NOPAD_DENSE_INSTANTIATE

}  // namespace nopad::cuda
