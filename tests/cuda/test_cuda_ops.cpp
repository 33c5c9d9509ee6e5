// Every op of the CUDA backend (ops/cuda) against its CPU twin CpuBackend<CpuF32> (ops/cpu), for both 16-bit
// policies: every CudaOps test is a typed test over the element type (CudaOps/bf16.* runs CudaBackend = GpuBf16,
// CudaOps/f16.* runs CudaBackendF16 = GpuF16). Inputs are drawn on the host, rounded to the type under test, and the
// same rounded values go to both backends, so the only differences left are the GPU's 16-bit outputs/intermediates
// and fp32 summation order. GPU outputs are poisoned (0xFF bytes = NaN) before each op, so an element the op forgot to
// write shows up as NaN. Comparisons are norm-relative, ||gpu - cpu|| / ||cpu||.
// Parameter gradients start from random nonzero values on both sides and the compared quantity is the change
// (after - before), which checks += semantics as well as the value. Dropout runs at p = 0 and p = 0.1: agreement at
// p = 0.1 proves the GPU draws the twin's masks.
// Needs a GPU (built as nopad_cuda_tests, not registered with CTest); run: build-cuda/nopad_cuda_tests.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_gelu.h"
#include "model/params.h"
#include "ops/cuda/check.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/dense.h"  // KernelVariants: which implementation of each memory-bound op runs
#include "ops/cuda/fmha.h"   // kFmhaLog2e
#include "ops/cuda/gemm_sm90.h"
#include "ops/gelu_table.h"

namespace nopad {
namespace {

using Cpu = ops::CpuBackend<ops::CpuF32>;
using Vec = std::vector<float>;

// Tolerances (norm-relative), per element type H. Rounding one value to bf16 (8 significant bits) has relative error
// <= 2^-8 (~4e-3), rms ~1e-3 over many values; fp16 (11 significant bits) <= 2^-11 (~5e-4), 8x smaller. The bf16
// values:
//  kTolOut:  one 16-bit rounding of an fp32 result (LayerNorm outputs, GEMM outputs with fp32 accumulation): the norm
//            ratio sits near 1e-3; 1e-2 leaves room for fp32 order differences and the odd larger element.
//  kTolChain: two or three 16-bit roundings in a chain (GELU on the rounded pre-activation, dx through a rounded dpre,
//            backward through 16-bit d_logits): a few 1e-3 each, so 2e-2.
//  kTolDeep: longer chains (attention gradients through 16-bit P and dS, head gradients through d_logits, dz, dpre
//            and the rounded d_hidden, softmax of 16-bit logits rounded again): 3e-2.
//  kTolGrad: fp32 parameter grads whose GEMM operands are 16-bit-rounded intermediates: errors average out over the
//            reduction, ~1e-3; 1e-2.
// fp16's are a quarter of these: its rounding errors are 8x smaller, so this keeps twice bf16's margin over the
// expected error. kTolF32 (gradients computed in fp32 from identical inputs: embedding/LayerNorm parameter grads,
// only summation order differs, ~1e-6; 1e-3 allows for the atomics' varying order) does not depend on the type.
template <class H>
constexpr double kTypeFactor = std::is_same_v<H, f16> ? 0.25 : 1.0;
template <class H>
constexpr double kTolOut = 1e-2 * kTypeFactor<H>;
template <class H>
constexpr double kTolChain = 2e-2 * kTypeFactor<H>;
template <class H>
constexpr double kTolDeep = 3e-2 * kTypeFactor<H>;
template <class H>
constexpr double kTolGrad = 1e-2 * kTypeFactor<H>;
constexpr double kTolF32 = 1e-3;

// The MLM head's loss scale in its test: fp16 training scales the loss (train.loss_scale) so that d_logits = scale *
// (probs - onehot) / M stays in fp16's normal range (unscaled, the ~3e-5 / M of a non-label logit would be an fp16
// subnormal); 4096 is a typical dynamic scale. bf16 has fp32's range and runs unscaled, as in training.
template <class H>
constexpr double kHeadLossScale = std::is_same_v<H, f16> ? 4096.0 : 1.0;

template <class H>
using PolicyOf = std::conditional_t<std::is_same_v<H, f16>, ops::GpuF16, ops::GpuBf16>;
template <class H>
using Gpu = cuda::CudaBackendT<PolicyOf<H>>;

template <class H>
Gpu<H>& gpu() {
  static Gpu<H> g(0);
  return g;
}
Cpu& cpu() {
  static Cpu c(0);
  return c;
}

// The test under way: the stream of the backend it runs (every upload, poison and download below is ordered on it, so
// the ops see them in order) and the tag its perf lines carry.
struct Current {
  cudaStream_t stream = nullptr;
  const char* perf_tag = "";
};
Current& current() {
  static Current c;
  return c;
}
template <class H>
void use_backend() {
  current().stream = gpu<H>().stream();
  current().perf_tag = std::is_same_v<H, f16> ? " [fp16]" : "";
}

// Element-type names for the typed suites: CudaOps/bf16.*, CudaOps/f16.*.
struct ElemName {
  template <class H>
  static std::string GetName(int) {
    return std::is_same_v<H, f16> ? "f16" : "bf16";
  }
};
using ElemTypes = ::testing::Types<bf16, f16>;

// A device buffer of n elements, freed at scope end.
template <class T>
struct DBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DBuf(size_t count) : n(count) {
    p = static_cast<T*>(cuda::cuda_malloc_or_throw(std::max<size_t>(n, 1) * sizeof(T), "a test buffer"));
  }
  ~DBuf() { (void)cudaFree(p); }
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  void poison() {  // 0xFF bytes: NaN in bf16, fp16 and fp32, -1 in int32
    ASSERT_EQ(cudaMemsetAsync(p, 0xFF, n * sizeof(T), current().stream), cudaSuccess);
  }
};

template <class T>
constexpr bool kIs16 = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// n values uniform in [lo, hi), rounded to H (so that the CPU twin computes on exactly the GPU's inputs).
template <class H>
Vec rand_vec(Rng& rng, size_t n, float lo, float hi) {
  Vec v(n);
  for (auto& x : v) x = to_float(convert<H>(static_cast<float>(lo + (hi - lo) * rng.uniform())));
  return v;
}
template <class T>
std::unique_ptr<DBuf<T>> up(const std::vector<T>& v) {
  auto d = std::make_unique<DBuf<T>>(v.size());
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpyAsync(d->p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, current().stream),
              cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(current().stream), cudaSuccess);  // v may go out of scope
  return d;
}
template <class H>
std::unique_ptr<DBuf<H>> up16(const Vec& v) {
  std::vector<H> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = convert<H>(v[i]);
  return up(h);
}
// 16-bit buffers come back as floats, everything else as itself.
template <class T>
auto down(const DBuf<T>& d) {
  std::vector<T> h(d.n);
  if (d.n) {
    EXPECT_EQ(cudaMemcpyAsync(h.data(), d.p, d.n * sizeof(T), cudaMemcpyDeviceToHost, current().stream), cudaSuccess);
  }
  EXPECT_EQ(cudaStreamSynchronize(current().stream), cudaSuccess);
  if constexpr (kIs16<T>) {
    Vec v(d.n);
    for (size_t i = 0; i < d.n; ++i) v[i] = to_float(h[i]);
    return v;
  } else {
    return h;
  }
}
Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

// ||gpu - cpu|| / ||cpu|| below tol, and no NaN anywhere in the GPU result.
void expect_close(const std::string& what, const Vec& g, const Vec& c, double tol) {
  ASSERT_EQ(g.size(), c.size()) << what;
  double num = 0, den = 0;
  size_t nans = 0, first_nan = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i])) {
      if (nans++ == 0) first_nan = i;
      continue;
    }
    num += (double(g[i]) - c[i]) * (double(g[i]) - c[i]);
    den += double(c[i]) * c[i];
  }
  EXPECT_EQ(nans, 0u) << what << ": " << nans << " NaN elements (unwritten or invalid), first at " << first_nan;
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_LT(rel, tol) << what << ": relative error " << rel << " over " << g.size() << " elements";
  std::printf("    %-28s rel err %.3g (tol %.1e, %zu elements)\n", what.c_str(), rel, tol, g.size());
}

// A batch of sequences: lengths include the tile edges and the extremes, plus random ones.
struct Batch {
  std::vector<int32_t> cu{0};
  std::vector<uint64_t> ids;
  std::vector<int32_t> pos;  // position within the sequence of each row
  int32_t T = 0, B = 0, max_len = 0;
  std::unique_ptr<DBuf<int32_t>> d_cu;
  std::unique_ptr<DBuf<uint64_t>> d_ids;
  ops::SeqView host() const { return {T, B, max_len, cu.data(), ids.data()}; }
  ops::SeqView device() const { return {T, B, max_len, d_cu->p, d_ids->p}; }
};
Batch make_batch(Rng& rng, int extra_random = 4, int max_len = 512) {
  std::vector<int32_t> lens = {1, 2, 63, 64, 65, 127, 128, 129, 511, 512};
  lens.erase(std::remove_if(lens.begin(), lens.end(), [&](int32_t l) { return l > max_len; }), lens.end());
  for (int i = 0; i < extra_random; ++i) lens.push_back(static_cast<int32_t>(rng.uniform_int(1, max_len)));
  rng.shuffle(lens.begin(), lens.end());
  Batch b;
  for (int32_t l : lens) {
    b.cu.push_back(b.cu.back() + l);
    b.ids.push_back(rng.next_u64());
    for (int32_t i = 0; i < l; ++i) b.pos.push_back(i);
    b.max_len = std::max(b.max_len, l);
  }
  b.T = b.cu.back();
  b.B = static_cast<int32_t>(lens.size());
  b.d_cu = up(b.cu);
  b.d_ids = up(b.ids);
  return b;
}

ops::Dropout dropout(float p, uint32_t op_id) { return ops::Dropout{p, 1234567, 42, op_id}; }

// Fraction of exact zeros: with dropout after a LayerNorm (nonzero almost surely) this is the drop rate.
double zero_fraction(const Vec& v) {
  return static_cast<double>(std::count(v.begin(), v.end(), 0.0f)) / static_cast<double>(v.size());
}

// ------------------------------------------------------------------------------------------------ tests

