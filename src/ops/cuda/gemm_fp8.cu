// FP8 products through cuBLASLt: see gemm_fp8.h (layouts, which operands are transposed copies, scales, epilogues,
// accumulation). The CPU twin is in tests/cuda/test_fp8.cu (decoded fp8 inputs multiplied in double).
#include "ops/cuda/gemm_fp8.h"

#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/check.h"

namespace nopad::cuda {
namespace {

cudaDataType_t cuda_type(Fp8Format f) { return f == Fp8Format::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// Largest power of two (<= 256) dividing the address: what the heuristic may assume about the pointer.
uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

void check_aligned(const void* p, const char* product, const char* name) {
  NOPAD_CHECK(p != nullptr, "FP8 ", product, ": ", name, " is missing");
  NOPAD_CHECK(alignment_of(p) >= 16, "FP8 ", product, ": ", name, " is not 16-byte aligned (address % 16 = ",
              reinterpret_cast<uintptr_t>(p) % 16, "); cuBLASLt's FP8 kernels need 16-byte-aligned matrices");
}
// cuBLASLt refuses FP8 products (CUBLAS_STATUS_NOT_SUPPORTED from every candidate algorithm) whose scale pointers
// lie at 4-byte offsets of one array, and runs them with each pointer 256-byte aligned (as cudaMalloc gives and
// Fp8Scalings keeps them; docs/fp8.md). Refused here with the reason rather than as "not supported".
void check_scale_aligned(const float* p, const char* product, const char* name) {
  NOPAD_CHECK(reinterpret_cast<uintptr_t>(p) % 256 == 0, "FP8 ", product, ": ", name, " is not 256-byte aligned "
              "(address % 256 = ", reinterpret_cast<uintptr_t>(p) % 256, "); cuBLASLt refuses FP8 scale pointers at "
              "small offsets of one array: keep each scale on its own 256 bytes (Fp8Scalings::scale_inv does)");
}
void check_multiple(int64_t v, int64_t of, const char* product, const char* name, const char* why) {
  NOPAD_CHECK(v % of == 0, "FP8 ", product, ": ", name, " = ", v, " is not a multiple of ", of, " (", why, ")");
}
void check_formats(Fp8Format a, Fp8Format b, const char* product) {
  NOPAD_CHECK(!(a == Fp8Format::kE5M2 && b == Fp8Format::kE5M2), "FP8 ", product,
              ": both operands are E5M2, which cuBLASLt does not multiply (use E4M3 for the forward tensors)");
}
constexpr const char* kLd = "FP8 operands need leading dimensions that are multiples of 16";
constexpr const char* kOut = "the output's rows must be 16-byte multiples";

}  // namespace

Fp8Gemm::Fp8Gemm() {
  int device = 0;
  NOPAD_CUDA_CHECK(cudaGetDevice(&device));
  NOPAD_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
  NOPAD_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
  NOPAD_CUBLAS_CHECK(cublasLtCreate(&handle_));
  workspace_ = cuda_malloc_or_throw(kWorkspaceBytes, "the FP8 cuBLASLt workspace");
}

Fp8Gemm::~Fp8Gemm() {
  for (auto& [key, plan] : plans_) {  // statuses ignored: destructors do not throw
    (void)key;
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.d) cublasLtMatrixLayoutDestroy(plan.d);
    if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

void Fp8Gemm::check_supported(const char* what) const {
  NOPAD_CHECK(supported(), "FP8 ", what, ": this GPU has compute capability ", cc_major_, ".", cc_minor_,
              "; FP8 tensor-core products need 8.9 or newer (Ada, Hopper); use the bf16 products (ops/cuda/dense.h)");
}

bool Fp8Gemm::heuristic_has(cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                            cublasLtMatrixLayout_t d, const std::array<uint32_t, 3>& alignments,
                            cublasLtMatmulAlgo_t* algo) {
  cublasLtMatmulPreference_t pref = nullptr;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  // The real pointer alignments (the default assumption is 256 bytes), as dense.cu tells the bf16 heuristic.
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i) {
    const uint32_t al = alignments[static_cast<size_t>(i < 3 ? i : 2)];
    st = cublasLtMatmulPreferenceSetAttribute(pref, attrs[i], &al, sizeof al);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(handle_, desc, a, b, d, d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED (an unsupported combination) and INVALID_VALUE (an attribute this type combination rejects) both
  // mean "no algorithm" here; anything else is an error.
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) return false;
  if (st != CUBLAS_STATUS_SUCCESS) throw_cublas_error(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
  if (algo) *algo = result.algo;
  return true;
}

Fp8Gemm::Plan& Fp8Gemm::plan_for(const Problem& p) {
  const Key key = {p.a_type, p.b_type, p.d_type, p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.bias != nullptr,
                   p.beta != 0.0f, p.fast_accum, alignment_of(p.a), alignment_of(p.b), alignment_of(p.d)};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;

  // A new problem: descriptors and the heuristic's algorithm, once per shape (this allocates).
  Plan plan;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;  // TN: both operands K-major
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  const int8_t fast = p.fast_accum ? 1 : 0;
  NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
  // The scale pointers are per call, but the heuristic must know the product is scaled: set them now too.
  NOPAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.a_scale, sizeof p.a_scale));
  NOPAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.b_scale, sizeof p.b_scale));
  if (p.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    NOPAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                                      sizeof bias_type));
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  }
  // Stored shapes, column-major: A is [K, m] (transposed), B is [K, n], D is [m, n].
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, p.a_type, p.k, p.m, p.lda));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, p.b_type, p.k, p.n, p.ldb));
  NOPAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, p.d_type, p.m, p.n, p.ldd));
  plan.found = heuristic_has(plan.desc, plan.a, plan.b, plan.d,
                             {alignment_of(p.a), alignment_of(p.b), alignment_of(p.d)}, &plan.algo);
  if (!plan.found) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.d);
    cublasLtMatmulDescDestroy(plan.desc);
    plan = Plan{};
  }
  return plans_.emplace(key, plan).first->second;
}

