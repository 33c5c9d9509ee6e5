// Every op of the CUDA backend (ops/cuda) against its CPU twin CpuBackend<CpuF32> (ops/cpu). Inputs are drawn on the
// host, rounded to bf16, and the same rounded values go to both backends, so the only differences left are the GPU's
// bf16 outputs/intermediates and fp32 summation order. GPU outputs are poisoned (0xFF bytes = NaN) before each op, so
// an element the op forgot to write shows up as NaN. Comparisons are norm-relative, ||gpu - cpu|| / ||cpu||.
// Parameter gradients start from random nonzero values on both sides and the compared quantity is the change
// (after - before), which checks += semantics as well as the value. Dropout runs at p = 0 and p = 0.1: agreement at
// p = 0.1 proves the GPU draws the twin's masks.
// Needs a GPU (built as nopad_cuda_tests, not registered with CTest); run: build-cuda/nopad_cuda_tests.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cuda/cuda_backend.h"

namespace nopad {
namespace {

using Cpu = ops::CpuBackend<ops::CpuF32>;
using Gpu = cuda::CudaBackend;
using Vec = std::vector<float>;

// Tolerances (norm-relative). Rounding one value to bf16 has relative error <= 2^-9 (~2e-3), rms ~ 2^-9/sqrt(3).
//  kTolOut:  one bf16 rounding of an fp32 result (LayerNorm outputs, GEMM outputs with fp32 accumulation): the norm
//            ratio sits near 1e-3; 1e-2 leaves room for fp32 order differences and the odd larger element.
//  kTolChain: two or three bf16 roundings in a chain (GELU on the rounded pre-activation, dx through a rounded dpre,
//            backward through bf16 d_logits): a few 1e-3 each, so 2e-2.
//  kTolF32:  gradients computed in fp32 from identical inputs (embedding/LayerNorm parameter grads): only summation
//            order differs, ~1e-6; 1e-3 allows for the atomics' varying order.
//  kTolGrad: fp32 parameter grads whose GEMM operands are bf16-rounded intermediates: errors average out over the
//            reduction, ~1e-3; 1e-2.
constexpr double kTolOut = 1e-2, kTolChain = 2e-2, kTolF32 = 1e-3, kTolGrad = 1e-2;

Gpu& gpu() {
  static Gpu g(0);
  return g;
}
Cpu& cpu() {
  static Cpu c(0);
  return c;
}

// A device buffer of n elements, freed at scope end.
template <class T>
struct DBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DBuf(size_t count) : n(count) { p = static_cast<T*>(gpu().allocate_bytes(std::max<size_t>(n, 1) * sizeof(T))); }
  ~DBuf() { gpu().free_bytes(p); }
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  void poison() {  // 0xFF bytes: NaN in bf16 and fp32, -1 in int32
    ASSERT_EQ(cudaMemsetAsync(p, 0xFF, n * sizeof(T), gpu().stream()), cudaSuccess);
  }
};

Vec rand_vec(Rng& rng, size_t n, float lo, float hi) {  // values already rounded to bf16
  Vec v(n);
  for (auto& x : v) x = to_float(to_bf16(static_cast<float>(lo + (hi - lo) * rng.uniform())));
  return v;
}
std::unique_ptr<DBuf<bf16>> up_bf16(const Vec& v) {
  auto d = std::make_unique<DBuf<bf16>>(v.size());
  std::vector<bf16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = to_bf16(v[i]);
  gpu().upload_bytes(d->p, h.data(), h.size() * sizeof(bf16));
  return d;
}
template <class T>
std::unique_ptr<DBuf<T>> up(const std::vector<T>& v) {
  auto d = std::make_unique<DBuf<T>>(v.size());
  gpu().upload_bytes(d->p, v.data(), v.size() * sizeof(T));
  return d;
}
Vec down(const DBuf<bf16>& d) {
  std::vector<bf16> h(d.n);
  gpu().download_bytes(h.data(), d.p, d.n * sizeof(bf16));
  Vec v(d.n);
  for (size_t i = 0; i < d.n; ++i) v[i] = to_float(h[i]);
  return v;
}
template <class T>
std::vector<T> down(const DBuf<T>& d) {
  std::vector<T> h(d.n);
  gpu().download_bytes(h.data(), d.p, d.n * sizeof(T));
  return h;
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
  std::printf("    %-28s rel err %.3g (tol %.0e, %zu elements)\n", what.c_str(), rel, tol, g.size());
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
  const size_t pib = static_cast<size_t>(1) << 50;
  try {
    gpu().allocate_bytes(pib);
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
  gpu().zero_bytes(ok.p, 16 * sizeof(float));
  EXPECT_EQ(down(ok), std::vector<float>(16, 0.0f));
}

TEST(CudaOps, EmbedLayerNormDropout) {
  for (int32_t H : {128, 1024})
    for (float p : {0.0f, 0.1f}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " p=" + std::to_string(p));
      std::printf("  embed H=%d p=%.1f\n", H, p);
      Rng rng({11u, static_cast<uint64_t>(H), static_cast<uint64_t>(p * 10)});
      Batch b = make_batch(rng);
      const int32_t V = 1000, P = 512, S = 2, T = b.T;
      std::vector<int32_t> tok(T), seg(T);
      for (auto& t : tok) t = static_cast<int32_t>(rng.uniform_int(0, V - 1));
      for (auto& s : seg) s = static_cast<int32_t>(rng.uniform_int(0, S - 1));
      Vec word = rand_vec(rng, static_cast<size_t>(V) * H, -1, 1), posw = rand_vec(rng, static_cast<size_t>(P) * H, -1, 1),
          type = rand_vec(rng, static_cast<size_t>(S) * H, -1, 1), gamma = rand_vec(rng, H, 0.5f, 1.5f),
          beta = rand_vec(rng, H, -0.5f, 0.5f);
      auto d_tok = up(tok), d_pos = up(b.pos), d_seg = up(seg);
      auto d_word = up_bf16(word), d_posw = up_bf16(posw), d_type = up_bf16(type), d_gamma = up_bf16(gamma),
           d_beta = up_bf16(beta);
      ops::EmbeddingWeights<float> wc{word.data(), posw.data(), type.data(), gamma.data(), beta.data(), V, P, S, H,
                                      1e-12};
      ops::EmbeddingWeights<bf16> wg{d_word->p, d_posw->p, d_type->p, d_gamma->p, d_beta->p, V, P, S, H, 1e-12};
      const auto drop = dropout(p, 3);

      Vec out_c(static_cast<size_t>(T) * H), mean_c(T), rstd_c(T);
      cpu().embed_layernorm_dropout_forward(tok.data(), b.pos.data(), seg.data(), b.host(), wc, drop, out_c.data(),
                                            mean_c.data(), rstd_c.data());
      DBuf<bf16> out_g(static_cast<size_t>(T) * H);
      DBuf<float> mean_g(T), rstd_g(T);
      out_g.poison();
      mean_g.poison();
      rstd_g.poison();
      gpu().embed_layernorm_dropout_forward(d_tok->p, d_pos->p, d_seg->p, b.device(), wg, drop, out_g.p, mean_g.p,
                                            rstd_g.p);
      const Vec out = down(out_g);
      expect_close("out", out, out_c, kTolOut);
      expect_close("ln_mean", down(mean_g), mean_c, kTolF32);
      expect_close("ln_rstd", down(rstd_g), rstd_c, kTolF32);
      const double zf = zero_fraction(out);
      std::printf("    dropped fraction %.4f (p %.1f)\n", zf, p);
      EXPECT_NEAR(zf, p, 0.01) << "fraction of dropped elements";

      // Backward: parameter grads start nonzero; compare the increments.
      Vec dout = rand_vec(rng, static_cast<size_t>(T) * H, -1, 1);
      auto d_dout = up_bf16(dout);
      Vec gw0 = rand_vec(rng, word.size(), -1, 1), gp0 = rand_vec(rng, posw.size(), -1, 1),
          gt0 = rand_vec(rng, type.size(), -1, 1), gg0 = rand_vec(rng, H, -1, 1), gb0 = rand_vec(rng, H, -1, 1);
      Vec gw = gw0, gp = gp0, gt = gt0, gg = gg0, gb = gb0;
      cpu().embed_layernorm_dropout_backward(dout.data(), tok.data(), b.pos.data(), seg.data(), b.host(), wc, drop,
                                             mean_c.data(), rstd_c.data(),
                                             {gw.data(), gp.data(), gt.data(), gg.data(), gb.data()});
      auto dgw = up(gw0), dgp = up(gp0), dgt = up(gt0), dgg = up(gg0), dgb = up(gb0);
      gpu().embed_layernorm_dropout_backward(d_dout->p, d_tok->p, d_pos->p, d_seg->p, b.device(), wg, drop, mean_g.p,
                                             rstd_g.p, {dgw->p, dgp->p, dgt->p, dgg->p, dgb->p});
      expect_close("d_word (+=)", minus(down(*dgw), gw0), minus(gw, gw0), kTolF32);
      expect_close("d_position (+=)", minus(down(*dgp), gp0), minus(gp, gp0), kTolF32);
      expect_close("d_token_type (+=)", minus(down(*dgt), gt0), minus(gt, gt0), kTolF32);
      expect_close("d_ln_gamma (+=)", minus(down(*dgg), gg0), minus(gg, gg0), kTolF32);
      expect_close("d_ln_beta (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolF32);
    }
}

TEST(CudaOps, BiasDropoutResidualLayerNorm) {
  for (int32_t H : {128, 1024})
    for (float p : {0.0f, 0.1f}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " p=" + std::to_string(p));
      std::printf("  residual LN H=%d p=%.1f\n", H, p);
      Rng rng({12u, static_cast<uint64_t>(H), static_cast<uint64_t>(p * 10)});
      Batch b = make_batch(rng);
      const int32_t T = b.T;
      const size_t n = static_cast<size_t>(T) * H;
      Vec x = rand_vec(rng, n, -2, 2), res = rand_vec(rng, n, -1, 1), bias = rand_vec(rng, H, -0.5f, 0.5f),
          gamma = rand_vec(rng, H, 0.5f, 1.5f), beta = rand_vec(rng, H, -0.5f, 0.5f);
      auto dx_in = up_bf16(x), dres = up_bf16(res), dbias = up_bf16(bias), dgamma = up_bf16(gamma),
           dbeta = up_bf16(beta);
      const auto drop = dropout(p, 7);
      Vec out_c(n), mean_c(T), rstd_c(T);
      cpu().bias_dropout_residual_layernorm_forward(x.data(), bias.data(), res.data(), gamma.data(), beta.data(),
                                                    b.host(), H, 1e-12, drop, out_c.data(), mean_c.data(),
                                                    rstd_c.data());
      DBuf<bf16> out_g(n);
      DBuf<float> mean_g(T), rstd_g(T);
      out_g.poison();
      mean_g.poison();
      rstd_g.poison();
      gpu().bias_dropout_residual_layernorm_forward(dx_in->p, dbias->p, dres->p, dgamma->p, dbeta->p, b.device(), H,
                                                    1e-12, drop, out_g.p, mean_g.p, rstd_g.p);
      expect_close("out", down(out_g), out_c, kTolOut);
      expect_close("ln_mean", down(mean_g), mean_c, kTolF32);
      expect_close("ln_rstd", down(rstd_g), rstd_c, kTolF32);

      Vec dout = rand_vec(rng, n, -1, 1);
      auto d_dout = up_bf16(dout);
      Vec gbias0 = rand_vec(rng, H, -1, 1), gg0 = rand_vec(rng, H, -1, 1), gb0 = rand_vec(rng, H, -1, 1);
      Vec gbias = gbias0, gg = gg0, gb = gb0, dx_c(n), dres_c(n);
      cpu().bias_dropout_residual_layernorm_backward(dout.data(), x.data(), bias.data(), res.data(), gamma.data(),
                                                     mean_c.data(), rstd_c.data(), b.host(), H, drop, dx_c.data(),
                                                     dres_c.data(), gbias.data(), gg.data(), gb.data());
      DBuf<bf16> dx_g(n), dres_g(n);
      dx_g.poison();
      dres_g.poison();
      auto dgbias = up(gbias0), dgg = up(gg0), dgb = up(gb0);
      gpu().bias_dropout_residual_layernorm_backward(d_dout->p, dx_in->p, dbias->p, dres->p, dgamma->p, mean_g.p,
                                                     rstd_g.p, b.device(), H, drop, dx_g.p, dres_g.p, dgbias->p,
                                                     dgg->p, dgb->p);
      const Vec dx = down(dx_g);
      expect_close("d_x", dx, dx_c, kTolOut);
      expect_close("d_residual", down(dres_g), dres_c, kTolOut);
      expect_close("d_bias (+=)", minus(down(*dgbias), gbias0), minus(gbias, gbias0), kTolF32);
      expect_close("d_ln_gamma (+=)", minus(down(*dgg), gg0), minus(gg, gg0), kTolF32);
      expect_close("d_ln_beta (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolF32);
      EXPECT_NEAR(zero_fraction(dx), p, 0.01) << "fraction of dropped elements in d_x";
    }
}

struct DenseCase {
  int64_t rows;
  int32_t k, n;
  ops::Activation act;
  bool bias, accumulate_dx;
};

TEST(CudaOps, Dense) {
  const DenseCase cases[] = {
      {1, 128, 128, ops::Activation::kNone, true, false},    {2, 128, 384, ops::Activation::kGelu, true, false},
      {63, 1024, 1024, ops::Activation::kNone, false, true}, {129, 1024, 4096, ops::Activation::kGelu, true, false},
      {511, 4096, 1024, ops::Activation::kNone, true, true}, {1000, 128, 2, ops::Activation::kNone, true, false},
      {77, 128, 1003, ops::Activation::kNone, true, false},
  };
  for (const auto& c : cases) {
    const bool gelu = c.act == ops::Activation::kGelu;
    const std::string tag = "rows=" + std::to_string(c.rows) + " k=" + std::to_string(c.k) +
                            " n=" + std::to_string(c.n) + (gelu ? " gelu" : "") + (c.bias ? " bias" : "") +
                            (c.accumulate_dx ? " accumulate_dx" : "");
    SCOPED_TRACE(tag);
    std::printf("  dense %s\n", tag.c_str());
    Rng rng({13u, static_cast<uint64_t>(c.rows), static_cast<uint64_t>(c.n)});
    const float ws = 1.0f / std::sqrt(static_cast<float>(c.k));
    Vec x = rand_vec(rng, c.rows * c.k, -1, 1), w = rand_vec(rng, size_t(c.n) * c.k, -2 * ws, 2 * ws),
        bias = rand_vec(rng, c.n, -0.5f, 0.5f);
    auto dx_in = up_bf16(x), dw = up_bf16(w), dbias = up_bf16(bias);
    Vec y_c(c.rows * c.n), pre_c(c.rows * c.n);
    cpu().dense_forward(x.data(), w.data(), c.bias ? bias.data() : nullptr, c.rows, c.k, c.n, c.act, y_c.data(),
                        pre_c.data());
    DBuf<bf16> y_g(c.rows * c.n), pre_g(c.rows * c.n);
    y_g.poison();
    pre_g.poison();
    gpu().dense_forward(dx_in->p, dw->p, c.bias ? dbias->p : nullptr, c.rows, c.k, c.n, c.act, y_g.p,
                        gelu ? pre_g.p : nullptr);
    expect_close("y", down(y_g), y_c, gelu ? kTolChain : kTolOut);
    if (gelu) expect_close("pre_act", down(pre_g), pre_c, kTolOut);

    Vec dy = rand_vec(rng, c.rows * c.n, -1, 1);
    auto d_dy = up_bf16(dy);
    Vec dx0 = c.accumulate_dx ? rand_vec(rng, c.rows * c.k, -1, 1) : Vec(c.rows * c.k, 0.0f);
    Vec gw0 = rand_vec(rng, w.size(), -1, 1), gb0 = rand_vec(rng, c.n, -1, 1);
    Vec dx_c = dx0, gw = gw0, gb = gb0;
    // The CPU gets its own pre_act, the GPU its bf16 one: each backend's backward reads what its forward saved.
    cpu().dense_backward(dy.data(), x.data(), w.data(), pre_c.data(), c.rows, c.k, c.n, c.act, dx_c.data(),
                         c.accumulate_dx, gw.data(), gb.data());
    DBuf<bf16> dx_g(c.rows * c.k);
    if (c.accumulate_dx) {
      auto tmp = up_bf16(dx0);
      ASSERT_EQ(cudaMemcpyAsync(dx_g.p, tmp->p, dx_g.n * sizeof(bf16), cudaMemcpyDeviceToDevice, gpu().stream()),
                cudaSuccess);
    } else {
      dx_g.poison();
    }
    auto dgw = up(gw0), dgb = up(gb0);
    gpu().dense_backward(d_dy->p, dx_in->p, dw->p, gelu ? pre_g.p : nullptr, c.rows, c.k, c.n, c.act, dx_g.p,
                         c.accumulate_dx, dgw->p, dgb->p);
    expect_close(c.accumulate_dx ? "dx (+=)" : "dx", down(dx_g), dx_c, gelu ? kTolChain : kTolOut);
    expect_close("d_weight (+=)", minus(down(*dgw), gw0), minus(gw, gw0), kTolGrad);
    expect_close("d_bias (+=)", minus(down(*dgb), gb0), minus(gb, gb0), kTolGrad);
  }
}

TEST(CudaOps, Attention) {
  for (int32_t heads : {2, 16})
    for (float p : {0.0f, 0.1f}) {
      const int32_t hd = 64, H = heads * hd;
      SCOPED_TRACE("heads=" + std::to_string(heads) + " p=" + std::to_string(p));
      std::printf("  attention heads=%d hd=%d p=%.1f\n", heads, hd, p);
      Rng rng({14u, static_cast<uint64_t>(heads), static_cast<uint64_t>(p * 10)});
      Batch b = make_batch(rng, 2);
      const int32_t T = b.T;
      Vec qkv = rand_vec(rng, static_cast<size_t>(T) * 3 * H, -1, 1);
      auto d_qkv_in = up_bf16(qkv);
      const auto drop = dropout(p, 5);
      Vec ctx_c(static_cast<size_t>(T) * H), lse_c(static_cast<size_t>(heads) * T);
      cpu().attention_forward(qkv.data(), b.host(), heads, hd, drop, ctx_c.data(), lse_c.data());
      DBuf<bf16> ctx_g(static_cast<size_t>(T) * H);
      DBuf<float> lse_g(static_cast<size_t>(heads) * T);
      ctx_g.poison();
      lse_g.poison();
      gpu().attention_forward(d_qkv_in->p, b.device(), heads, hd, drop, ctx_g.p, lse_g.p);
      expect_close("ctx", down(ctx_g), ctx_c, kTolChain);  // P is bf16 inside FMHA, then ctx is rounded
      expect_close("lse", down(lse_g), lse_c, kTolF32);

      Vec dctx = rand_vec(rng, static_cast<size_t>(T) * H, -1, 1);
      auto d_dctx = up_bf16(dctx);
      Vec dqkv_c(static_cast<size_t>(T) * 3 * H);
      cpu().attention_backward(dctx.data(), qkv.data(), ctx_c.data(), lse_c.data(), b.host(), heads, hd, drop,
                               dqkv_c.data());
      DBuf<bf16> dqkv_g(static_cast<size_t>(T) * 3 * H);
      dqkv_g.poison();
      gpu().attention_backward(d_dctx->p, d_qkv_in->p, ctx_g.p, lse_g.p, b.device(), heads, hd, drop, dqkv_g.p);
      const Vec dqkv = down(dqkv_g);
      // q, k and v blocks separately, so a wrong block is named.
      for (int part = 0; part < 3; ++part) {
        Vec g, c;
        for (int32_t t = 0; t < T; ++t)
          for (int32_t j = 0; j < H; ++j) {
            g.push_back(dqkv[(static_cast<size_t>(t) * 3 + part) * H + j]);
            c.push_back(dqkv_c[(static_cast<size_t>(t) * 3 + part) * H + j]);
          }
        expect_close(part == 0 ? "d_q" : part == 1 ? "d_k" : "d_v", g, c, 3e-2);  // chain through bf16 dS and P
      }
    }
}

TEST(CudaOps, MlmHeadLoss) {
  struct Case {
    int32_t H, V, M;
  };
  for (const Case c : {Case{128, 1003, 77}, Case{1024, 30522, 150}}) {
    SCOPED_TRACE("H=" + std::to_string(c.H) + " V=" + std::to_string(c.V) + " M=" + std::to_string(c.M));
    std::printf("  mlm head H=%d V=%d M=%d\n", c.H, c.V, c.M);
    Rng rng({15u, static_cast<uint64_t>(c.H)});
    const int32_t H = c.H, V = c.V, M = c.M, T = 4 * M + 3;
    Vec hidden = rand_vec(rng, static_cast<size_t>(T) * H, -1, 1);
    std::vector<int32_t> all(T);
    std::iota(all.begin(), all.end(), 0);
    rng.shuffle(all.begin(), all.end());
    std::vector<int32_t> positions(all.begin(), all.begin() + M), labels(M);
    for (auto& l : labels) l = static_cast<int32_t>(rng.uniform_int(0, V - 1));
    const float ws = 1.0f / std::sqrt(static_cast<float>(H));
    Vec tw = rand_vec(rng, static_cast<size_t>(H) * H, -2 * ws, 2 * ws), tb = rand_vec(rng, H, -0.5f, 0.5f),
        lg = rand_vec(rng, H, 0.5f, 1.5f), lb = rand_vec(rng, H, -0.5f, 0.5f),
        emb = rand_vec(rng, static_cast<size_t>(V) * H, -0.1f, 0.1f), ob = rand_vec(rng, V, -0.5f, 0.5f);
    ops::MlmHeadWeights<float> wc{tw.data(), tb.data(), lg.data(), lb.data(), emb.data(), ob.data(), H, V, 1e-12};
    Vec s_gath(static_cast<size_t>(M) * H), s_pre(static_cast<size_t>(M) * H), s_act(static_cast<size_t>(M) * H), s_mean(M), s_rstd(M), s_ln(static_cast<size_t>(M) * H),
        s_probs(static_cast<size_t>(M) * V);
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

    auto d_hidden_in = up_bf16(hidden), d_tw = up_bf16(tw), d_tb = up_bf16(tb), d_lg = up_bf16(lg),
         d_lb = up_bf16(lb), d_emb = up_bf16(emb), d_ob = up_bf16(ob);
    auto d_pos = up(positions), d_lab = up(labels);
    ops::MlmHeadWeights<bf16> wg{d_tw->p, d_tb->p, d_lg->p, d_lb->p, d_emb->p, d_ob->p, H, V, 1e-12};
    DBuf<bf16> g_gath(static_cast<size_t>(M) * H), g_pre(static_cast<size_t>(M) * H), g_act(static_cast<size_t>(M) * H), g_ln(static_cast<size_t>(M) * H),
        g_probs(static_cast<size_t>(M) * V);
    DBuf<float> g_mean(M), g_rstd(M), g_loss(1);
    DBuf<int32_t> g_correct(1);
    for (auto* d : {&g_gath, &g_pre, &g_act, &g_ln, &g_probs}) d->poison();
    g_mean.poison();
    g_rstd.poison();
    g_loss.poison();
    g_correct.poison();
    ops::MlmHeadSaved<bf16, float> sg{g_gath.p, g_pre.p, g_act.p, g_mean.p, g_rstd.p, g_ln.p, g_probs.p};
    gpu().mlm_head_loss_forward(d_hidden_in->p, d_pos->p, d_lab->p, M, wg, sg, g_loss.p, g_correct.p);
    expect_close("gathered", down(g_gath), s_gath, 1e-6);
    expect_close("transform_pre", down(g_pre), s_pre, kTolOut);
    expect_close("transform_act", down(g_act), s_act, kTolChain);
    expect_close("ln_out", down(g_ln), s_ln, kTolChain);
    expect_close("probs", down(g_probs), s_probs, 3e-2);  // softmax of bf16 logits, rounded to bf16
    const float loss_g = down(g_loss)[0];
    const int32_t correct_g = down(g_correct)[0];
    std::printf("    loss %.6g (cpu %.6g), correct %d (cpu %d)\n", loss_g, loss_c, correct_g, correct_c);
    EXPECT_NEAR(loss_g, loss_c, 1e-2 * std::abs(loss_c)) << "loss_sum";
    EXPECT_NEAR(correct_g, correct_c, std::max(1, M / 50)) << "num_correct (near-ties may flip)";
    EXPECT_GE(correct_c, M / 2) << "test setup: the CPU's argmax labels should all hit";

    const double scale = 1.0 / M;
    // d_hidden starts small and nonzero: the increments (~1e-3 here) are then not swamped by the bf16 rounding of
    // dh0 + increment, and a '=' instead of '+=' still shows.
    Vec dh0 = rand_vec(rng, static_cast<size_t>(T) * H, -0.01f, 0.01f), dh_c = dh0;
    Vec g0[6] = {rand_vec(rng, tw.size(), -1, 1), rand_vec(rng, H, -1, 1), rand_vec(rng, H, -1, 1),
                 rand_vec(rng, H, -1, 1),         rand_vec(rng, emb.size(), -1, 1), rand_vec(rng, V, -1, 1)};
    Vec gc[6] = {g0[0], g0[1], g0[2], g0[3], g0[4], g0[5]};
    cpu().mlm_head_loss_backward(scale, positions.data(), labels.data(), M, wc, sc,
                                 {gc[0].data(), gc[1].data(), gc[2].data(), gc[3].data(), gc[4].data(), gc[5].data()},
                                 dh_c.data());
    std::unique_ptr<DBuf<float>> gg[6];
    for (int i = 0; i < 6; ++i) gg[i] = up(g0[i]);
    auto d_dh = up_bf16(dh0);
    gpu().mlm_head_loss_backward(scale, d_pos->p, d_lab->p, M, wg, sg,
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
    expect_close("d_hidden (+= at positions)", inc_g, inc_c, 3e-2);  // through bf16 d_logits, dz, dpre, d_hidden
    const char* names[6] = {"d_transform_weight", "d_transform_bias", "d_ln_gamma",
                            "d_ln_beta",          "d_word_embeddings", "d_output_bias"};
    for (int i = 0; i < 6; ++i)
      expect_close(std::string(names[i]) + " (+=)", minus(down(*gg[i]), g0[i]), minus(gc[i], g0[i]), kTolChain);
  }
}

TEST(CudaOps, NspHeadLoss) {
  for (int32_t H : {128, 1024}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    std::printf("  nsp head H=%d\n", H);
    Rng rng({16u, static_cast<uint64_t>(H)});
    Batch b = make_batch(rng, 20);
    const int32_t T = b.T, B = b.B;
    Vec hidden = rand_vec(rng, static_cast<size_t>(T) * H, -1, 1);
    std::vector<int32_t> labels(B);
    for (auto& l : labels) l = static_cast<int32_t>(rng.uniform_int(0, 1));
    const float ws = 1.0f / std::sqrt(static_cast<float>(H));
    Vec pw = rand_vec(rng, static_cast<size_t>(H) * H, -2 * ws, 2 * ws), pb = rand_vec(rng, H, -0.5f, 0.5f),
        cw = rand_vec(rng, static_cast<size_t>(2) * H, -2 * ws, 2 * ws), cb = rand_vec(rng, 2, -0.5f, 0.5f);
    ops::NspHeadWeights<float> wc{pw.data(), pb.data(), cw.data(), cb.data(), H};
    Vec s_cls(static_cast<size_t>(B) * H), s_pooled(static_cast<size_t>(B) * H), s_probs(static_cast<size_t>(B) * 2);
    ops::NspHeadSaved<float> sc{s_cls.data(), s_pooled.data(), s_probs.data()};
    float loss_c = 0;
    int32_t correct_c = 0;
    cpu().nsp_head_loss_forward(hidden.data(), b.host(), labels.data(), wc, sc, &loss_c, &correct_c);

    auto d_hidden_in = up_bf16(hidden), d_pw = up_bf16(pw), d_pb = up_bf16(pb), d_cw = up_bf16(cw),
         d_cb = up_bf16(cb);
    auto d_lab = up(labels);
    ops::NspHeadWeights<bf16> wg{d_pw->p, d_pb->p, d_cw->p, d_cb->p, H};
    DBuf<bf16> g_cls(static_cast<size_t>(B) * H), g_pooled(static_cast<size_t>(B) * H), g_probs(static_cast<size_t>(B) * 2);
    DBuf<float> g_loss(1);
    DBuf<int32_t> g_correct(1);
    g_cls.poison();
    g_pooled.poison();
    g_probs.poison();
    g_loss.poison();
    g_correct.poison();
    ops::NspHeadSaved<bf16> sg{g_cls.p, g_pooled.p, g_probs.p};
    gpu().nsp_head_loss_forward(d_hidden_in->p, b.device(), d_lab->p, wg, sg, g_loss.p, g_correct.p);
    expect_close("cls", down(g_cls), s_cls, 1e-6);
    expect_close("pooled", down(g_pooled), s_pooled, kTolChain);
    expect_close("probs", down(g_probs), s_probs, kTolChain);
    const float loss_g = down(g_loss)[0];
    const int32_t correct_g = down(g_correct)[0];
    std::printf("    loss %.6g (cpu %.6g), correct %d (cpu %d) of %d\n", loss_g, loss_c, correct_g, correct_c, B);
    EXPECT_NEAR(loss_g, loss_c, 2e-2 * std::abs(loss_c)) << "loss_sum";
    EXPECT_NEAR(correct_g, correct_c, 1) << "num_correct (a near-tie may flip)";

    const double scale = 0.37;
    Vec dh0 = rand_vec(rng, static_cast<size_t>(T) * H, -0.01f, 0.01f), dh_c = dh0;  // small: see the MLM test
    Vec g0[4] = {rand_vec(rng, pw.size(), -1, 1), rand_vec(rng, H, -1, 1), rand_vec(rng, cw.size(), -1, 1),
                 rand_vec(rng, 2, -1, 1)};
    Vec gc[4] = {g0[0], g0[1], g0[2], g0[3]};
    cpu().nsp_head_loss_backward(scale, b.host(), labels.data(), wc, sc,
                                 {gc[0].data(), gc[1].data(), gc[2].data(), gc[3].data()}, dh_c.data());
    std::unique_ptr<DBuf<float>> gg[4];
    for (int i = 0; i < 4; ++i) gg[i] = up(g0[i]);
    auto d_dh = up_bf16(dh0);
    gpu().nsp_head_loss_backward(scale, b.device(), d_lab->p, wg, sg, {gg[0]->p, gg[1]->p, gg[2]->p, gg[3]->p},
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
    expect_close("d_hidden (+= at CLS)", inc_g, inc_c, 3e-2);  // through bf16 d_logits, d_pooled, d_hidden
    const char* names[4] = {"d_pooler_weight", "d_pooler_bias", "d_classifier_weight", "d_classifier_bias"};
    for (int i = 0; i < 4; ++i)
      expect_close(std::string(names[i]) + " (+=)", minus(down(*gg[i]), g0[i]), minus(gc[i], g0[i]), kTolChain);
  }
}

}  // namespace
}  // namespace nopad