TEST(CudaBackend, OutOfMemoryMessageNamesBytesAndFreeMemory) {
  use_backend<bf16>();
  const size_t pib = static_cast<size_t>(1) << 50;
  try {
    gpu<bf16>().allocate_bytes(pib);
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const Error& e) {
    const std::string msg = e.what();
    std::printf("    message: %s\n", msg.c_str());
    EXPECT_NE(msg.find("out of GPU memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(pib)), std::string::npos) << msg;
    EXPECT_NE(msg.find("free of"), std::string::npos) << msg;
  }
  // The failure must not poison later work.
  DBuf<float> ok(16);
  gpu<bf16>().zero_bytes(ok.p, 16 * sizeof(float));
  EXPECT_EQ(down(ok), std::vector<float>(16, 0.0f));
}

// ------------------------------------------------------------------------------------------------ kernel variants

// Sets the process-wide kernel variants (ops/cuda/dense.h) for a scope and restores the previous ones after.
struct VariantScope {
  cuda::KernelVariants saved = cuda::kernel_variants();
  explicit VariantScope(const cuda::KernelVariants& v) { cuda::kernel_variants() = v; }
  ~VariantScope() { cuda::kernel_variants() = saved; }
  VariantScope(const VariantScope&) = delete;
  VariantScope& operator=(const VariantScope&) = delete;
};

// One process-wide host switch (the gemm_sm90_* settings) set to a value for the scope's lifetime.
template <class T>
class SwitchScope {
 public:
  SwitchScope(T& sw, T value) : sw_(sw), saved_(std::exchange(sw, value)) {}
  ~SwitchScope() { sw_ = saved_; }
  SwitchScope(const SwitchScope&) = delete;
  SwitchScope& operator=(const SwitchScope&) = delete;

 private:
  T& sw_;
  T saved_;
};

// The first implementation of every memory-bound op (what the backend ran before the variants existed).
cuda::KernelVariants first_variants() {
  cuda::KernelVariants v;
  v.ln_forward = {false, 0, 0};
  v.ln_backward = {false, 0, 0};
  v.gelu_forward_wide = false;
  v.dense_bias_grad = cuda::BiasGradPath::kSeparate;
  v.softmax_ce_registers = false;
  v.ce_backward_rows = false;
  return v;
}

// LayerNorm implementations checked against the twin: the warp-per-row kernels, the row-group defaults, the other
// row-group shapes (16-byte vectors per thread 1/2/4 in the forward, 1/2 in the backward) and the pipelined residual
// kernels (row group 2-4 stages, warp-per-row forward) with grids of 1 and 2 blocks per SM, where each block walks
// many rows (long prefetch chains, sequence boundaries inside a block; the tiny batch gives blocks fewer rows than
// pipeline stages). The embedding LayerNorm runs the other kernels under a pipelined variant.
struct LnCase {
  const char* name;
  cuda::LnVariant fwd, bwd;
};
const LnCase kLnCases[] = {
    {"warp-per-row", {false, 0, 0}, {false, 0, 0}},
    {"row-group default", {true, 0, 0}, {true, 0, 0}},
    {"row-group fwd v1, bwd v2", {true, 1, 0}, {true, 2, 0}},
    {"row-group fwd v2, bwd v1, 1 block/SM", {true, 2, 1}, {true, 1, 1}},
    {"row-group fwd v4, bwd v2, 2 blocks/SM", {true, 4, 2}, {true, 2, 2}},
    {"pipelined, 4 stages", {true, 1, 0, 4}, {true, 1, 0, 4}},
    {"pipelined fwd 2 stages, bwd 3 stages, 1 block/SM", {true, 1, 1, 2}, {true, 1, 1, 3}},
    {"pipelined warp-per-row fwd, pipelined bwd 2 stages", {false, 0, 0, 2}, {true, 1, 0, 2}},
    {"pipelined warp-per-row fwd, 1 block/SM", {false, 0, 1, 2}, {true, 1, 2, 2}},
};
cuda::KernelVariants ln_variants(const LnCase& c) {
  cuda::KernelVariants v;
  v.ln_forward = c.fwd;
  v.ln_backward = c.bwd;
  return v;
}

// Batches: the usual mixed lengths (T in the thousands, not a multiple of any block's row count) and a tiny one
// (T < 10: fewer rows than blocks per SM, one row per block).
Batch make_ln_batch(Rng& rng, bool tiny) { return tiny ? make_batch(rng, 2, 3) : make_batch(rng); }

bool bitwise_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The op tests, once per element type (the fixture points the buffer helpers at that type's backend).
template <class E>
class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override { use_backend<E>(); }
};
TYPED_TEST_SUITE(CudaOps, ElemTypes, ElemName);

TYPED_TEST(CudaOps, EmbedLayerNormDropout) {
  using E = TypeParam;  // bf16 or f16
  for (int32_t H : {128, 1024})
    for (float p : {0.0f, 0.1f})
      for (bool tiny : {false, true}) {
        SCOPED_TRACE("H=" + std::to_string(H) + " p=" + std::to_string(p) + (tiny ? " tiny batch" : ""));
        Rng rng({11u, static_cast<uint64_t>(H), static_cast<uint64_t>(p * 10), tiny ? 1u : 0u});
        Batch b = make_ln_batch(rng, tiny);
        std::printf("  embed H=%d p=%.1f T=%d\n", H, p, b.T);
        const int32_t V = 1000, P = 512, S = 2, T = b.T;
        std::vector<int32_t> tok(T), seg(T);
        for (auto& t : tok) t = static_cast<int32_t>(rng.uniform_int(0, V - 1));
        // Segments as the loader makes them: a run of 0s then a run of 1s per sequence (the token-type gradient
        // is added per run), with a few random rows mixed in so that runs of length 1 occur too.
        for (int32_t s = 0; s < b.B; ++s) {
          const int32_t len = b.cu[s + 1] - b.cu[s], split = static_cast<int32_t>(rng.uniform_int(0, len));
          for (int32_t i = 0; i < len; ++i) seg[b.cu[s] + i] = i < split ? 0 : 1;
        }
        for (int i = 0; i < T / 50; ++i)
          seg[rng.uniform_int(0, T - 1)] = static_cast<int32_t>(rng.uniform_int(0, S - 1));
        Vec word = rand_vec<E>(rng, static_cast<size_t>(V) * H, -1, 1),
            posw = rand_vec<E>(rng, static_cast<size_t>(P) * H, -1, 1),
            type = rand_vec<E>(rng, static_cast<size_t>(S) * H, -1, 1), gamma = rand_vec<E>(rng, H, 0.5f, 1.5f),
            beta = rand_vec<E>(rng, H, -0.5f, 0.5f);
        auto d_tok = up(tok), d_pos = up(b.pos), d_seg = up(seg);
        auto d_word = up16<E>(word), d_posw = up16<E>(posw), d_type = up16<E>(type), d_gamma = up16<E>(gamma),
             d_beta = up16<E>(beta);
        ops::EmbeddingWeights<float> wc{word.data(), posw.data(), type.data(), gamma.data(), beta.data(), V, P, S, H,
                                        1e-12};
        ops::EmbeddingWeights<E> wg{d_word->p, d_posw->p, d_type->p, d_gamma->p, d_beta->p, V, P, S, H, 1e-12};
        const auto drop = dropout(p, 3);

        Vec out_c(static_cast<size_t>(T) * H), mean_c(T), rstd_c(T);
        cpu().embed_layernorm_dropout_forward(tok.data(), b.pos.data(), seg.data(), b.host(), wc, drop, out_c.data(),
                                              mean_c.data(), rstd_c.data());
        Vec dout = rand_vec<E>(rng, static_cast<size_t>(T) * H, -1, 1);
        auto d_dout = up16<E>(dout);
        Vec gw0 = rand_vec<E>(rng, word.size(), -1, 1), gp0 = rand_vec<E>(rng, posw.size(), -1, 1),
            gt0 = rand_vec<E>(rng, type.size(), -1, 1), gg0 = rand_vec<E>(rng, H, -1, 1), gb0 = rand_vec<E>(rng, H, -1, 1);
        Vec gw = gw0, gp = gp0, gt = gt0, gg = gg0, gb = gb0;
        cpu().embed_layernorm_dropout_backward(dout.data(), tok.data(), b.pos.data(), seg.data(), b.host(), wc, drop,
                                               mean_c.data(), rstd_c.data(),
                                               {gw.data(), gp.data(), gt.data(), gg.data(), gb.data()});

        for (const LnCase& lc : kLnCases) {
          SCOPED_TRACE(lc.name);
          std::printf("   [%s]\n", lc.name);
          VariantScope variants(ln_variants(lc));
          DBuf<E> out_g(static_cast<size_t>(T) * H);
          DBuf<float> mean_g(T), rstd_g(T);
          out_g.poison();
          mean_g.poison();
          rstd_g.poison();
          gpu<E>().embed_layernorm_dropout_forward(d_tok->p, d_pos->p, d_seg->p, b.device(), wg, drop, out_g.p,
                                                mean_g.p, rstd_g.p);
          const Vec out = down(out_g);
          expect_close("out", out, out_c, kTolOut<E>);
          expect_close("ln_mean", down(mean_g), mean_c, kTolF32);
          expect_close("ln_rstd", down(rstd_g), rstd_c, kTolF32);
          const double zf = zero_fraction(out);
          std::printf("    dropped fraction %.4f (p %.1f)\n", zf, p);
          if (!tiny) {
            EXPECT_NEAR(zf, p, 0.01) << "fraction of dropped elements";
          }

          // Backward: parameter grads start nonzero; compare the increments.
          auto dgw = up(gw0), dgp = up(gp0), dgt = up(gt0), dgg = up(gg0), dgb = up(gb0);
          gpu<E>().embed_layernorm_dropout_backward(d_dout->p, d_tok->p, d_pos->p, d_seg->p, b.device(), wg, drop,
                                                 mean_g.p, rstd_g.p, {dgw->p, dgp->p, dgt->p, dgg->p, dgb->p});
          expect_close("d_word (+=)", minus(down(*dgw), gw0), minus(gw, gw0), kTolF32);
          expect_close("d_position (+=)", minus(down(*dgp), gp0), minus(gp, gp0), kTolF32);
          expect_close("d_token_type (+=)", minus(down(*dgt), gt0), minus(gt, gt0), kTolF32);
          expect_close("d_ln_gamma (+=)", minus(down(*dgg), gg0), minus(gg, gg0), kTolF32);
          expect_close("d_ln_beta (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolF32);
        }
      }
}

TYPED_TEST(CudaOps, BiasDropoutResidualLayerNorm) {
  using E = TypeParam;  // bf16 or f16
  // subset: the view carries row_positions (the sparse last layer's rows, a subset of each sequence): positions
  // 2i + 1 instead of i, which only the dropout keys read, so it runs with dropout on.
  for (int32_t H : {128, 1024})
    for (float p : {0.0f, 0.1f})
      for (bool subset : {false, true})
        for (bool tiny : {false, true}) {
          if (subset && p == 0.0f) continue;
          SCOPED_TRACE("H=" + std::to_string(H) + " p=" + std::to_string(p) + (tiny ? " tiny batch" : "") +
                       (subset ? " row_positions" : ""));
          Rng rng({12u, static_cast<uint64_t>(H), static_cast<uint64_t>(p * 10), tiny ? 1u : 0u});
          Batch b = make_ln_batch(rng, tiny);
          std::printf("  residual LN H=%d p=%.1f T=%d%s\n", H, p, b.T, subset ? " (row_positions)" : "");
          std::vector<int32_t> row_pos(b.pos.size());
          for (size_t i = 0; i < row_pos.size(); ++i) row_pos[i] = 2 * b.pos[i] + 1;
          auto d_row_pos = up(row_pos);
          ops::SeqView host_view = b.host(), device_view = b.device();
          if (subset) {
            host_view.row_positions = row_pos.data();
            device_view.row_positions = d_row_pos->p;
          }
          const int32_t T = b.T;
          const size_t n = static_cast<size_t>(T) * H;
          Vec x = rand_vec<E>(rng, n, -2, 2), res = rand_vec<E>(rng, n, -1, 1), bias = rand_vec<E>(rng, H, -0.5f, 0.5f),
              gamma = rand_vec<E>(rng, H, 0.5f, 1.5f), beta = rand_vec<E>(rng, H, -0.5f, 0.5f);
          auto dx_in = up16<E>(x), dres = up16<E>(res), dbias = up16<E>(bias), dgamma = up16<E>(gamma),
               dbeta = up16<E>(beta);
          const auto drop = dropout(p, 7);
          Vec out_c(n), mean_c(T), rstd_c(T);
          cpu().bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(),
                                                        host_view, H, 1e-12, drop, out_c.data(), mean_c.data(),
                                                        rstd_c.data());
          Vec dout = rand_vec<E>(rng, n, -1, 1);
          auto d_dout = up16<E>(dout);
          Vec gbias0 = rand_vec<E>(rng, H, -1, 1), gg0 = rand_vec<E>(rng, H, -1, 1), gb0 = rand_vec<E>(rng, H, -1, 1);
          Vec gbias = gbias0, gg = gg0, gb = gb0, dx_c(n), dres_c(n);
          cpu().bias_dropout_residual_layernorm_backward(dout.data(), x.data(), bias.data(), res.data(), gamma.data(),
                                                         mean_c.data(), rstd_c.data(), host_view, H, drop, dx_c.data(),
                                                         dres_c.data(), gbias.data(), gg.data(), gb.data());

          for (const LnCase& lc : kLnCases) {
            SCOPED_TRACE(lc.name);
            std::printf("   [%s]\n", lc.name);
            VariantScope variants(ln_variants(lc));
            DBuf<E> out_g(n);
            DBuf<float> mean_g(T), rstd_g(T);
            out_g.poison();
            mean_g.poison();
            rstd_g.poison();
            gpu<E>().bias_dropout_residual_layernorm_forward(dx_in->p, dbias->p, dres->p, dgamma->p, dbeta->p,
                                                             device_view, H, 1e-12, drop, out_g.p, mean_g.p, rstd_g.p);
            expect_close("out", down(out_g), out_c, kTolOut<E>);
            expect_close("ln_mean", down(mean_g), mean_c, kTolF32);
            expect_close("ln_rstd", down(rstd_g), rstd_c, kTolF32);

            // Backward twice from the same starting values: the results must agree bit for bit (fixed orders).
            Vec runs[2][5];
            for (int run = 0; run < 2; ++run) {
              DBuf<E> dx_g(n), dres_g(n);
              dx_g.poison();
              dres_g.poison();
              auto dgbias = up(gbias0), dgg = up(gg0), dgb = up(gb0);
              gpu<E>().bias_dropout_residual_layernorm_backward(d_dout->p, dx_in->p, dbias->p, dres->p, dgamma->p,
                                                                mean_g.p, rstd_g.p, device_view, H, drop, dx_g.p,
                                                                dres_g.p, dgbias->p, dgg->p, dgb->p);
              runs[run][0] = down(dx_g);
              runs[run][1] = down(dres_g);
              runs[run][2] = down(*dgbias);
              runs[run][3] = down(*dgg);
              runs[run][4] = down(*dgb);
            }
            const Vec& dx = runs[0][0];
            expect_close("d_x", dx, dx_c, kTolOut<E>);
            expect_close("d_residual", runs[0][1], dres_c, kTolOut<E>);
            expect_close("d_bias (+=)", minus(runs[0][2], gbias0), minus(gbias, gbias0), kTolF32);
            expect_close("d_ln_gamma (+=)", minus(runs[0][3], gg0), minus(gg, gg0), kTolF32);
            expect_close("d_ln_beta (+=)", minus(runs[0][4], gb0), minus(gb, gb0), kTolF32);
            const char* names[5] = {"d_x", "d_residual", "d_bias", "d_ln_gamma", "d_ln_beta"};
            for (int i = 0; i < 5; ++i)
              EXPECT_TRUE(bitwise_equal(runs[0][i], runs[1][i])) << names[i] << " differs between two runs";
            if (!tiny) {
              EXPECT_NEAR(zero_fraction(dx), p, 0.01) << "fraction of dropped elements in d_x";
            }
          }
        }
}

// gather_rows / scatter_rows (the sparse last layer's row moves) against the CPU twin: gather and scatter are exact
// copies; the accumulating scatter adds in fp32 and rounds once, i.e. the twin's float sum rounded to E. Rows not
// scattered keep their values; the gathered buffer is poisoned first.
TYPED_TEST(CudaOps, GatherScatterRows) {
  using E = TypeParam;
  for (int32_t H : {128, 1024}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    Rng rng({31u, static_cast<uint64_t>(H)});
    const int32_t T = 5000;
    std::vector<int32_t> rows;
    for (int32_t t = 0; t < T; ++t)
      if (t == 0 || t == T - 1 || rng.uniform() < 0.16) rows.push_back(t);
    rng.shuffle(rows.begin(), rows.end());
    const int32_t N = static_cast<int32_t>(rows.size());
    const size_t n_src = static_cast<size_t>(T) * H, n_rows = static_cast<size_t>(N) * H;
    const Vec src = rand_vec<E>(rng, n_src, -2, 2), dst0 = rand_vec<E>(rng, n_src, -2, 2);
    auto d_src = up16<E>(src), d_rows = up(rows);
    DBuf<E> gathered(n_rows);
    gathered.poison();
    gpu<E>().gather_rows(d_src->p, T, d_rows->p, N, H, gathered.p);
    Vec g_c(n_rows);
    cpu().gather_rows(src.data(), T, rows.data(), N, H, g_c.data());
    const Vec g_g = down(gathered);
    EXPECT_TRUE(bitwise_equal(g_g, g_c)) << "gathered rows differ from the source rows";
    for (const bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "scatter +=" : "scatter =");
      auto d_dst = up16<E>(dst0);
      gpu<E>().scatter_rows(gathered.p, d_rows->p, N, H, d_dst->p, T, accumulate);
      Vec c = dst0;
      cpu().scatter_rows(g_c.data(), rows.data(), N, H, c.data(), T, accumulate);
      for (float& x : c) x = to_float(convert<E>(x));  // the GPU rounds the float sum to E once
      const Vec g = down(*d_dst);
      size_t diff = 0;
      for (size_t i = 0; i < n_src; ++i) diff += !(g[i] == c[i]);
      EXPECT_EQ(diff, 0u) << "elements differing from the CPU twin";
      size_t changed = 0;
      for (size_t i = 0; i < n_src; ++i) changed += g[i] != dst0[i];
      EXPECT_GT(changed, n_rows / 2) << "the scatter wrote too little";
    }
  }
}

struct DenseCase {
  int64_t rows;
  int32_t k, n;
  ops::Activation act;
  bool bias, accumulate_dx;
};

const char* path_name(cuda::BiasGradPath p) {
  switch (p) {
    case cuda::BiasGradPath::kSeparate: return "separate";
    case cuda::BiasGradPath::kOnePass: return "one-pass";
    case cuda::BiasGradPath::kEpilogue: return "epilogue";
  }
  return "?";
}

// Every d_bias path (separate passes, one pass, cuBLASLt BGRADB epilogue) and both GELU forward kernels, on shapes
// that include BERT-large's (FFN 1024 -> 4096 with GELU, QKV 1024 -> 3072, FFN-out 4096 -> 1024), row counts that are
// not multiples of the one-pass kernel's 8-row steps or 128-row chunks, and n % 8 != 0 (the paths that need n % 8 == 0
// fall back; which path ran is checked).
TYPED_TEST(CudaOps, Dense) {
  using E = TypeParam;  // bf16 or f16
  const DenseCase cases[] = {
      {1, 128, 128, ops::Activation::kNone, true, false},     {2, 128, 384, ops::Activation::kGelu, true, false},
      {63, 1024, 1024, ops::Activation::kNone, false, true},  {129, 1024, 4096, ops::Activation::kGelu, true, false},
      {511, 4096, 1024, ops::Activation::kNone, true, true},  {1000, 128, 2, ops::Activation::kNone, true, false},
      {77, 128, 1003, ops::Activation::kNone, true, false},   {300, 1024, 3072, ops::Activation::kNone, true, false},
      {1001, 1024, 4096, ops::Activation::kGelu, true, false}, {33, 64, 100, ops::Activation::kGelu, true, false},
      // The tanh GELU (n = 100: the cuBLASLt product and the kernel on every path).
      {2, 128, 384, ops::Activation::kGeluTanh, true, false}, {1001, 1024, 4096, ops::Activation::kGeluTanh, true, true},
      {33, 64, 100, ops::Activation::kGeluTanh, true, false},
  };
  for (const auto& c : cases) {
    const bool gelu = c.act != ops::Activation::kNone, tanh = c.act == ops::Activation::kGeluTanh;
    const std::string tag = "rows=" + std::to_string(c.rows) + " k=" + std::to_string(c.k) +
                            " n=" + std::to_string(c.n) + (tanh ? " gelu_tanh" : gelu ? " gelu" : "") +
                            (c.bias ? " bias" : "") +
                            (c.accumulate_dx ? " accumulate_dx" : "");
    SCOPED_TRACE(tag);
    std::printf("  dense %s\n", tag.c_str());
    Rng rng({13u, static_cast<uint64_t>(c.rows), static_cast<uint64_t>(c.n)});
    const float ws = 1.0f / std::sqrt(static_cast<float>(c.k));
    Vec x = rand_vec<E>(rng, c.rows * c.k, -1, 1), w = rand_vec<E>(rng, size_t(c.n) * c.k, -2 * ws, 2 * ws),
        bias = rand_vec<E>(rng, c.n, -0.5f, 0.5f);
    auto dx_in = up16<E>(x), dw = up16<E>(w), dbias = up16<E>(bias);
    Vec y_c(c.rows * c.n), grad_c(c.rows * c.n);
    cpu().dense_forward(x.data(), w.data(), c.bias ? bias.data() : nullptr, c.rows, c.k, c.n, c.act, y_c.data(),
                        grad_c.data());
    Vec dy = rand_vec<E>(rng, c.rows * c.n, -1, 1);
    auto d_dy = up16<E>(dy);
    Vec dx0 = c.accumulate_dx ? rand_vec<E>(rng, c.rows * c.k, -1, 1) : Vec(c.rows * c.k, 0.0f);
    Vec gw0 = rand_vec<E>(rng, w.size(), -1, 1), gb0 = rand_vec<E>(rng, c.n, -1, 1);
    Vec dx_c = dx0, gw = gw0, gb = gb0;
    cpu().dense_backward(dy.data(), x.data(), w.data(), grad_c.data(), c.rows, c.k, c.n, c.act, dx_c.data(),
                         c.accumulate_dx, gw.data(), gb.data());

    for (const cuda::BiasGradPath path :
         {cuda::BiasGradPath::kSeparate, cuda::BiasGradPath::kOnePass, cuda::BiasGradPath::kEpilogue}) {
      cuda::KernelVariants v;
      v.dense_bias_grad = path;
      v.gelu_forward_wide = path != cuda::BiasGradPath::kSeparate;  // both GELU forward kernels get checked
      v.gelu_gemm = path != cuda::BiasGradPath::kSeparate;          // and the cuBLASLt path beside nopad's GEMM
      VariantScope variants(v);
      SCOPED_TRACE(path_name(path));
      DBuf<E> y_g(c.rows * c.n), grad_g(c.rows * c.n);
      y_g.poison();
      grad_g.poison();
      // nopad's GEMM exactly where it applies; the path marker starts at the other value, so it must be written.
      const bool sm90 = gelu && v.gelu_gemm && cuda::gemm_sm90_available() && c.n % 256 == 0 && c.k % 64 == 0;
      cuda::last_gelu_path() = sm90 ? cuda::GeluPath::kKernel : cuda::GeluPath::kGemmSm90;
      gpu<E>().dense_forward(dx_in->p, dw->p, c.bias ? dbias->p : nullptr, c.rows, c.k, c.n, c.act, y_g.p,
                          gelu ? grad_g.p : nullptr);
      const cuda::GeluPath fwd_gelu = cuda::last_gelu_path();
      if (gelu) {
        EXPECT_EQ(fwd_gelu == cuda::GeluPath::kGemmSm90, sm90);
      }
      // The GPU's backward reads what its forward saved (its 16-bit gelu'), the CPU's its own.
      DBuf<E> dx_g(c.rows * c.k);
      if (c.accumulate_dx) {
        auto tmp = up16<E>(dx0);
        ASSERT_EQ(cudaMemcpyAsync(dx_g.p, tmp->p, dx_g.n * sizeof(E), cudaMemcpyDeviceToDevice, gpu<E>().stream()),
                  cudaSuccess);
      } else {
        dx_g.poison();
      }
      auto dgw = up(gw0), dgb = up(gb0);
      gpu<E>().dense_backward(d_dy->p, dx_in->p, dw->p, gelu ? grad_g.p : nullptr, c.rows, c.k, c.n, c.act, dx_g.p,
                           c.accumulate_dx, dgw->p, dgb->p);
      const cuda::BiasGradPath ran = cuda::last_bias_grad_path();
      std::printf("   [d_bias: %s requested, %s ran; GELU forward %s]\n", path_name(path), path_name(ran),
                  !gelu                                   ? "-"
                  : fwd_gelu == cuda::GeluPath::kGemmSm90 ? "nopad GEMM epilogue"
                  : v.gelu_forward_wide                   ? "wide kernel"
                                                          : "first kernel");
      expect_close("y", down(y_g), y_c, gelu ? kTolChain<E> : kTolOut<E>);
      // gelu' of the 16-bit pre-activation, rounded: two roundings against the CPU's fp32 chain.
      if (gelu) expect_close("act_grad", down(grad_g), grad_c, kTolChain<E>);
      expect_close(c.accumulate_dx ? "dx (+=)" : "dx", down(dx_g), dx_c, gelu ? kTolChain<E> : kTolOut<E>);
      expect_close("d_weight (+=)", minus(down(*dgw), gw0), minus(gw, gw0), kTolGrad<E>);
      expect_close("d_bias (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolGrad<E>);
      // Which path ran: the requested one where it applies, else the documented fallback.
      const cuda::BiasGradPath fallback = c.n % 8 == 0 ? cuda::BiasGradPath::kOnePass : cuda::BiasGradPath::kSeparate;
      if (path == cuda::BiasGradPath::kSeparate) {
        EXPECT_EQ(ran, cuda::BiasGradPath::kSeparate);
      } else if (path == cuda::BiasGradPath::kOnePass) {
        EXPECT_EQ(ran, fallback);
      } else if (ran != cuda::BiasGradPath::kEpilogue) {
        EXPECT_EQ(ran, fallback) << "epilogue fallback";
      }
    }
  }
}

const char* gelu_path_name(cuda::GeluPath p) {
  switch (p) {
    case cuda::GeluPath::kKernel: return "kernels";
    case cuda::GeluPath::kGemmSm90: return "nopad GEMM epilogue";
  }
  return "?";
}

// dense_backward_through_act (the FFN output layer's backward with the intermediate GELU's saved derivative folded in)
// against the CPU twin: nopad's GEMM epilogue and the kernel path, BERT-large's FFN shape, shapes nopad's GEMM does not
// take, and k % 8 != 0 (no one-pass kernel). Which path ran is printed and checked.
TYPED_TEST(CudaOps, DenseBackwardThroughAct) {
  using E = TypeParam;  // bf16 or f16
  struct Case {
    int64_t rows;
    int32_t k, n;  // x [rows, k] = act(x_pre), W [n, k]
    ops::Activation act;
  };
  const Case cases[] = {{129, 4096, 1024, ops::Activation::kGeluTanh}, {1001, 4096, 1024, ops::Activation::kGeluTanh},
                        {129, 4096, 1024, ops::Activation::kGelu},     {2, 384, 128, ops::Activation::kGelu},
                        {33, 100, 64, ops::Activation::kGeluTanh},     {7, 256, 128, ops::Activation::kGeluTanh},
                        {1, 256, 64, ops::Activation::kGelu},          {300, 768, 192, ops::Activation::kGelu}};
  for (const Case& c : cases) {
    const bool tanh = c.act == ops::Activation::kGeluTanh;
    const std::string tag = "rows=" + std::to_string(c.rows) + " k=" + std::to_string(c.k) + " n=" +
                            std::to_string(c.n) + (tanh ? " gelu_tanh" : " gelu");
    SCOPED_TRACE(tag);
    Rng rng({29u, static_cast<uint64_t>(c.rows), static_cast<uint64_t>(c.k)});
    const float ws = 1.0f / std::sqrt(static_cast<float>(c.k));
    // x_grad: the saved GELU derivative, in gelu''s range [-0.17, 1.13].
    Vec x = rand_vec<E>(rng, c.rows * c.k, -1, 1), x_grad = rand_vec<E>(rng, c.rows * c.k, -0.17f, 1.13f),
        w = rand_vec<E>(rng, size_t(c.n) * c.k, -2 * ws, 2 * ws), dy = rand_vec<E>(rng, c.rows * c.n, -1, 1);
    Vec gw0 = rand_vec<E>(rng, w.size(), -1, 1), gb0 = rand_vec<E>(rng, c.k, -1, 1);
    Vec dx_c(c.rows * c.k), gw = gw0, gb = gb0;
    cpu().dense_backward_through_act(dy.data(), x.data(), x_grad.data(), w.data(), c.rows, c.k, c.n, c.act,
                                     dx_c.data(), gw.data(), gb.data());
    auto d_x = up16<E>(x), d_grad = up16<E>(x_grad), d_w = up16<E>(w), d_dy = up16<E>(dy);
    for (const bool gemm : {true, false}) {
      cuda::KernelVariants v;
      v.dgelu_gemm = gemm;
      VariantScope variants(v);
      const bool sm90 = gemm && cuda::gemm_sm90_available() && c.k % 256 == 0 && c.n % 64 == 0;
      DBuf<E> dx_g(c.rows * c.k);
      dx_g.poison();
      auto dgw = up(gw0), dgb = up(gb0);
      // The path marker starts at the other value, so it must be written.
      cuda::last_gelu_path() = sm90 ? cuda::GeluPath::kKernel : cuda::GeluPath::kGemmSm90;
      gpu<E>().dense_backward_through_act(d_dy->p, d_x->p, d_grad->p, d_w->p, c.rows, c.k, c.n, c.act, dx_g.p, dgw->p,
                                          dgb->p);
      const cuda::GeluPath ran = cuda::last_gelu_path();
      std::printf("  dense_backward_through_act %s, nopad GEMM %s: %s\n", tag.c_str(), gemm ? "on" : "off",
                  gelu_path_name(ran));
      EXPECT_EQ(ran, sm90 ? cuda::GeluPath::kGemmSm90 : cuda::GeluPath::kKernel);
      expect_close("dx_pre", down(dx_g), dx_c, kTolChain<E>);
      expect_close("d_weight (+=)", minus(down(*dgw), gw0), minus(gw, gw0), kTolGrad<E>);
      expect_close("d_x_bias (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolGrad<E>);
    }
  }
}

// nopad's sm_90a GEMM on its own (gemm_sm90.h) against a CPU evaluation of its contract (products in double, then the
// kernel's sequence of 16-bit roundings): every epilogue and both GELUs, row counts around the 128-row tile and the
// consumers' 64-row halves, one to three 256-column tiles, 1 to 16 k-blocks (fewer and more than the ring's stages).
// Outputs get 3 extra rows, all poisoned: the rows past m must stay untouched; the column partials of every 128-row
// chunk must all be written and equal the chunk's sums of the unrounded scaled values. The reference products run on
// all the host's cores (a few GFLOP in double).
TYPED_TEST(CudaOps, GemmSm90Epilogues) {
  using E = TypeParam;  // bf16 or f16
  using D = std::conditional_t<std::is_same_v<E, f16>, __half, __nv_bfloat16>;
  if (!cuda::gemm_sm90_available()) GTEST_SKIP() << "needs the sm_90a build on a compute-capability 9.0 GPU";
  struct Case {
    int64_t m;
    int32_t n, k;
    float bias_range = 0.5f;
  };
  // The last two have more tiles than an H100 or H200 has SMs (200 and 144): CTAs take 2-3 tiles, so the deferred
  // epilogue work of one tile runs inside the next tile's main loop (the others only reach the final flush). The
  // wide-bias case puts pre-activations beyond the GELU table's |x| < 16 in most chunks (its other end, |x| < 2^-12,
  // occurs in every case at random).
  const Case cases[] = {{1, 256, 64},    {63, 256, 128},   {64, 512, 64},    {65, 256, 192},
                        {127, 768, 64},  {128, 256, 1024}, {129, 512, 256},  {1000, 256, 320},
                        {12800, 512, 256}, {4500, 1024, 1024}, {700, 512, 128, 24.0f}};
  auto r16 = [](double x) { return to_float(convert<E>(static_cast<float>(x))); };
  // The CPU twin's activations, in double
  auto gelu = [](double x, bool tanh) { return tanh ? ops::cpu::gelu_tanh(x) : ops::cpu::gelu(x); };
  auto gelu_grad = [](double x, bool tanh) { return tanh ? ops::cpu::gelu_tanh_grad(x) : ops::cpu::gelu_grad(x); };
  for (const Case& c : cases) {
    const std::string tag = "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                            (c.bias_range != 0.5f ? " bias +-" + std::to_string(c.bias_range) : "");
    SCOPED_TRACE(tag);
    std::printf("  gemm_sm90 %s\n", tag.c_str());
    Rng rng({31u, static_cast<uint64_t>(c.m), static_cast<uint64_t>(c.n), static_cast<uint64_t>(c.k)});
    const float ws = 2.0f / std::sqrt(static_cast<float>(c.k));
    const size_t mn = static_cast<size_t>(c.m) * c.n, padded = mn + size_t{3} * c.n;
    Vec a = rand_vec<E>(rng, size_t(c.m) * c.k, -1, 1), b = rand_vec<E>(rng, size_t(c.n) * c.k, -ws, ws),
        bias = rand_vec<E>(rng, c.n, -c.bias_range, c.bias_range), aux = rand_vec<E>(rng, mn, -0.17f, 1.13f);
    std::vector<double> acc(mn);
    {
      const int nthreads = std::max(1u, std::thread::hardware_concurrency());
      std::vector<std::thread> pool;
      for (int th = 0; th < nthreads; ++th)
        pool.emplace_back([&, th] {
          for (int64_t r = th; r < c.m; r += nthreads)
            for (int32_t j = 0; j < c.n; ++j) {
              double s = 0;
              for (int32_t q = 0; q < c.k; ++q) s += double(a[r * c.k + q]) * b[size_t(j) * c.k + q];
              acc[r * c.n + j] = s;
            }
        });
      for (auto& th : pool) th.join();
    }
    auto da = up16<E>(a), db = up16<E>(b), dbias = up16<E>(bias), daux = up16<E>(aux);
    const int chunks = cuda::gemm_sm90_row_chunks(c.m);
    EXPECT_EQ(chunks, (c.m + 63) / 64);
    DBuf<E> out0(padded), out1(padded);
    DBuf<float> partial(size_t(chunks) * c.n);
    auto dev = [](auto* p) { return reinterpret_cast<D*>(p); };
    auto cdev = [](const auto* p) { return reinterpret_cast<const D*>(p); };
    // Rows < m against `want`, rows >= m still poisoned.
    auto check = [&](const char* what, const DBuf<E>& buf, const Vec& want, double tol) {
      Vec got = down(buf);
      size_t written_past = 0;
      for (size_t i = mn; i < padded; ++i) written_past += !std::isnan(got[i]);
      EXPECT_EQ(written_past, 0u) << what << ": rows past m were written";
      got.resize(mn);
      expect_close(what, got, want, tol);
    };
    for (const bool tanh : {false, true}) {
      SCOPED_TRACE(tanh ? "tanh GELU" : "erf GELU");
      // kBias (tanh is irrelevant to it: run once)
      if (!tanh) {
        Vec want(mn);
        for (size_t i = 0; i < mn; ++i) want[i] = r16(acc[i] + bias[i % c.n]);
        out0.poison();
        cuda::launch_gemm_sm90<D>(cuda::GemmEpilogue::kBias, cdev(da->p), cdev(db->p), c.m, c.n, c.k,
                                  cdev(dbias->p), dev(out0.p), nullptr, nullptr, nullptr, false, gpu<E>().multiprocessors(),
                                  current().stream);
        check("bias: out", out0, want, kTolOut<E>);
      }
      {  // kGelu: gelu' and gelu of the 16-bit pre-activation
        Vec grad(mn), y(mn);
        for (size_t i = 0; i < mn; ++i) {
          const double pre = r16(acc[i] + bias[i % c.n]);
          grad[i] = r16(gelu_grad(pre, tanh));
          y[i] = r16(gelu(pre, tanh));
        }
        // The consumers' share of the GELU (0 to 4 box columns per tile), the stage release before or
        // after that share (gemm_sm90_early_release), and with bf16 the lookup table or the arithmetic GELU.
        // With the table, some configurations compute the last arith_words words of each 8-column chunk
        // arithmetically (gemm_sm90_gelu_arith_words).
        struct Config {
          int columns;
          bool early, table;
          int arith_words = 0;
        };
        const std::vector<Config> configs =
            std::is_same_v<E, bf16>
                ? std::vector<Config>{{0, true, true},  {1, true, true},  {1, false, true}, {2, true, true},
                                      {3, true, true},  {4, true, true},  {4, false, true}, {0, true, false},
                                      {1, true, false}, {4, true, false}, {0, true, true, 2}, {2, true, true, 1},
                                      {2, true, true, 2}, {2, true, true, 4}}
                : std::vector<Config>{{0, true, false}, {1, true, false}, {1, false, false}, {2, true, false},
                                      {4, true, false}};
        for (const Config& cf : configs) {
          SCOPED_TRACE("consumer columns " + std::to_string(cf.columns) + (cf.early ? ", early" : ", late") +
                       " stage release" + (cf.table ? ", table" : ", arithmetic") + ", arithmetic words " +
                       std::to_string(cf.arith_words));
          const SwitchScope columns(cuda::gemm_sm90_consumer_columns(), cf.columns);
          const SwitchScope early(cuda::gemm_sm90_early_release(), cf.early);
          const SwitchScope table(cuda::gemm_sm90_gelu_table(), cf.table);
          const SwitchScope arith_words(cuda::gemm_sm90_gelu_arith_words(), cf.arith_words);
          out0.poison();
          out1.poison();
          cuda::launch_gemm_sm90<D>(cuda::GemmEpilogue::kGelu, cdev(da->p), cdev(db->p), c.m, c.n, c.k,
                                    cdev(dbias->p), dev(out0.p), dev(out1.p), nullptr, nullptr, tanh,
                                    gpu<E>().multiprocessors(), current().stream);
          check("gelu: act_grad", out0, grad, kTolChain<E>);
          check("gelu: y", out1, y, kTolChain<E>);
        }
      }
      if (!tanh) {  // kScale with column partials (no activation of its own: run once)
        Vec dpre(mn), sums(size_t(chunks) * c.n, 0.0f);
        std::vector<double> sums_d(sums.size(), 0.0);
        for (size_t i = 0; i < mn; ++i) {
          const double v = double(r16(acc[i])) * aux[i];
          dpre[i] = r16(v);
          sums_d[(i / c.n) / 64 * c.n + i % c.n] += v;
        }
        for (size_t i = 0; i < sums.size(); ++i) sums[i] = static_cast<float>(sums_d[i]);
        // Stage release before / after the aux load; the aux load half-way (-1), at the first k-block, past the
        // last (clamped to it).
        struct Order {
          bool early;
          int aux_kb;
        };
        for (const Order o : {Order{true, -1}, Order{false, -1}, Order{true, 0}, Order{true, 1000}}) {
          SCOPED_TRACE(std::string(o.early ? "early" : "late") + " stage release, aux k-block " +
                       std::to_string(o.aux_kb));
          const SwitchScope early(cuda::gemm_sm90_early_release(), o.early);
          const SwitchScope aux_kb(cuda::gemm_sm90_aux_kblock(), o.aux_kb);
          out0.poison();
          partial.poison();
          cuda::launch_gemm_sm90<D>(cuda::GemmEpilogue::kScale, cdev(da->p), cdev(db->p), c.m, c.n, c.k, nullptr,
                                    dev(out0.p), nullptr, cdev(daux->p), partial.p, false, gpu<E>().multiprocessors(),
                                    current().stream);
          check("scale: dpre", out0, dpre, kTolChain<E>);
          expect_close("scale: column partials", down(partial), sums, kTolOut<E>);
        }
      }
      if (!tanh) {  // kRowDot: out0 = round(acc), rowdot = per-64-column-box row dots with aux, and the side jobs
        Vec want(mn);
        for (size_t i = 0; i < mn; ++i) want[i] = r16(acc[i]);
        const int64_t ld = c.m + 5;  // rows m .. ld - 1 of each box's slot must stay poisoned
        const int boxes = c.n / 64;
        const float scale = 0.8984375f;  // the FMHA's D scale at dropout 0.1: 230 / 256
        DBuf<float> rowdot(size_t(boxes) * ld);
        // Side jobs: zero 16-byte vectors inside a poisoned buffer (offset 16 bytes, so both ends are checked) and
        // dst = src * log2(e) over a count that is not a multiple of anything.
        const size_t zero_vec = 37 + size_t(c.m) % 101, mul_count = 777 + size_t(c.m) % 13;
        DBuf<float> zbuf(4 * zero_vec + 12), mdst(mul_count + 9);
        Vec msrc_h(mul_count);
        for (auto& x : msrc_h) x = static_cast<float>(-20.0 + 40.0 * rng.uniform());
        auto msrc = up(msrc_h);
        cuda::GemmSideJobs jobs;
        jobs.zero = zbuf.p + 4;
        jobs.zero_bytes = 16 * zero_vec;
        jobs.mul_src = msrc->p;
        jobs.mul_dst = mdst.p;
        jobs.mul_count = static_cast<int64_t>(mul_count);
        jobs.mul_by = cuda::kFmhaLog2e;
        for (const int aux_kb : {-1, 0, 1000}) {
          SCOPED_TRACE("rowdot, aux k-block " + std::to_string(aux_kb));
          const SwitchScope aux_k(cuda::gemm_sm90_aux_kblock(), aux_kb);
          out0.poison();
          rowdot.poison();
          zbuf.poison();
          mdst.poison();
          cuda::launch_gemm_sm90_rowdot<D>(cdev(da->p), cdev(db->p), c.m, c.n, c.k, dev(out0.p), cdev(daux->p),
                                           rowdot.p, ld, scale, jobs, gpu<E>().multiprocessors(), current().stream);
          check("rowdot: out", out0, want, kTolChain<E>);
          // The dots against the stored output itself (so that only the fp32 summation order is left): within 1e-5
          // of the sum of the terms' magnitudes.
          const Vec out = down(out0), got = down(rowdot);
          size_t bad = 0, unwritten = 0, written_past = 0;
          for (int bx = 0; bx < boxes; ++bx)
            for (int64_t r = 0; r < ld; ++r) {
              const float v = got[size_t(bx) * ld + r];
              if (r >= c.m) {
                written_past += !std::isnan(v);
                continue;
              }
              double dot = 0, mag = 0;
              for (int j = 0; j < 64; ++j) {
                const size_t i = size_t(r) * c.n + 64 * bx + j;
                dot += double(out[i]) * aux[i];
                mag += std::fabs(double(out[i]) * aux[i]);
              }
              if (std::isnan(v)) {
                ++unwritten;
              } else if (std::fabs(v - dot * scale) > 1e-5 * mag * scale + 1e-30) {
                if (bad++ < 3)
                  ADD_FAILURE() << "rowdot box " << bx << " row " << r << ": " << v << " vs " << dot * scale;
              }
            }
          EXPECT_EQ(bad, 0u) << "rowdot values off";
          EXPECT_EQ(unwritten, 0u) << "rowdot entries left unwritten";
          EXPECT_EQ(written_past, 0u) << "rowdot entries past m written";
          const Vec z = down(zbuf), md = down(mdst);
          size_t zero_bad = 0, mul_bad = 0;
          for (size_t i = 0; i < z.size(); ++i) {
            const bool inside = i >= 4 && i < 4 + 4 * zero_vec;
            zero_bad += inside ? z[i] != 0.0f || std::signbit(z[i]) : !std::isnan(z[i]);
          }
          for (size_t i = 0; i < md.size(); ++i)
            mul_bad += i < mul_count ? md[i] != msrc_h[i] * cuda::kFmhaLog2e : !std::isnan(md[i]);
          EXPECT_EQ(zero_bad, 0u) << "side job: the zero range (or past it)";
          EXPECT_EQ(mul_bad, 0u) << "side job: dst = src * c (or past it)";
        }
      }
    }
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// The bf16 GELU epilogue on every bf16 pre-activation, bit for bit: with A one-hot (row r has 1 at column r) and no
// bias, the product is exact and pre(r, j) = B[j][r], so B can hold every 16-bit pattern once (256 x 256; NaN and Inf
// patterns replaced by 0, which would otherwise poison whole columns through 0 x Inf). Inside the table's range
// (2^-12 <= |pre| < 16) y and gelu' must be the table's correctly rounded values exactly; outside it (the arithmetic
// GELU) within one bf16 step of the exact values, or below 1e-30 in magnitude. Two layouts: pattern r * 256 + j (a
// row holds one sign and two binades, so whole warps fall inside the range and take the all-table path) and
// j * 256 + r (most chunks straddle the range: the per-element mixed path). Table and arithmetic GELU, erf and tanh,
// the consumers' share 0 to 4 box columns; with the table also 1, 2 and 4 arithmetic words per 8-column chunk
// (gemm_sm90_gelu_arith_words: those elements are held to the arithmetic forms' tolerance, and the count of those that
// differ from the correctly rounded table entry is printed).
TEST(CudaGemmSm90, GeluEpilogueOnEveryBf16Input) {
  using E = bf16;
  using D = __nv_bfloat16;
  use_backend<E>();
  if (!cuda::gemm_sm90_available()) GTEST_SKIP() << "needs the sm_90a build on a compute-capability 9.0 GPU";
  constexpr int kN = 256;
  std::vector<E> a(kN * kN, E{0});
  for (int r = 0; r < kN; ++r) a[r * kN + r] = convert<E>(1.0f);
  auto da = up(a);
  DBuf<E> out0(kN * kN), out1(kN * kN);
  auto usable = [](uint16_t h) { return (h & 0x7F80u) != 0x7F80u; };  // finite
  for (const bool by_row : {true, false}) {
    auto pattern = [&](int r, int j) { return static_cast<uint16_t>(by_row ? r * kN + j : j * kN + r); };
    std::vector<E> b(kN * kN);  // b[j][q]: pre(r, j) = b[j][r]
    for (int j = 0; j < kN; ++j)
      for (int r = 0; r < kN; ++r) b[j * kN + r] = E{usable(pattern(r, j)) ? pattern(r, j) : uint16_t{0}};
    auto db = up(b);
    for (const bool tanh : {false, true}) {
      const std::vector<uint32_t> table = ops::gelu_table_bf16(tanh);
      for (const bool use_table : {true, false})
        for (const int columns : {0, 1, 2, 3, 4})
          for (const int aw : {0, 1, 2, 4}) {  // words of each 8-column chunk computed arithmetically beside the table
          if (!use_table && (columns == 2 || columns == 3 || aw != 0)) continue;
          if (aw != 0 && columns != 0 && columns != 2) continue;
          SCOPED_TRACE(std::string(by_row ? "row" : "column") + " layout, " + (tanh ? "tanh" : "erf") +
                       (use_table ? ", table" : ", arithmetic") + ", consumer columns " + std::to_string(columns) +
                       ", arithmetic words " + std::to_string(aw));
          const SwitchScope consumer_columns(cuda::gemm_sm90_consumer_columns(), columns);
          const SwitchScope table_on(cuda::gemm_sm90_gelu_table(), use_table);
          const SwitchScope arith_words(cuda::gemm_sm90_gelu_arith_words(), aw);
          out0.poison();
          out1.poison();
          cuda::launch_gemm_sm90<D>(cuda::GemmEpilogue::kGelu, reinterpret_cast<const D*>(da->p),
                                    reinterpret_cast<const D*>(db->p), kN, kN, kN, nullptr,
                                    reinterpret_cast<D*>(out0.p), reinterpret_cast<D*>(out1.p), nullptr, nullptr, tanh,
                                    gpu<E>().multiprocessors(), current().stream);
          std::vector<E> g(kN * kN), y(kN * kN);
          ASSERT_EQ(cudaMemcpyAsync(g.data(), out0.p, g.size() * 2, cudaMemcpyDeviceToHost, current().stream),
                    cudaSuccess);
          ASSERT_EQ(cudaMemcpyAsync(y.data(), out1.p, y.size() * 2, cudaMemcpyDeviceToHost, current().stream),
                    cudaSuccess);
          ASSERT_EQ(cudaStreamSynchronize(current().stream), cudaSuccess);
          int table_checked = 0, table_wrong = 0, outside_checked = 0, outside_wrong = 0, split_checked = 0,
              split_differ = 0;
          for (int r = 0; r < kN; ++r)
            for (int j = 0; j < kN; ++j) {
              const uint16_t h = b[j * kN + r].bits;
              const uint16_t gy = y[r * kN + j].bits, gg = g[r * kN + j].bits;
              // Words (j % 8) / 2 >= 4 - aw of each chunk are computed arithmetically: checked like the inputs
              // outside the table (and counted where they differ from the correctly rounded table entry).
              const bool in_table = use_table && ops::gelu_table_covers(h);
              const bool looked_up = in_table && (j % 8) / 2 < 4 - aw;
              const uint32_t want = in_table ? table[ops::gelu_table_index(h)] : 0u;
              if (in_table && !looked_up) {
                ++split_checked;
                if (gy != (want & 0xFFFFu) || gg != (want >> 16)) ++split_differ;
              }
              if (looked_up) {
                ++table_checked;
                if (gy != (want & 0xFFFFu) || gg != (want >> 16)) {
                  if (table_wrong++ < 5) {
                    ADD_FAILURE() << "pre bits " << std::hex << h << ": y " << gy << " gelu' " << gg << ", table "
                                  << want;
                  }
                }
              } else {
                const double x = to_float(E{h});
                ++outside_checked;
                const double wy = ops::gelu_exact(x, tanh), wg = ops::gelu_grad_exact(x, tanh);
                const double ey = std::fabs(to_float(E{gy}) - wy), eg = std::fabs(to_float(E{gg}) - wg);
                // The arithmetic forms' absolute error: erf ~1e-7 (gelu' near its root at -0.75 has no relative
                // accuracy); tanh ~1e-6 (the twin's fp32 1 + tanh u and 1 - tanh^2 u cancel for u << 0).
                const double abs_tol = tanh ? 1e-5 : 1e-6;
                const bool ok_y = ey <= std::max(std::fabs(wy) * std::ldexp(1.0, -7), 1e-30) || (tanh && ey <= abs_tol);
                // gelu' of |x| >= 2^60: the tanh form's x^2 overflows fp32 (NaN, as in the twin); not compared.
                const bool ok_g = std::fabs(x) >= std::ldexp(1.0, 60) ||
                                  eg <= std::max(std::fabs(wg) * std::ldexp(1.0, -7), 1e-30) || eg <= abs_tol;
                if (!ok_y || !ok_g) {
                  if (outside_wrong++ < 5) {
                    ADD_FAILURE() << "pre " << x << " (bits " << std::hex << h << std::dec << "): y "
                                  << to_float(E{gy}) << " want " << wy << ", gelu' " << to_float(E{gg}) << " want "
                                  << wg;
                  }
                }
              }
            }
          EXPECT_EQ(table_wrong, 0);
          EXPECT_EQ(outside_wrong, 0);
          std::printf("  gelu epilogue, %s layout, %s, %s, consumers %d, arithmetic words %d: %d table entries exact, "
                      "%d others within a step\n",
                      by_row ? "row" : "column", tanh ? "tanh" : "erf", use_table ? "table" : "arithmetic", columns, aw,
                      table_checked - table_wrong, outside_checked - outside_wrong);
          if (use_table && aw == 0) {
            EXPECT_EQ(table_checked, ops::kGeluTableEntries);  // every entry met once
          }
          if (split_checked > 0) {
            std::printf("    arithmetic words on table inputs: %d of %d differ from the correctly rounded entry\n",
                        split_differ, split_checked);
          }
        }
    }
  }
}

// The epilogue path at BERT-large's four bias-gradient products (QKV, attention output, FFN in and out): d_bias equals
// the column sums of dy whichever path ran, and the test prints whether cuBLASLt offered the BGRADB epilogue (where it
// does not, the one-pass fallback ran: correct, and CudaPerf.DenseBackward times both).
TYPED_TEST(CudaOps, DenseBiasGradEpilogueAvailable) {
  using E = TypeParam;  // bf16 or f16
  struct Shape {
    int32_t k, n;
  };
  int available = 0;
  for (const Shape s : {Shape{1024, 3072}, Shape{1024, 1024}, Shape{1024, 4096}, Shape{4096, 1024}}) {
    const int64_t rows = 1000;
    Rng rng({17u, static_cast<uint64_t>(s.k), static_cast<uint64_t>(s.n)});
    auto x = up16<E>(rand_vec<E>(rng, rows * s.k, -1, 1)), w = up16<E>(rand_vec<E>(rng, size_t(s.n) * s.k, -0.05f, 0.05f)),
         dy = up16<E>(rand_vec<E>(rng, rows * s.n, -1, 1));
    DBuf<E> dx(rows * s.k);
    DBuf<float> dw(size_t(s.n) * s.k), db(s.n);
    gpu<E>().zero_bytes(dw.p, dw.n * sizeof(float));
    cuda::KernelVariants v;
    v.dense_bias_grad = cuda::BiasGradPath::kEpilogue;
    VariantScope variants(v);
    gpu<E>().zero_bytes(db.p, db.n * sizeof(float));  // d_bias += column sums: from zero, the sums themselves
    gpu<E>().dense_backward(dy->p, x->p, w->p, nullptr, rows, s.k, s.n, ops::Activation::kNone, dx.p, false, dw.p, db.p);
    const bool ok = cuda::last_bias_grad_path() == cuda::BiasGradPath::kEpilogue;
    available += ok;
    std::printf("    BGRADB epilogue for k=%d n=%d: %s\n", s.k, s.n, ok ? "available" : "NOT available (fallback)");
    // d_bias = column sums of dy, whichever path produced it.
    const Vec dy_h = down(*dy);
    Vec want(s.n, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t j = 0; j < s.n; ++j) want[j] += dy_h[r * s.n + j];
    expect_close("d_bias", down(db), want, kTolF32);
  }
  // Informational: the fallback is correct, only slower (CudaPerf.DenseBackward shows by how much).
  std::printf("    BGRADB available for %d of 4 BERT-large products\n", available);
}

TYPED_TEST(CudaOps, Attention) {
  using E = TypeParam;  // bf16 or f16
  for (int32_t heads : {2, 16})
    for (float p : {0.0f, 0.1f}) {
      const int32_t hd = 64, H = heads * hd;
      SCOPED_TRACE("heads=" + std::to_string(heads) + " p=" + std::to_string(p));
      std::printf("  attention heads=%d hd=%d p=%.1f\n", heads, hd, p);
      Rng rng({14u, static_cast<uint64_t>(heads), static_cast<uint64_t>(p * 10)});
      Batch b = make_batch(rng, 2);
      const int32_t T = b.T;
      Vec qkv = rand_vec<E>(rng, static_cast<size_t>(T) * 3 * H, -1, 1);
      auto d_qkv_in = up16<E>(qkv);
      const auto drop = dropout(p, 5);
      Vec ctx_c(static_cast<size_t>(T) * H), lse_c(static_cast<size_t>(heads) * T);
      cpu().attention_forward(qkv.data(), b.host(), heads, hd, drop, ctx_c.data(), lse_c.data());
      DBuf<E> ctx_g(static_cast<size_t>(T) * H);
      DBuf<float> lse_g(static_cast<size_t>(heads) * T);
      ctx_g.poison();
      lse_g.poison();
      gpu<E>().attention_forward(d_qkv_in->p, b.device(), heads, hd, drop, ctx_g.p, lse_g.p);
      expect_close("ctx", down(ctx_g), ctx_c, kTolChain<E>);  // P is 16-bit inside FMHA, then ctx is rounded
      expect_close("lse", down(lse_g), lse_c, kTolF32);

      Vec dctx = rand_vec<E>(rng, static_cast<size_t>(T) * H, -1, 1);
      auto d_dctx = up16<E>(dctx);
      Vec dqkv_c(static_cast<size_t>(T) * 3 * H);
      // The QKV bias gradient accumulates (+=) the column sums of d_qkv: both start from the same values.
      Vec bias0 = rand_vec<E>(rng, static_cast<size_t>(3) * H, -1, 1), d_bias_c = bias0;
      cpu().attention_backward(dctx.data(), qkv.data(), ctx_c.data(), lse_c.data(), b.host(), heads, hd, drop,
                               dqkv_c.data(), d_bias_c.data());
      DBuf<E> dqkv_g(static_cast<size_t>(T) * 3 * H);
      dqkv_g.poison();
      auto d_bias_g = up(bias0);
      gpu<E>().attention_backward(d_dctx->p, d_qkv_in->p, ctx_g.p, lse_g.p, b.device(), heads, hd, drop, dqkv_g.p,
                                  d_bias_g->p);
      const Vec dqkv = down(dqkv_g);
      // The GPU's bias gradient is the column sums of the q and v blocks of the d_qkv it wrote (fp32 atomics: any
      // order), and so close to the CPU twin's as d_qkv is; the k block's part stays as it was (the k bias has no
      // gradient: ops.h), as in the twin; from the FMHA kernels (the default) and from the column-sum pass.
      const auto check_bias = [&](const char* how, const DBuf<float>& bias_g, const Vec& dqkv_h) {
        const Vec got = down(bias_g);
        Vec want = bias0;
        for (int32_t t = 0; t < T; ++t)
          for (int32_t j = 0; j < 3 * H; ++j)
            if (j < H || j >= 2 * H) want[j] += dqkv_h[static_cast<size_t>(t) * 3 * H + j];
        for (int32_t j = H; j < 2 * H; ++j)
          EXPECT_EQ(got[j], bias0[j]) << "d_qkv_bias " << how << ": k block column " << j - H << " changed";
        expect_close(std::string("d_qkv_bias ") + how + " (vs its own d_qkv)", got, want, kTolF32);
        expect_close(std::string("d_qkv_bias ") + how + " (vs the CPU twin)", got, d_bias_c, kTolDeep<E>);
      };
      check_bias("in the kernels", *d_bias_g, dqkv);
      {
        cuda::KernelVariants pass = cuda::kernel_variants();
        pass.qkv_bias_in_attention = false;
        const VariantScope scope(pass);
        DBuf<E> dqkv2(static_cast<size_t>(T) * 3 * H);
        dqkv2.poison();
        auto d_bias2 = up(bias0);
        gpu<E>().attention_backward(d_dctx->p, d_qkv_in->p, ctx_g.p, lse_g.p, b.device(), heads, hd, drop, dqkv2.p,
                                    d_bias2->p);
        check_bias("by the column-sum pass", *d_bias2, down(dqkv2));
      }
      // q, k and v blocks separately, so a wrong block is named (through 16-bit dS and P: kTolDeep).
      const auto check_blocks = [&](const std::string& prefix, const Vec& got, const Vec& want) {
        for (int part = 0; part < 3; ++part) {
          Vec g, c;
          for (int32_t t = 0; t < T; ++t)
            for (int32_t j = 0; j < H; ++j) {
              g.push_back(got[(static_cast<size_t>(t) * 3 + part) * H + j]);
              c.push_back(want[(static_cast<size_t>(t) * 3 + part) * H + j]);
            }
          expect_close(prefix + (part == 0 ? "d_q" : part == 1 ? "d_k" : "d_v"), g, c, kTolDeep<E>);
        }
      };
      check_blocks("", dqkv, dqkv_c);
      // attention_output_backward: d_w_out += dy^T ctx, d_ctx = dy w_out, then the backward; fused where nopad's GEMM
      // runs (H % 256 == 0: its epilogue computes the backward's D and its idle warps lse2 and the zeroed dQ
      // accumulator) and as the two ops (attention_prep_gemm off, and H = 128): against the CPU twin's composition.
      {
        const float wsc = 1.0f / std::sqrt(static_cast<float>(H));
        Vec dy = rand_vec<E>(rng, static_cast<size_t>(T) * H, -1, 1);
        Vec w_out = rand_vec<E>(rng, size_t(H) * H, -wsc, wsc);
        Vec dw0 = rand_vec<E>(rng, size_t(H) * H, -1, 1), dw_c = dw0, bias_c2 = bias0;
        Vec dctx_c2(static_cast<size_t>(T) * H), dqkv_c2(static_cast<size_t>(T) * 3 * H);
        cpu().attention_output_backward(dy.data(), w_out.data(), qkv.data(), ctx_c.data(), lse_c.data(), b.host(),
                                        heads, hd, drop, dctx_c2.data(), dw_c.data(), dqkv_c2.data(), bias_c2.data());
        auto d_dy = up16<E>(dy);
        auto d_w = up16<E>(w_out);
        const bool can_fuse = cuda::gemm_sm90_available() && H % 256 == 0;
        for (const bool fuse : {true, false}) {
          SCOPED_TRACE(fuse ? "attention_output_backward, fusion allowed" : "attention_output_backward, unfused");
          cuda::KernelVariants v = cuda::kernel_variants();
          v.attention_prep_gemm = fuse;
          const VariantScope scope(v);
          DBuf<E> dctx_g(static_cast<size_t>(T) * H), dqkv_g2(static_cast<size_t>(T) * 3 * H);
          dctx_g.poison();
          dqkv_g2.poison();
          auto dw_g = up(dw0);
          auto bias_g2 = up(bias0);
          cuda::last_attention_output_fused() = !fuse;  // the op must set it
          gpu<E>().attention_output_backward(d_dy->p, d_w->p, d_qkv_in->p, ctx_g.p, lse_g.p, b.device(), heads, hd,
                                             drop, dctx_g.p, dw_g->p, dqkv_g2.p, bias_g2->p);
          EXPECT_EQ(cuda::last_attention_output_fused(), fuse && can_fuse);
          std::printf("    attention_output_backward: %s\n", cuda::last_attention_output_fused() ? "fused" : "two ops");
          expect_close("aob d_ctx", down(dctx_g), dctx_c2, kTolChain<E>);
          expect_close("aob d_w_out", down(*dw_g), dw_c, kTolOut<E>);
          expect_close("aob d_qkv_bias", down(*bias_g2), bias_c2, kTolDeep<E>);
          check_blocks("aob ", down(dqkv_g2), dqkv_c2);
        }
      }
    }
}

// The heads run on the first implementations of every memory-bound kernel, on the defaults, and on the other newer
// choices (epilogue d_bias, row-block CE backward, row-group LayerNorm forward) (the MLM head: plain LayerNorm, GELU, the decoder's d_bias over V = 30522 columns, softmax
// CE and its gradient).
struct HeadVariants {
  const char* name;
  cuda::KernelVariants v;
};
std::vector<HeadVariants> head_variants() {
  cuda::KernelVariants others;  // the non-default choices of the newer kernels
  others.dense_bias_grad = cuda::BiasGradPath::kEpilogue;
  others.ce_backward_rows = true;
  others.ln_forward = {true, 0, 0};
  return {{"first kernels", first_variants()},
          {"defaults", cuda::KernelVariants{}},
          {"epilogue d_bias, row-block CE backward, row-group LN forward", others}};
}

TYPED_TEST(CudaOps, MlmHeadLoss) {
  using E = TypeParam;  // bf16 or f16
  struct Case {
    int32_t H, V, M;
  };
  for (const Case c : {Case{128, 1003, 77}, Case{1024, 30522, 150}, Case{1024, 30528, 33}}) {
    SCOPED_TRACE("H=" + std::to_string(c.H) + " V=" + std::to_string(c.V) + " M=" + std::to_string(c.M));
    std::printf("  mlm head H=%d V=%d M=%d\n", c.H, c.V, c.M);
    Rng rng({15u, static_cast<uint64_t>(c.H), static_cast<uint64_t>(c.V)});
    const int32_t H = c.H, V = c.V, M = c.M, T = 4 * M + 3;
    Vec hidden = rand_vec<E>(rng, static_cast<size_t>(T) * H, -1, 1);
    std::vector<int32_t> all(T);
    std::iota(all.begin(), all.end(), 0);
    rng.shuffle(all.begin(), all.end());
    std::vector<int32_t> positions(all.begin(), all.begin() + M), labels(M);
    for (auto& l : labels) l = static_cast<int32_t>(rng.uniform_int(0, V - 1));
    const float ws = 1.0f / std::sqrt(static_cast<float>(H));
    Vec tw = rand_vec<E>(rng, static_cast<size_t>(H) * H, -2 * ws, 2 * ws), tb = rand_vec<E>(rng, H, -0.5f, 0.5f),
        lg = rand_vec<E>(rng, H, 0.5f, 1.5f), lb = rand_vec<E>(rng, H, -0.5f, 0.5f),
        emb = rand_vec<E>(rng, static_cast<size_t>(V) * H, -0.1f, 0.1f), ob = rand_vec<E>(rng, V, -0.5f, 0.5f);
    ops::MlmHeadWeights<float> wc{tw.data(), tb.data(), lg.data(), lb.data(), emb.data(), ob.data(), H, V, 1e-12};
    Vec s_gath(static_cast<size_t>(M) * H), s_pre(static_cast<size_t>(M) * H), s_act(static_cast<size_t>(M) * H),
        s_mean(M), s_rstd(M), s_ln(static_cast<size_t>(M) * H), s_probs(static_cast<size_t>(M) * V);
    ops::MlmHeadSaved<float, float> sc{s_gath.data(), s_pre.data(), s_act.data(), s_mean.data(),
                                       s_rstd.data(), s_ln.data(),  s_probs.data()};
    float loss_c = 0;
    int32_t correct_c = 0;
    // First pass: make every other label the CPU's argmax, so num_correct is a real check (about M/2 hits).
    cpu().mlm_head_loss_forward(hidden.data(), positions.data(), labels.data(), M, wc, sc, &loss_c, &correct_c);
    for (int32_t i = 0; i < M; i += 2)
      labels[i] = static_cast<int32_t>(std::max_element(s_probs.begin() + static_cast<size_t>(i) * V,
                                                        s_probs.begin() + static_cast<size_t>(i + 1) * V) -
                                       (s_probs.begin() + static_cast<size_t>(i) * V));
    cpu().mlm_head_loss_forward(hidden.data(), positions.data(), labels.data(), M, wc, sc, &loss_c, &correct_c);
    EXPECT_GE(correct_c, M / 2) << "test setup: the CPU's argmax labels should all hit";
    const Vec probs_c = s_probs;  // the backward overwrites them with d_logits
    // An argmax may flip where the top two probabilities lie within the GPU's rounding of each other: the GPU's
    // logits come from 16-bit weights and activations (bf16: probs ~4e-3 relative error), so rows whose two best
    // probabilities differ by less than 3% relative are near-ties. That many flips, plus one, are allowed.
    int32_t near_ties = 0;
    for (int32_t i = 0; i < M; ++i) {
      const auto first = probs_c.begin() + static_cast<ptrdiff_t>(i) * V;
      std::vector<float> row(first, first + V);
      std::partial_sort(row.begin(), row.begin() + 2, row.end(), std::greater<float>());
      near_ties += row[0] - row[1] < 0.03f * row[0];
    }

    const double ls = kHeadLossScale<E>, scale = ls / M;
    // d_hidden starts small and nonzero: the increments (~1e-3 here, times the loss scale) are then not swamped by
    // the 16-bit rounding of dh0 + increment, and a '=' instead of '+=' still shows.
    const auto dh_amp = static_cast<float>(0.01 * ls);
    Vec dh0 = rand_vec<E>(rng, static_cast<size_t>(T) * H, -dh_amp, dh_amp), dh_c = dh0;
    Vec g0[6] = {rand_vec<E>(rng, tw.size(), -1, 1), rand_vec<E>(rng, H, -1, 1), rand_vec<E>(rng, H, -1, 1),
                 rand_vec<E>(rng, H, -1, 1),         rand_vec<E>(rng, emb.size(), -1, 1), rand_vec<E>(rng, V, -1, 1)};
    Vec gc[6] = {g0[0], g0[1], g0[2], g0[3], g0[4], g0[5]};
    cpu().mlm_head_loss_backward(scale, positions.data(), labels.data(), M, wc, sc,
                                 {gc[0].data(), gc[1].data(), gc[2].data(), gc[3].data(), gc[4].data(), gc[5].data()},
                                 dh_c.data());

    auto d_hidden_in = up16<E>(hidden), d_tw = up16<E>(tw), d_tb = up16<E>(tb), d_lg = up16<E>(lg),
         d_lb = up16<E>(lb), d_emb = up16<E>(emb), d_ob = up16<E>(ob);
    auto d_pos = up(positions), d_lab = up(labels);
    // The model's weights carry the layout's vocabulary padding (zero rows up to padded_vocab_size(V)), which lets
    // the GPU run the decoder over the padded columns; both forms are tested. Padding rows of the gradients start
    // random and must come back bit for bit (they receive += 0).
    const int32_t Vp = static_cast<int32_t>(padded_vocab_size(V));
    Vec emb_p = emb, ob_p = ob;
    emb_p.resize(static_cast<size_t>(Vp) * H, 0.0f);
    ob_p.resize(static_cast<size_t>(Vp), 0.0f);
    auto d_emb_p = up16<E>(emb_p), d_ob_p = up16<E>(ob_p);
    Vec g0_pad[2] = {rand_vec<E>(rng, static_cast<size_t>(Vp - V) * H, -1, 1), rand_vec<E>(rng, Vp - V, -1, 1)};
    for (const bool padded : {false, true})
    for (const HeadVariants& hv : head_variants()) {
      SCOPED_TRACE(std::string(hv.name) + (padded ? ", padded weights" : ", unpadded weights"));
      std::printf("   [%s%s]\n", hv.name, padded ? ", padded weights" : "");
      VariantScope variants(hv.v);
      ops::MlmHeadWeights<E> wg{d_tw->p, d_tb->p, d_lg->p, d_lb->p, d_emb->p, d_ob->p, H, V, 1e-12};
      if (padded) {
        wg.word_embeddings = d_emb_p->p;
        wg.output_bias = d_ob_p->p;
        wg.padded_vocab = Vp;
      }
      // The GPU's logits rows are padded to its preferred stride (V = 30522 -> 30528), poisoned first: without the
      // weights' padding the columns past V are never touched; with it they hold the zero logits of the zero rows.
      const int64_t ld = gpu<E>().mlm_logits_row_stride(V);
      ASSERT_TRUE(ld >= Vp && ld % 8 == 0) << ld;
      auto unpad = [&](const Vec& rows, size_t* pad_wrong) {
        Vec out(static_cast<size_t>(M) * V);
        for (int32_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < ld; ++j) {
            const float x = rows[static_cast<size_t>(i * ld + j)];
            if (j < V) out[static_cast<size_t>(i) * V + static_cast<size_t>(j)] = x;
            else *pad_wrong += (padded && j < Vp) ? x != 0.0f : !std::isnan(x);
          }
        return out;
      };
      DBuf<E> g_gath(static_cast<size_t>(M) * H), g_pre(static_cast<size_t>(M) * H),
          g_act(static_cast<size_t>(M) * H), g_ln(static_cast<size_t>(M) * H), g_probs(static_cast<size_t>(M * ld));
      DBuf<float> g_mean(M), g_rstd(M), g_loss(1);
      DBuf<int32_t> g_correct(1);
      for (auto* d : {&g_gath, &g_pre, &g_act, &g_ln, &g_probs}) d->poison();
      g_mean.poison();
      g_rstd.poison();
      g_loss.poison();
      g_correct.poison();
      ops::MlmHeadSaved<E, float> sg{g_gath.p, g_pre.p, g_act.p, g_mean.p, g_rstd.p, g_ln.p, g_probs.p, ld};
      gpu<E>().mlm_head_loss_forward(d_hidden_in->p, d_pos->p, d_lab->p, M, wg, sg, g_loss.p, g_correct.p);
      size_t pad_touched = 0;
      expect_close("gathered", down(g_gath), s_gath, 1e-6);
      expect_close("transform_act_grad", down(g_pre), s_pre, kTolChain<E>);
      expect_close("transform_act", down(g_act), s_act, kTolChain<E>);
      expect_close("ln_out", down(g_ln), s_ln, kTolChain<E>);
      expect_close("probs", unpad(down(g_probs), &pad_touched), probs_c, kTolDeep<E>);  // softmax of 16-bit logits
      EXPECT_EQ(pad_touched, 0u) << "the forward wrote into the logits' row padding";
      const float loss_g = down(g_loss)[0];
      const int32_t correct_g = down(g_correct)[0];
      std::printf("    loss %.6g (cpu %.6g), correct %d (cpu %d)\n", loss_g, loss_c, correct_g, correct_c);
      EXPECT_NEAR(loss_g, loss_c, kTolOut<E> * std::abs(loss_c)) << "loss_sum";
      EXPECT_LE(std::abs(correct_g - correct_c), near_ties + 1)
          << "num_correct: " << near_ties << " rows are near-ties whose argmax may flip";

      std::unique_ptr<DBuf<float>> gg[6];
      for (int i = 0; i < 6; ++i) {
        Vec g = g0[i];
        if (padded && i >= 4) g.insert(g.end(), g0_pad[i - 4].begin(), g0_pad[i - 4].end());
        gg[i] = up(g);
      }
      auto d_dh = up16<E>(dh0);
      gpu<E>().mlm_head_loss_backward(scale, d_pos->p, d_lab->p, M, wg, sg,
                                   {gg[0]->p, gg[1]->p, gg[2]->p, gg[3]->p, gg[4]->p, gg[5]->p}, d_dh->p);
      // d_hidden: unmasked rows must be untouched (exactly dh0), masked rows compared as increments.
      const Vec dh_g = down(*d_dh);
      Vec inc_g, inc_c;
      std::vector<bool> masked(T, false);
      for (int32_t pidx : positions) masked[pidx] = true;
      size_t touched = 0;
      for (int32_t t = 0; t < T; ++t)
        for (int32_t j = 0; j < H; ++j) {
          const size_t e = static_cast<size_t>(t) * H + j;
          if (masked[t]) {
            inc_g.push_back(dh_g[e] - dh0[e]);
            inc_c.push_back(dh_c[e] - dh0[e]);
          } else if (dh_g[e] != dh0[e]) {
            ++touched;
          }
        }
      EXPECT_EQ(touched, 0u) << "d_hidden rows outside mlm_positions were modified";
      (void)unpad(down(g_probs), &pad_touched);
      EXPECT_EQ(pad_touched, 0u) << "the backward wrote into the logits' row padding";
      // Through 16-bit d_logits, dz, dpre and d_hidden.
      expect_close("d_hidden (+= at positions)", inc_g, inc_c, kTolDeep<E>);
      const char* names[6] = {"d_transform_weight", "d_transform_bias", "d_ln_gamma",
                              "d_ln_beta",          "d_word_embeddings", "d_output_bias"};
      for (int i = 0; i < 6; ++i) {
        Vec got = down(*gg[i]);
        if (padded && i >= 4) {  // the padding rows: += 0, bit for bit
          const Vec tail(got.begin() + static_cast<ptrdiff_t>(g0[i].size()), got.end());
          EXPECT_EQ(0, std::memcmp(tail.data(), g0_pad[i - 4].data(), tail.size() * sizeof(float))) << names[i];
          got.resize(g0[i].size());
        }
        expect_close(std::string(names[i]) + " (+=)", minus(got, g0[i]), minus(gc[i], g0[i]), kTolChain<E>);
      }
    }
  }
}

TYPED_TEST(CudaOps, NspHeadLoss) {
  using E = TypeParam;  // bf16 or f16
  for (int32_t H : {128, 1024}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    std::printf("  nsp head H=%d\n", H);
    Rng rng({16u, static_cast<uint64_t>(H)});
    Batch b = make_batch(rng, 20);
    const int32_t T = b.T, B = b.B;
    Vec hidden = rand_vec<E>(rng, static_cast<size_t>(T) * H, -1, 1);
    std::vector<int32_t> labels(B);
    for (auto& l : labels) l = static_cast<int32_t>(rng.uniform_int(0, 1));
    const float ws = 1.0f / std::sqrt(static_cast<float>(H));
    Vec pw = rand_vec<E>(rng, static_cast<size_t>(H) * H, -2 * ws, 2 * ws), pb = rand_vec<E>(rng, H, -0.5f, 0.5f),
        cw = rand_vec<E>(rng, static_cast<size_t>(2) * H, -2 * ws, 2 * ws), cb = rand_vec<E>(rng, 2, -0.5f, 0.5f);
    ops::NspHeadWeights<float> wc{pw.data(), pb.data(), cw.data(), cb.data(), H};
    Vec s_cls(static_cast<size_t>(B) * H), s_pooled(static_cast<size_t>(B) * H), s_probs(static_cast<size_t>(B) * 2);
    ops::NspHeadSaved<float> sc{s_cls.data(), s_pooled.data(), s_probs.data()};
    float loss_c = 0;
    int32_t correct_c = 0;
    cpu().nsp_head_loss_forward(hidden.data(), b.host(), labels.data(), wc, sc, &loss_c, &correct_c);
    const Vec probs_c = s_probs;  // the backward overwrites them with d_logits
    const double scale = 0.37;
    Vec dh0 = rand_vec<E>(rng, static_cast<size_t>(T) * H, -0.01f, 0.01f), dh_c = dh0;  // small: see the MLM test
    Vec g0[4] = {rand_vec<E>(rng, pw.size(), -1, 1), rand_vec<E>(rng, H, -1, 1), rand_vec<E>(rng, cw.size(), -1, 1),
                 rand_vec<E>(rng, 2, -1, 1)};
    Vec gc[4] = {g0[0], g0[1], g0[2], g0[3]};
    cpu().nsp_head_loss_backward(scale, b.host(), labels.data(), wc, sc,
                                 {gc[0].data(), gc[1].data(), gc[2].data(), gc[3].data()}, dh_c.data());

    auto d_hidden_in = up16<E>(hidden), d_pw = up16<E>(pw), d_pb = up16<E>(pb), d_cw = up16<E>(cw),
         d_cb = up16<E>(cb);
    auto d_lab = up(labels);
    ops::NspHeadWeights<E> wg{d_pw->p, d_pb->p, d_cw->p, d_cb->p, H};
    for (const HeadVariants& hv : head_variants()) {
      SCOPED_TRACE(hv.name);
      std::printf("   [%s]\n", hv.name);
      VariantScope variants(hv.v);
      DBuf<E> g_cls(static_cast<size_t>(B) * H), g_pooled(static_cast<size_t>(B) * H),
          g_probs(static_cast<size_t>(B) * 2);
      DBuf<float> g_loss(1);
      DBuf<int32_t> g_correct(1);
      g_cls.poison();
      g_pooled.poison();
      g_probs.poison();
      g_loss.poison();
      g_correct.poison();
      ops::NspHeadSaved<E> sg{g_cls.p, g_pooled.p, g_probs.p};
      gpu<E>().nsp_head_loss_forward(d_hidden_in->p, b.device(), d_lab->p, wg, sg, g_loss.p, g_correct.p);
      expect_close("cls", down(g_cls), s_cls, 1e-6);
      expect_close("pooled", down(g_pooled), s_pooled, kTolChain<E>);
      expect_close("probs", down(g_probs), probs_c, kTolChain<E>);
      const float loss_g = down(g_loss)[0];
      const int32_t correct_g = down(g_correct)[0];
      std::printf("    loss %.6g (cpu %.6g), correct %d (cpu %d) of %d\n", loss_g, loss_c, correct_g, correct_c, B);
      EXPECT_NEAR(loss_g, loss_c, kTolChain<E> * std::abs(loss_c)) << "loss_sum";
      EXPECT_NEAR(correct_g, correct_c, 1) << "num_correct (a near-tie may flip)";

      std::unique_ptr<DBuf<float>> gg[4];
      for (int i = 0; i < 4; ++i) gg[i] = up(g0[i]);
      auto d_dh = up16<E>(dh0);
      gpu<E>().nsp_head_loss_backward(scale, b.device(), d_lab->p, wg, sg, {gg[0]->p, gg[1]->p, gg[2]->p, gg[3]->p},
                                   d_dh->p);
      const Vec dh_g = down(*d_dh);
      Vec inc_g, inc_c;
      size_t touched = 0;
      std::vector<bool> is_cls(T, false);
      for (int32_t s = 0; s < B; ++s) is_cls[b.cu[s]] = true;
      for (int32_t t = 0; t < T; ++t)
        for (int32_t j = 0; j < H; ++j) {
          const size_t e = static_cast<size_t>(t) * H + j;
          if (is_cls[t]) {
            inc_g.push_back(dh_g[e] - dh0[e]);
            inc_c.push_back(dh_c[e] - dh0[e]);
          } else if (dh_g[e] != dh0[e]) {
            ++touched;
          }
        }
      EXPECT_EQ(touched, 0u) << "d_hidden rows other than the CLS rows were modified";
      // Through 16-bit d_logits, d_pooled and d_hidden.
      expect_close("d_hidden (+= at CLS)", inc_g, inc_c, kTolDeep<E>);
      const char* names[4] = {"d_pooler_weight", "d_pooler_bias", "d_classifier_weight", "d_classifier_bias"};
      for (int i = 0; i < 4; ++i)
        expect_close(std::string(names[i]) + " (+=)", minus(down(*gg[i]), g0[i]), minus(gc[i], g0[i]), kTolChain<E>);
    }
  }
}

// ------------------------------------------------------------------------------------------------ perf smokes
// BERT-large sizes (the coordinator's breakdown): T = 24,657 rows in 64 sequences of 130..512 tokens, H = 1024, FFN
// 4096, dropout 0.1, random data. Every variant is called 3 times to warm up (plans, scratch growth), then kPerfRuns
// times, each call bracketed alone by CUDA events on the backend's stream; the median is printed. One line per variant,
// "perf <op> <variant> <ms> ms <GB/s> GB/s" where GB/s counts the bytes the op must move at least (its inputs read
// once, its outputs written once); for GEMM-bound ops only ms. These print and never fail. Typed like CudaOps: the
// CudaPerf/f16.* lines carry " [fp16]" after the variant (same bytes moved, so the same GB/s are expected).

constexpr int kPerfRuns = 25;
constexpr int32_t kPerfRows = 24657, kPerfH = 1024, kPerfFfn = 4096, kPerfSeqs = 64;

template <class F>
double median_ms(F&& op) {
  cudaEvent_t e0, e1;
  EXPECT_EQ(cudaEventCreate(&e0), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&e1), cudaSuccess);
  for (int i = 0; i < 3; ++i) op();
  std::vector<float> ms(kPerfRuns);
  for (float& m : ms) {
    EXPECT_EQ(cudaEventRecord(e0, current().stream), cudaSuccess);
    op();
    EXPECT_EQ(cudaEventRecord(e1, current().stream), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(e1), cudaSuccess);
    EXPECT_EQ(cudaEventElapsedTime(&m, e0, e1), cudaSuccess);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void perf_line(const char* op, const std::string& variant_untagged, double ms, double bytes) {
  const std::string variant = variant_untagged + current().perf_tag;
  if (bytes > 0)
    std::printf("  perf %-12s %-44s %8.4f ms %7.0f GB/s\n", op, variant.c_str(), ms, bytes / (ms * 1e6));
  else
    std::printf("  perf %-12s %-44s %8.4f ms\n", op, variant.c_str(), ms);
}

// n random 16-bit values (of H) in [lo, hi): a random tile of ~1M values (an odd length, so rows do not repeat in
// step) repeated through the buffer by device copies.
template <class H>
std::unique_ptr<DBuf<H>> perf16(size_t n, uint64_t seed, float lo, float hi) {
  Rng rng({seed, 99u});
  const size_t tile = std::min<size_t>(n, (size_t{1} << 20) + 7);
  std::vector<H> h(tile);
  for (auto& v : h) v = convert<H>(static_cast<float>(lo + (hi - lo) * rng.uniform()));
  auto d = std::make_unique<DBuf<H>>(n);
  EXPECT_EQ(cudaMemcpyAsync(d->p, h.data(), tile * sizeof(H), cudaMemcpyHostToDevice, current().stream), cudaSuccess);
  for (size_t off = tile; off < n; off += tile)
    EXPECT_EQ(cudaMemcpyAsync(d->p + off, d->p, std::min(tile, n - off) * sizeof(H), cudaMemcpyDeviceToDevice,
                              current().stream),
              cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(current().stream), cudaSuccess);  // h goes out of scope
  return d;
}

// 64 sequences of 130..512 tokens adding up to kPerfRows (mean 385, as the measured batch).
Batch perf_batch() {
  Rng rng({21u});
  std::vector<int32_t> lens(kPerfSeqs);
  int64_t sum = 0;
  for (auto& l : lens) sum += l = static_cast<int32_t>(rng.uniform_int(258, 512));
  for (int i = 0; sum != kPerfRows; i = (i + 1) % kPerfSeqs) {  // nudge lengths until they add up, within 130..512
    const int32_t step = sum > kPerfRows ? -1 : 1;
    if (lens[i] + step >= 130 && lens[i] + step <= 512) {
      lens[i] += step;
      sum += step;
    }
  }
  Batch b;
  for (int32_t l : lens) {
    b.cu.push_back(b.cu.back() + l);
    b.ids.push_back(rng.next_u64());
    for (int32_t i = 0; i < l; ++i) b.pos.push_back(i);
    b.max_len = std::max(b.max_len, l);
  }
  b.T = b.cu.back();
  b.B = kPerfSeqs;
  b.d_cu = up(b.cu);
  b.d_ids = up(b.ids);
  return b;
}

std::string ln_name(const cuda::LnVariant& v) {
  if (!v.row_group) return v.stages ? "warp-per-row pipelined" : "warp-per-row (first)";
  std::string s = "row-group v" + (v.vectors ? std::to_string(v.vectors) : std::string("auto"));
  s += v.blocks_per_sm ? ", " + std::to_string(v.blocks_per_sm) + " blocks/SM" : ", default grid";
  if (v.stages) s = "pipelined " + std::to_string(v.stages) + " stages" + s.substr(s.find(','));
  return s;
}

template <class E>
class CudaPerf : public ::testing::Test {
 protected:
  void SetUp() override { use_backend<E>(); }
};
TYPED_TEST_SUITE(CudaPerf, ElemTypes, ElemName);

// bias + dropout + residual + LayerNorm (bdrln, 48 calls per step) and the embedding LayerNorm (1 call each way).
TYPED_TEST(CudaPerf, LayerNorm) {
  using E = TypeParam;  // bf16 or f16
  const int32_t T = kPerfRows, H = kPerfH;
  const size_t n = static_cast<size_t>(T) * H;
  Batch b = perf_batch();
  auto x = perf16<E>(n, 1, -2, 2), res = perf16<E>(n, 2, -1, 1), bias = perf16<E>(H, 3, -0.5f, 0.5f),
       gamma = perf16<E>(H, 4, 0.5f, 1.5f), beta = perf16<E>(H, 5, -0.5f, 0.5f), dout = perf16<E>(n, 6, -1, 1);
  DBuf<E> out(n), dx(n), dres(n);
  DBuf<float> mean(T), rstd(T), g_bias(H), g_gamma(H), g_beta(H);
  for (DBuf<float>* g : {&g_bias, &g_gamma, &g_beta}) gpu<E>().zero_bytes(g->p, H * sizeof(float));
  const auto drop = dropout(0.1f, 7);
  const double act = 2.0 * static_cast<double>(n);  // bytes of one [T, H] 16-bit tensor
  std::printf("  LayerNorm perf: T=%d H=%d p=0.1, %d SMs (bdrln: 48 calls per BERT-large step)\n", T, H,
              gpu<E>().multiprocessors());
  for (const cuda::LnVariant& v : {cuda::LnVariant{false, 0, 0}, cuda::LnVariant{true, 1, 0},
                                   cuda::LnVariant{true, 2, 0}, cuda::LnVariant{true, 4, 0},
                                   cuda::LnVariant{true, 1, 0, 2}, cuda::LnVariant{true, 1, 0, 3},
                                   cuda::LnVariant{true, 1, 0, 4}, cuda::LnVariant{false, 0, 0, 2}}) {
    cuda::KernelVariants kv;
    kv.ln_forward = v;
    VariantScope scope(kv);
    const double ms = median_ms([&] {
      gpu<E>().bias_dropout_residual_layernorm_forward(x->p, bias->p, res->p, gamma->p, beta->p, b.device(), H, 1e-12,
                                                    drop, out.p, mean.p, rstd.p);
    });
    perf_line("bdrln_fwd", ln_name(v), ms, 3 * act + 8.0 * T);
  }
  gpu<E>().bias_dropout_residual_layernorm_forward(x->p, bias->p, res->p, gamma->p, beta->p, b.device(), H, 1e-12, drop,
                                                out.p, mean.p, rstd.p);
  for (const cuda::LnVariant& v :
       {cuda::LnVariant{false, 0, 0}, cuda::LnVariant{true, 1, 0}, cuda::LnVariant{true, 1, 2},
        cuda::LnVariant{true, 1, 4}, cuda::LnVariant{true, 1, 5}, cuda::LnVariant{true, 2, 0},
        cuda::LnVariant{true, 2, 4}, cuda::LnVariant{true, 1, 0, 2}, cuda::LnVariant{true, 1, 0, 3},
        cuda::LnVariant{true, 1, 0, 4}}) {
    cuda::KernelVariants kv;
    kv.ln_backward = v;
    VariantScope scope(kv);
    const double ms = median_ms([&] {
      gpu<E>().bias_dropout_residual_layernorm_backward(dout->p, x->p, bias->p, res->p, gamma->p, mean.p, rstd.p,
                                                     b.device(), H, drop, dx.p, dres.p, g_bias.p, g_gamma.p,
                                                     g_beta.p);
    });
    perf_line("bdrln_bwd", ln_name(v), ms, 5 * act + 8.0 * T);
  }

  // Embeddings: BERT's vocabulary, 512 positions, 2 token types (segments: 0s then 1s per sequence).
  const int32_t V = 30522, P = 512, S = 2;
  Rng rng({22u});
  std::vector<int32_t> tok(T), seg(T);
  for (auto& t : tok) t = static_cast<int32_t>(rng.uniform_int(0, V - 1));
  for (int32_t s = 0; s < b.B; ++s)
    for (int32_t i = b.cu[s]; i < b.cu[s + 1]; ++i) seg[i] = i - b.cu[s] < (b.cu[s + 1] - b.cu[s]) / 2 ? 0 : 1;
  auto d_tok = up(tok), d_pos = up(b.pos), d_seg = up(seg);
  auto word = perf16<E>(static_cast<size_t>(V) * H, 7, -1, 1), posw = perf16<E>(static_cast<size_t>(P) * H, 8, -1, 1),
       type = perf16<E>(static_cast<size_t>(S) * H, 9, -1, 1);
  DBuf<float> g_word(static_cast<size_t>(V) * H), g_pos(static_cast<size_t>(P) * H), g_type(static_cast<size_t>(S) * H);
  for (DBuf<float>* g : {&g_word, &g_pos, &g_type}) gpu<E>().zero_bytes(g->p, g->n * sizeof(float));
  ops::EmbeddingWeights<E> w{word->p, posw->p, type->p, gamma->p, beta->p, V, P, S, H, 1e-12};
  const auto edrop = dropout(0.1f, 0);
  for (const cuda::LnVariant& v : {cuda::LnVariant{false, 0, 0}, cuda::LnVariant{true, 0, 0}}) {
    cuda::KernelVariants kv;
    kv.ln_forward = v;
    kv.ln_backward = v;
    VariantScope scope(kv);
    const double fwd = median_ms([&] {
      gpu<E>().embed_layernorm_dropout_forward(d_tok->p, d_pos->p, d_seg->p, b.device(), w, edrop, out.p, mean.p, rstd.p);
    });
    perf_line("embed_fwd", ln_name(v), fwd, 2 * act + 12.0 * T);  // the word rows read, the output written
    const double bwd = median_ms([&] {
      gpu<E>().embed_layernorm_dropout_backward(dout->p, d_tok->p, d_pos->p, d_seg->p, b.device(), w, edrop, mean.p,
                                             rstd.p, {g_word.p, g_pos.p, g_type.p, g_gamma.p, g_beta.p});
    });
    perf_line("embed_bwd", ln_name(v), bwd, 2 * act);  // d_out and the word rows read (atomics not counted)
  }
}

// The FFN-in dense forward with GELU: the GEMM alone (act none, same shape) and the GEMM + each GELU pass; the GELU
// pass is the difference, its GB/s over one 16-bit read and two writes (y, gelu') of [T, 4096].
TYPED_TEST(CudaPerf, GeluForward) {
  using E = TypeParam;  // bf16 or f16
  const int32_t T = kPerfRows, k = kPerfH, n = kPerfFfn;
  auto x = perf16<E>(static_cast<size_t>(T) * k, 11, -1, 1),
       w = perf16<E>(static_cast<size_t>(n) * k, 12, -0.06f, 0.06f), bias = perf16<E>(n, 13, -0.5f, 0.5f);
  DBuf<E> y(static_cast<size_t>(T) * n), pre(static_cast<size_t>(T) * n);
  const double gemm = median_ms([&] {
    gpu<E>().dense_forward(x->p, w->p, bias->p, T, k, n, ops::Activation::kNone, pre.p, nullptr);
  });
  perf_line("dense_fwd", "k=1024 n=4096, no activation (the GEMM)", gemm, 0);
  if (cuda::gemm_sm90_available()) {  // nopad's GEMM with the bias epilogue alone: its rate against cuBLASLt's
    using D = std::conditional_t<std::is_same_v<E, f16>, __half, __nv_bfloat16>;
    const double own = median_ms([&] {
      cuda::launch_gemm_sm90<D>(cuda::GemmEpilogue::kBias, reinterpret_cast<const D*>(x->p),
                                reinterpret_cast<const D*>(w->p), T, n, k, reinterpret_cast<const D*>(bias->p),
                                reinterpret_cast<D*>(pre.p), nullptr, nullptr, nullptr, false, gpu<E>().multiprocessors(),
                                current().stream);
    });
    perf_line("dense_fwd", "k=1024 n=4096, no activation (nopad GEMM)", own, 0);
    // The GEMM's GELU epilogue, timed under one setting of its switches (the consumers' box columns, the table, the
    // arithmetic words of each chunk).
    const auto gelu_ms = [&](int columns, bool table, int arith_words, bool tanh) {
      cuda::KernelVariants kv;
      kv.gelu_gemm = true;
      VariantScope scope(kv);
      const SwitchScope consumer_columns(cuda::gemm_sm90_consumer_columns(), columns);
      const SwitchScope table_on(cuda::gemm_sm90_gelu_table(), table);
      const SwitchScope words(cuda::gemm_sm90_gelu_arith_words(), arith_words);
      return median_ms([&] {
        gpu<E>().dense_forward(x->p, w->p, bias->p, T, k, n, tanh ? ops::Activation::kGeluTanh : ops::Activation::kGelu,
                               y.p, pre.p);
      });
    };
    // The GELU epilogue: lookup table (bf16 only) or arithmetic, the consumers' share 0-4 box columns, both GELUs.
    for (const bool table : {true, false}) {
      if (table && !std::is_same_v<E, bf16>) continue;
      for (const int columns : {0, 1, 2, 3, 4})
        for (bool tanh : {false, true}) {
          const double ms = gelu_ms(columns, table, cuda::gemm_sm90_gelu_arith_words(), tanh);
          perf_line("dense_fwd",
                    std::string("k=1024 n=4096 GELU") + (tanh ? " tanh" : "") + ", " +
                        (cuda::last_gelu_path() == cuda::GeluPath::kGemmSm90 ? "nopad GEMM epilogue" : "(fell back)") +
                        (table ? ", table" : ", arithmetic") + ", consumers " + std::to_string(columns) + " box col" +
                        (columns == 1 ? "" : "s"),
                    ms, 0);
        }
    }
    // The table beside the arithmetic erf GELU: the last aw words of each 8-column chunk computed arithmetically.
    if (std::is_same_v<E, bf16>) {
      for (const int columns : {1, 2, 3})
        for (const int aw : {1, 2, 3, 4}) {
          const double ms = gelu_ms(columns, true, aw, false);
          perf_line("dense_fwd",
                    "k=1024 n=4096 GELU, table + " + std::to_string(aw) + " arithmetic words of 4, consumers " +
                        std::to_string(columns) + " box col" + (columns == 1 ? "" : "s"),
                    ms, 0);
        }
    }
    // Where the epilogue's cost lies: the probe moves the same data with no activation at all (y = gelu' = pre), and
    // once more without the gelu' stores; the difference to the bias-only product above is the data movement's cost.
    cuda::KernelVariants kv;
    kv.gelu_gemm = true;
    VariantScope scope(kv);
    for (const int columns : {0, 2, 4}) {
      const SwitchScope consumer_columns(cuda::gemm_sm90_consumer_columns(), columns);
      for (const int probe : {1, 2}) {
        const SwitchScope probe_on(cuda::gemm_sm90_gelu_probe(), probe);
        const double ms = median_ms([&] {
          gpu<E>().dense_forward(x->p, w->p, bias->p, T, k, n, ops::Activation::kGelu, y.p, pre.p);
        });
        perf_line("dense_fwd",
                  std::string("k=1024 n=4096 GELU epilogue probe (no activation") +
                      (probe == 2 ? ", no gelu' stores" : "") + "), consumers " + std::to_string(columns) +
                      " box col" + (columns == 1 ? "" : "s"),
                  ms, 0);
      }
    }
  }
  for (bool wide : {false, true}) {
    cuda::KernelVariants kv;
    kv.gelu_gemm = false;
    kv.gelu_forward_wide = wide;
    VariantScope scope(kv);
    const double ms = median_ms([&] {
      gpu<E>().dense_forward(x->p, w->p, bias->p, T, k, n, ops::Activation::kGelu, y.p, pre.p);
    });
    perf_line("dense_fwd", std::string("k=1024 n=4096 GELU, ") + (wide ? "wide" : "first") + " GELU kernel", ms, 0);
    perf_line("gelu_pass", std::string(wide ? "wide" : "first") + " (difference)", ms - gemm,
              6.0 * static_cast<double>(T) * n);
  }
  {  // the tanh GELU through the cuBLASLt product + wide kernel
    cuda::KernelVariants kv;
    kv.gelu_gemm = false;
    VariantScope scope(kv);
    const double ms = median_ms([&] {
      gpu<E>().dense_forward(x->p, w->p, bias->p, T, k, n, ops::Activation::kGeluTanh, y.p, pre.p);
    });
    perf_line("dense_fwd", "k=1024 n=4096 GELU tanh, wide kernel", ms, 0);
  }
}

// The FFN's backward as the model issues it, k=1024 n=4096 (FFN in) and k=4096 n=1024 (FFN out): the FFN-out dx
// product with the saved GELU derivative applied (and d_bias of the FFN-in layer taken) by nopad's GEMM epilogue, or by
// the cuBLASLt product + the one-pass scale kernel, then the FFN-in backward. (Which GELU made the saved derivative
// does not matter to the backward any more.)
TYPED_TEST(CudaPerf, FfnBackward) {
  using E = TypeParam;  // bf16 or f16
  const int32_t T = kPerfRows, H = kPerfH, I = 4 * kPerfH;
  auto x_in = perf16<E>(static_cast<size_t>(T) * H, 41, -1, 1), act = perf16<E>(static_cast<size_t>(T) * I, 42, -1, 1),
       grad = perf16<E>(static_cast<size_t>(T) * I, 43, -0.17f, 1.13f), w_in = perf16<E>(static_cast<size_t>(I) * H, 44, -0.05f, 0.05f),
       w_out = perf16<E>(static_cast<size_t>(H) * I, 45, -0.05f, 0.05f), dy = perf16<E>(static_cast<size_t>(T) * H, 46, -1, 1);
  DBuf<E> d_inter(static_cast<size_t>(T) * I), d_x(static_cast<size_t>(T) * H);
  DBuf<float> dw_in(static_cast<size_t>(I) * H), dw_out(static_cast<size_t>(H) * I), db_in(I);
  gpu<E>().zero_bytes(dw_in.p, dw_in.n * sizeof(float));
  gpu<E>().zero_bytes(dw_out.p, dw_out.n * sizeof(float));
  gpu<E>().zero_bytes(db_in.p, db_in.n * sizeof(float));
  for (const bool own : {false, true}) {
    cuda::KernelVariants kv;
    kv.dgelu_gemm = own;
    VariantScope scope(kv);
    const double ms = median_ms([&] {
      gpu<E>().dense_backward_through_act(dy->p, act->p, grad->p, w_out->p, T, I, H, ops::Activation::kGelu,
                                          d_inter.p, dw_out.p, db_in.p);
      gpu<E>().dense_backward(d_inter.p, x_in->p, w_in->p, nullptr, T, H, I, ops::Activation::kNone, d_x.p, true,
                              dw_in.p, nullptr);
    });
    const char* ran = gelu_path_name(cuda::last_gelu_path());
    perf_line("ffn_bwd", std::string(own ? "nopad GEMM" : "kernels") + " (ran " + ran + ")", ms, 0);
  }
}

// dense_backward at BERT-large's four shapes, for each d_bias path, and without d_bias (the products and, with GELU,
// the dGELU pass alone): the difference is what d_bias costs on that path. The path that actually ran is printed
// (the epilogue falls back where cuBLASLt has no algorithm).
TYPED_TEST(CudaPerf, DenseBackward) {
  using E = TypeParam;  // bf16 or f16
  struct Shape {
    int32_t k, n;
    bool gelu;
  };
  const int32_t T = kPerfRows;
  for (const Shape s : {Shape{1024, 4096, true}, Shape{1024, 3072, false}, Shape{4096, 1024, false},
                        Shape{1024, 1024, false}}) {
    const ops::Activation act = s.gelu ? ops::Activation::kGelu : ops::Activation::kNone;
    auto x = perf16<E>(static_cast<size_t>(T) * s.k, 31, -1, 1),
         w = perf16<E>(static_cast<size_t>(s.n) * s.k, 32, -0.05f, 0.05f),
         dy = perf16<E>(static_cast<size_t>(T) * s.n, 33, -1, 1),
         pre = perf16<E>(static_cast<size_t>(T) * s.n, 34, -0.17f, 1.13f);  // the saved gelu'
    DBuf<E> dx(static_cast<size_t>(T) * s.k);
    DBuf<float> dw(static_cast<size_t>(s.n) * s.k), db(s.n);
    gpu<E>().zero_bytes(dw.p, dw.n * sizeof(float));
    gpu<E>().zero_bytes(db.p, db.n * sizeof(float));
    const std::string shape = "k=" + std::to_string(s.k) + " n=" + std::to_string(s.n) + (s.gelu ? " GELU" : "");
    const double base = median_ms([&] {
      gpu<E>().dense_backward(dy->p, x->p, w->p, s.gelu ? pre->p : nullptr, T, s.k, s.n, act, dx.p, false, dw.p, nullptr);
    });
    perf_line("dense_bwd", shape + ", no d_bias", base, 0);
    for (const cuda::BiasGradPath path :
         {cuda::BiasGradPath::kSeparate, cuda::BiasGradPath::kOnePass, cuda::BiasGradPath::kEpilogue}) {
      cuda::KernelVariants kv;
      kv.dense_bias_grad = path;
      VariantScope scope(kv);
      const double ms = median_ms([&] {
        gpu<E>().dense_backward(dy->p, x->p, w->p, s.gelu ? pre->p : nullptr, T, s.k, s.n, act, dx.p, false, dw.p, db.p);
      });
      perf_line("dense_bwd", shape + ", d_bias " + path_name(path) + " (ran " + path_name(cuda::last_bias_grad_path()) +
                                 ")",
                ms, 0);
    }
  }
}

// The MLM head at BERT-large's size (3,700 masked rows of 24,657, V = 30522): forward and forward + backward, with
// the first kernels and with the defaults (softmax CE from registers, block-per-row CE gradient, row-group plain LN,
// d_bias path of the variant).
TYPED_TEST(CudaPerf, MlmHead) {
  using E = TypeParam;  // bf16 or f16
  const int32_t T = kPerfRows, H = kPerfH, V = 30522, M = 3700;
  Rng rng({41u});
  std::vector<int32_t> all(T);
  std::iota(all.begin(), all.end(), 0);
  rng.shuffle(all.begin(), all.end());
  std::vector<int32_t> positions(all.begin(), all.begin() + M), labels(M);
  for (auto& l : labels) l = static_cast<int32_t>(rng.uniform_int(0, V - 1));
  auto d_pos = up(positions), d_lab = up(labels);
  auto hidden = perf16<E>(static_cast<size_t>(T) * H, 42, -1, 1),
       tw = perf16<E>(static_cast<size_t>(H) * H, 43, -0.06f, 0.06f),
       tb = perf16<E>(H, 44, -0.5f, 0.5f), lg = perf16<E>(H, 45, 0.5f, 1.5f), lb = perf16<E>(H, 46, -0.5f, 0.5f),
       emb = perf16<E>(static_cast<size_t>(V + 8) * H, 47, -0.1f, 0.1f), ob = perf16<E>(V + 8, 48, -0.5f, 0.5f);
  ops::MlmHeadWeights<E> w{tw->p, tb->p, lg->p, lb->p, emb->p, ob->p, H, V, 1e-12};
  DBuf<E> gath(static_cast<size_t>(M) * H), tpre(static_cast<size_t>(M) * H), tact(static_cast<size_t>(M) * H),
      ln(static_cast<size_t>(M) * H), probs(static_cast<size_t>(M) * (V + 8)), dh(static_cast<size_t>(T) * H);
  DBuf<float> lmean(M), lrstd(M), loss(1), g_tw(static_cast<size_t>(H) * H), g_tb(H), g_lg(H), g_lb(H),
      g_emb(static_cast<size_t>(V + 8) * H), g_ob(V + 8);
  DBuf<int32_t> correct(1);
  for (DBuf<float>* g : {&g_tw, &g_tb, &g_lg, &g_lb, &g_emb, &g_ob}) gpu<E>().zero_bytes(g->p, g->n * sizeof(float));
  gpu<E>().zero_bytes(dh.p, dh.n * sizeof(E));
  ops::MlmHeadSaved<E, float> saved{gath.p, tpre.p, tact.p, lmean.p, lrstd.p, ln.p, probs.p};
  // Logits rows V apart (4-byte aligned rows: cuBLASLt's unaligned kernels), at the backend's padded stride, and
  // with the products over the padded vocabulary too (the model's weights carry the zero rows for it).
  const int64_t Vp = gpu<E>().mlm_logits_row_stride(V);
  for (const auto& [ld, pv] : {std::pair<int64_t, int32_t>{V, 0}, {Vp, 0}, {Vp, static_cast<int32_t>(Vp)}})
  for (const HeadVariants& hv : head_variants()) {
    VariantScope scope(hv.v);
    saved.probs_ld = ld;
    w.padded_vocab = pv;
    const std::string name = std::string(hv.name) + ", logits rows " + std::to_string(ld) + " apart" +
                             (pv > 0 ? ", products over " + std::to_string(pv) + " columns" : "");
    const auto fwd = [&] {
      gpu<E>().mlm_head_loss_forward(hidden->p, d_pos->p, d_lab->p, M, w, saved, loss.p, correct.p);
    };
    const double f = median_ms(fwd);
    const double fb = median_ms([&] {
      fwd();
      gpu<E>().mlm_head_loss_backward(1.0 / M, d_pos->p, d_lab->p, M, w, saved,
                                   {g_tw.p, g_tb.p, g_lg.p, g_lb.p, g_emb.p, g_ob.p}, dh.p);
    });
    perf_line("mlm_head_fwd", name, f, 0);
    perf_line("mlm_head_bwd", name + " (fwd+bwd - fwd)", fb - f, 0);
  }
}

}  // namespace
}  // namespace nopad