void Fp8Gemm::run(const Problem& p, cudaStream_t stream) {
  Plan& plan = plan_for(p);
  if (!plan.found)
    fail("FP8 ", p.what, ": cuBLASLt has no algorithm for m=", p.m, " n=", p.n, " K=", p.k, " (lda ", p.lda, ", ldb ",
         p.ldb, ", ldd ", p.ldd, ", A ", p.a_type == CUDA_R_8F_E4M3 ? "E4M3" : "E5M2", ", B ",
         p.b_type == CUDA_R_8F_E4M3 ? "E4M3" : "E5M2", ", D ", p.d_type == CUDA_R_32F ? "fp32" : "bf16", ", bias ",
         p.bias != nullptr, ", beta ", p.beta, ", fast accumulation ", p.fast_accum, ")");
  NOPAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.a_scale, sizeof p.a_scale));
  NOPAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.b_scale, sizeof p.b_scale));
  if (p.bias)
    NOPAD_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof p.bias));
  const float alpha = 1.0f, beta = p.beta;
  NOPAD_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.desc, &alpha, p.a, plan.a, p.b, plan.b, &beta, p.d, plan.d, p.d,
                                    plan.d, &plan.algo, workspace_, kWorkspaceBytes, stream));
}

void Fp8Gemm::forward(const Fp8ForwardArgs& a, cudaStream_t stream) {
  const char* what = "forward (y = x W^T)";
  NOPAD_CHECK(a.rows >= 0 && a.n > 0 && a.k > 0, "FP8 ", what, ": bad shape rows=", a.rows, " n=", a.n, " k=", a.k);
  check_formats(a.w_format, a.x_format, what);
  check_multiple(a.k, 16, what, "k", kLd);
  check_multiple(a.n, 8, what, "n", kOut);
  NOPAD_CHECK(a.x_scale_inv && a.w_scale_inv, "FP8 ", what, ": a scale_inv pointer is missing");
  check_scale_aligned(a.x_scale_inv, what, "x_scale_inv");
  check_scale_aligned(a.w_scale_inv, what, "w_scale_inv");
  if (a.rows == 0) return;
  check_aligned(a.x, what, "x");
  check_aligned(a.w, what, "W");
  check_aligned(a.y, what, "y");
  if (a.bias) check_aligned(a.bias, what, "the bias");
  check_supported(what);
  Problem p;
  p.what = what;
  p.a_type = cuda_type(a.w_format);
  p.b_type = cuda_type(a.x_format);
  p.d_type = CUDA_R_16BF;
  p.m = a.n;
  p.n = a.rows;
  p.k = a.k;
  p.lda = a.k;
  p.ldb = a.k;
  p.ldd = a.n;
  p.a = a.w;
  p.b = a.x;
  p.d = a.y;
  p.a_scale = a.w_scale_inv;
  p.b_scale = a.x_scale_inv;
  p.bias = a.bias;
  p.beta = a.beta;
  p.fast_accum = a.fast_accum;
  run(p, stream);
}

void Fp8Gemm::dgrad(const Fp8DgradArgs& a, cudaStream_t stream) {
  const char* what = "data gradient (dx = dy W)";
  NOPAD_CHECK(a.rows >= 0 && a.n > 0 && a.k > 0, "FP8 ", what, ": bad shape rows=", a.rows, " n=", a.n, " k=", a.k);
  check_formats(a.w_format, a.dy_format, what);
  check_multiple(a.n, 16, what, "n (the reduction)", kLd);
  check_multiple(a.k, 8, what, "k", kOut);
  NOPAD_CHECK(a.dy_scale_inv && a.w_scale_inv, "FP8 ", what, ": a scale_inv pointer is missing");
  check_scale_aligned(a.dy_scale_inv, what, "dy_scale_inv");
  check_scale_aligned(a.w_scale_inv, what, "w_scale_inv");
  if (a.rows == 0) return;
  check_aligned(a.dy, what, "dy");
  check_aligned(a.w_t, what, "the transposed copy of W");
  check_aligned(a.dx, what, "dx");
  check_supported(what);
  Problem p;
  p.what = what;
  p.a_type = cuda_type(a.w_format);
  p.b_type = cuda_type(a.dy_format);
  p.d_type = CUDA_R_16BF;
  p.m = a.k;
  p.n = a.rows;
  p.k = a.n;
  p.lda = a.n;
  p.ldb = a.n;
  p.ldd = a.k;
  p.a = a.w_t;
  p.b = a.dy;
  p.d = a.dx;
  p.a_scale = a.w_scale_inv;
  p.b_scale = a.dy_scale_inv;
  p.beta = a.beta;
  p.fast_accum = a.fast_accum;
  run(p, stream);
}

void Fp8Gemm::wgrad(const Fp8WgradArgs& a, cudaStream_t stream) {
  const char* what = "weight gradient (dW = dy^T x)";
  NOPAD_CHECK(a.rows >= 0 && a.n > 0 && a.k > 0, "FP8 ", what, ": bad shape rows=", a.rows, " n=", a.n, " k=", a.k);
  check_formats(a.x_format, a.dy_format, what);
  NOPAD_CHECK(a.ld_t >= a.rows, "FP8 ", what, ": the copies' leading dimension ", a.ld_t, " is below rows = ", a.rows);
  check_multiple(a.ld_t, 16, what, "ld_t (the copies' padded row count)", kLd);
  check_multiple(a.k, 4, what, "k", kOut);
  NOPAD_CHECK(a.dy_scale_inv && a.x_scale_inv, "FP8 ", what, ": a scale_inv pointer is missing");
  check_scale_aligned(a.dy_scale_inv, what, "dy_scale_inv");
  check_scale_aligned(a.x_scale_inv, what, "x_scale_inv");
  if (a.ld_t == 0) {  // no rows: dW = beta dW
    NOPAD_CHECK(a.beta == 1.0f, "FP8 ", what, ": no rows with beta = ", a.beta, " would leave dW unscaled");
    return;
  }
  check_aligned(a.x_t, what, "the transposed copy of x");
  check_aligned(a.dy_t, what, "the transposed copy of dy");
  check_aligned(a.dw, what, "dW");
  check_supported(what);
  Problem p;
  p.what = what;
  p.a_type = cuda_type(a.x_format);
  p.b_type = cuda_type(a.dy_format);
  p.d_type = CUDA_R_32F;
  p.m = a.k;
  p.n = a.n;
  p.k = a.ld_t;
  p.lda = a.ld_t;
  p.ldb = a.ld_t;
  p.ldd = a.k;
  p.a = a.x_t;
  p.b = a.dy_t;
  p.d = a.dw;
  p.a_scale = a.x_scale_inv;
  p.b_scale = a.dy_scale_inv;
  p.beta = a.beta;
  p.fast_accum = a.fast_accum;
  run(p, stream);
}

std::vector<Fp8Gemm::EpilogueSupport> Fp8Gemm::probe_epilogues(int64_t m, int64_t n, int64_t k) {
  check_supported("epilogue probe");
  struct Epi {
    const char* name;
    cublasLtEpilogue_t epi;
    bool bias, aux;
  };
  const Epi epis[] = {{"DEFAULT", CUBLASLT_EPILOGUE_DEFAULT, false, false},
                      {"BIAS", CUBLASLT_EPILOGUE_BIAS, true, false},
                      {"GELU", CUBLASLT_EPILOGUE_GELU, false, false},
                      {"GELU_BIAS", CUBLASLT_EPILOGUE_GELU_BIAS, true, false},
                      {"GELU_AUX", CUBLASLT_EPILOGUE_GELU_AUX, false, true},
                      {"GELU_AUX_BIAS", CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, true},
                      {"DGELU", CUBLASLT_EPILOGUE_DGELU, false, true},
                      {"DGELU_BGRAD", CUBLASLT_EPILOGUE_DGELU_BGRAD, true, true},
                      {"BGRADA", CUBLASLT_EPILOGUE_BGRADA, true, false},
                      {"BGRADB", CUBLASLT_EPILOGUE_BGRADB, true, false}};
  struct Types {
    cudaDataType_t a, b, d;
  };
  const Types types[] = {{CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF},
                         {CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_16BF},
                         {CUDA_R_8F_E4M3, CUDA_R_8F_E5M2, CUDA_R_32F}};
  // The heuristic reads no data: the workspace stands in for every pointer (256-byte aligned).
  const void* fake = workspace_;
  std::vector<EpilogueSupport> out;
  for (const Epi& e : epis) {
    EpilogueSupport s;
    s.name = e.name;
    for (int t = 0; t < 3; ++t) {
      cublasLtMatmulDesc_t desc = nullptr;
      cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
      NOPAD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      bool ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
                    CUBLAS_STATUS_SUCCESS &&
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
                    CUBLAS_STATUS_SUCCESS &&
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &fake, sizeof fake) ==
                    CUBLAS_STATUS_SUCCESS &&
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &fake, sizeof fake) ==
                    CUBLAS_STATUS_SUCCESS &&
                cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e.epi, sizeof e.epi) ==
                    CUBLAS_STATUS_SUCCESS;
      if (ok && e.bias) {
        const cudaDataType_t bias_type = CUDA_R_16BF;
        ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type) ==
                 CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &fake, sizeof fake) ==
                 CUBLAS_STATUS_SUCCESS;
      }
      if (ok && e.aux) {
        const int64_t aux_ld = m;
        const cudaDataType_t aux_type = CUDA_R_16BF;
        ok = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &fake, sizeof fake) ==
                 CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld) ==
                 CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type,
                                            sizeof aux_type) == CUBLAS_STATUS_SUCCESS;
      }
      if (ok)
        ok = cublasLtMatrixLayoutCreate(&la, types[t].a, k, m, k) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatrixLayoutCreate(&lb, types[t].b, k, n, k) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatrixLayoutCreate(&ld, types[t].d, m, n, m) == CUBLAS_STATUS_SUCCESS;
      try {
        if (ok) ok = heuristic_has(desc, la, lb, ld, {256, 256, 256}, nullptr);
      } catch (const Error&) {
        ok = false;  // any refusal of the combination counts as "not offered"
      }
      if (la) cublasLtMatrixLayoutDestroy(la);
      if (lb) cublasLtMatrixLayoutDestroy(lb);
      if (ld) cublasLtMatrixLayoutDestroy(ld);
      cublasLtMatmulDescDestroy(desc);
      (t == 0 ? s.e4m3_e4m3_bf16 : t == 1 ? s.e4m3_e5m2_bf16 : s.e4m3_e5m2_fp32) = ok;
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace nopad::cuda
