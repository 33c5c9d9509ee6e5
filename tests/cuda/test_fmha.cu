// GPU tests of the FMHA kernels (src/ops/cuda/fmha.h) against (a) the fp32 CPU twin
// ops::CpuBackend<CpuF32>::attention_forward/backward and (b) a float64 reference written here, on the same inputs
// (random values rounded to bf16/fp16, so every implementation sees identical numbers).
//
// Each case prints its relative errors ||x - ref64|| / ||ref64|| for the GPU and for the CPU twin, so a failure report
// shows by how much a bound was missed. Every case runs every kernel variant (fmha.h: fwd_variant / bwd_variant), and
// Fmha.PerfSmoke times each variant and checks its outputs against the default variant's on the same inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/philox.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/attention_groups.h"
#include "ops/cuda/fmha.h"

namespace nopad::cuda {
namespace {

#define CK(call)                                                                                 \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_) << " at line " << __LINE__; \
  } while (0)

template <class T>
struct DevBuf {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DevBuf(size_t n) : count(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  size_t bytes() const { return count * sizeof(T); }
};

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Host storage: 16-bit bits + the exact float value they encode.
uint16_t round16(float x, bool fp16, float& exact) {
  if (fp16) {
    const f16 h = to_f16(x);
    exact = to_float(h);
    return h.bits;
  }
  const bf16 b = to_bf16(x);
  exact = to_float(b);
  return b.bits;
}
float from16(uint16_t bits, bool fp16) { return fp16 ? to_float(f16{bits}) : to_float(bf16{bits}); }

double rel_err(const std::vector<double>& ref, const std::vector<float>& x) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(x[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}
// max_i |x - ref| / max_i |ref|: catches a few wrong elements that a norm would average away (e.g. one mask bit).
double max_err(const std::vector<double>& ref, const std::vector<float>& x) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(x[i]) - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return num / std::max(den, 1e-300);
}
size_t count_nonfinite(const std::vector<float>& x) {
  return static_cast<size_t>(std::count_if(x.begin(), x.end(), [](float v) { return !std::isfinite(v); }));
}

struct Problem {
  std::vector<int32_t> lens, cu;
  std::vector<uint64_t> sample_ids;
  int T = 0, heads = 0, hd = 0, max_len = 0;
  bool fp16 = false;
  float p = 0.0f;
  uint64_t seed = 1234, step = 7;
  uint32_t op_id = 3;
  std::vector<uint16_t> qkv16, dctx16;  // device inputs
  std::vector<float> qkv, dctx;         // the same values as floats
  int H() const { return heads * hd; }
  ops::Dropout dropout() const {  // the CPU twin's view of this problem's dropout
    ops::Dropout d;
    d.p = p;
    d.seed = seed;
    d.step = step;
    d.op_id = op_id;
    return d;
  }
};

Problem make_problem(const std::vector<int32_t>& lens, int heads, int hd, float p, bool fp16, uint32_t rng_seed) {
  Problem pr;
  pr.lens = lens;
  pr.heads = heads;
  pr.hd = hd;
  pr.p = p;
  pr.fp16 = fp16;
  pr.cu.push_back(0);
  for (size_t b = 0; b < lens.size(); ++b) {
    pr.cu.push_back(pr.cu.back() + lens[b]);
    pr.sample_ids.push_back(1000003ull * (b + 1) + 17);
    pr.max_len = std::max(pr.max_len, lens[b]);
  }
  pr.T = pr.cu.back();
  std::mt19937 rng(rng_seed);
  // q, k spread so that softmax rows are neither flat nor one-hot: |scores| up to a few units.
  std::uniform_real_distribution<float> uq(-1.5f, 1.5f), uv(-1.0f, 1.0f);
  const size_t n = static_cast<size_t>(pr.T) * 3 * pr.H();
  pr.qkv16.resize(n);
  pr.qkv.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const bool is_v = (i % (3 * pr.H())) >= static_cast<size_t>(2 * pr.H());
    pr.qkv16[i] = round16(is_v ? uv(rng) : uq(rng), fp16, pr.qkv[i]);
  }
  const size_t m = static_cast<size_t>(pr.T) * pr.H();
  pr.dctx16.resize(m);
  pr.dctx.resize(m);
  for (size_t i = 0; i < m; ++i) pr.dctx16[i] = round16(uv(rng), fp16, pr.dctx[i]);
  return pr;
}

// ------------------------------------------------------------------------------------------ float64 reference
struct Ref {
  std::vector<double> ctx, lse, dqkv;
};
Ref reference64(const Problem& pr) {
  const int H = pr.H(), hd = pr.hd;
  const int64_t ld = 3 * int64_t{H};
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const uint64_t key = dropout_stream_key(pr.seed, pr.step, pr.op_id);
  const double keep_scale = attention_dropout_keep_scale(attention_dropout_threshold(pr.p));  // the contract's float
  Ref r;
  r.ctx.assign(static_cast<size_t>(pr.T) * H, 0.0);
  r.lse.assign(static_cast<size_t>(pr.heads) * pr.T, 0.0);
  r.dqkv.assign(static_cast<size_t>(pr.T) * ld, 0.0);
  const auto& x = pr.qkv;
  std::vector<double> P, M, dP;
  for (size_t b = 0; b < pr.lens.size(); ++b) {
    const int s0 = pr.cu[b], L = pr.lens[b];
    P.assign(static_cast<size_t>(L) * L, 0);
    M.assign(static_cast<size_t>(L) * L, 0);
    dP.assign(static_cast<size_t>(L) * L, 0);
    for (int h = 0; h < pr.heads; ++h) {
      auto q = [&](int i, int d) { return static_cast<double>(x[(s0 + i) * ld + h * hd + d]); };
      auto k = [&](int j, int d) { return static_cast<double>(x[(s0 + j) * ld + H + h * hd + d]); };
      auto v = [&](int j, int d) { return static_cast<double>(x[(s0 + j) * ld + 2 * H + h * hd + d]); };
      auto dO = [&](int i, int d) { return static_cast<double>(pr.dctx[static_cast<size_t>(s0 + i) * H + h * hd + d]); };
      for (int i = 0; i < L; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < L; ++j) {
          double sc = 0;
          for (int d = 0; d < hd; ++d) sc += q(i, d) * k(j, d);
          P[i * L + j] = sc * scale;
          mx = std::max(mx, P[i * L + j]);
        }
        double sum = 0;
        for (int j = 0; j < L; ++j) sum += (P[i * L + j] = std::exp(P[i * L + j] - mx));
        r.lse[static_cast<size_t>(h) * pr.T + s0 + i] = mx + std::log(sum);
        for (int j = 0; j < L; ++j) {
          P[i * L + j] /= sum;
          const bool kept = attention_dropout_keep_key(key, pr.sample_ids[b], element_attention(h, i, j), pr.p);
          M[i * L + j] = kept ? keep_scale : 0.0;
        }
        for (int d = 0; d < hd; ++d) {
          double o = 0;
          for (int j = 0; j < L; ++j) o += P[i * L + j] * M[i * L + j] * v(j, d);
          r.ctx[static_cast<size_t>(s0 + i) * H + h * hd + d] = o;
        }
      }
      // Backward.
      for (int i = 0; i < L; ++i) {
        double D = 0;
        for (int d = 0; d < hd; ++d) D += dO(i, d) * r.ctx[static_cast<size_t>(s0 + i) * H + h * hd + d];
        for (int j = 0; j < L; ++j) {
          double dp = 0;
          for (int d = 0; d < hd; ++d) dp += dO(i, d) * v(j, d);
          dP[i * L + j] = P[i * L + j] * (dp * M[i * L + j] - D) * scale;  // dS, scaled
        }
      }
      for (int i = 0; i < L; ++i)
        for (int d = 0; d < hd; ++d) {
          double dq = 0;
          for (int j = 0; j < L; ++j) dq += dP[i * L + j] * k(j, d);
          r.dqkv[(s0 + i) * ld + h * hd + d] = dq;
        }
      for (int j = 0; j < L; ++j)
        for (int d = 0; d < hd; ++d) {
          double dk = 0, dv = 0;
          for (int i = 0; i < L; ++i) {
            dk += dP[i * L + j] * q(i, d);
            dv += P[i * L + j] * M[i * L + j] * dO(i, d);
          }
          r.dqkv[(s0 + j) * ld + H + h * hd + d] = dk;
          r.dqkv[(s0 + j) * ld + 2 * H + h * hd + d] = dv;
        }
    }
  }
  return r;
}

// ------------------------------------------------------------------------------------------ CPU twin (fp32)
struct Out {
  std::vector<float> ctx, lse, dqkv;
};
Out cpu_twin(const Problem& pr) {
  ops::CpuBackend<ops::CpuF32> cpu(0);
  ops::SeqView seqs;
  seqs.num_tokens = pr.T;
  seqs.num_seqs = static_cast<int32_t>(pr.lens.size());
  seqs.max_seqlen = pr.max_len;
  seqs.cu_seqlens = pr.cu.data();
  seqs.sample_ids = pr.sample_ids.data();
  const ops::Dropout drop = pr.dropout();
  Out o;
  o.ctx.resize(static_cast<size_t>(pr.T) * pr.H());
  o.lse.resize(static_cast<size_t>(pr.heads) * pr.T);
  o.dqkv.resize(static_cast<size_t>(pr.T) * 3 * pr.H());
  cpu.attention_forward(pr.qkv.data(), seqs, pr.heads, pr.hd, drop, o.ctx.data(), o.lse.data());
  cpu.attention_backward(pr.dctx.data(), pr.qkv.data(), o.ctx.data(), o.lse.data(), seqs, pr.heads, pr.hd, drop,
                         o.dqkv.data(), nullptr);
  return o;
}

// ------------------------------------------------------------------------------------------ GPU
struct GpuRun {
  DevBuf<uint16_t> qkv, ctx, dctx, dqkv;
  DevBuf<float> lse, bias;  // bias: FmhaParams::d_qkv_bias [3H] when a test sets it
  DevBuf<int32_t> cu, idx;
  DevBuf<uint64_t> sid;
  DevBuf<unsigned char> ws;
  FmhaParams p;
  explicit GpuRun(const Problem& pr)
      : qkv(pr.qkv16.size()),
        ctx(static_cast<size_t>(pr.T) * pr.H()),
        dctx(static_cast<size_t>(pr.T) * pr.H()),
        dqkv(pr.qkv16.size()),
        lse(static_cast<size_t>(pr.heads) * pr.T),
        bias(static_cast<size_t>(3) * pr.H()),
        cu(pr.cu.size()),
        idx(pr.lens.size()),
        sid(pr.sample_ids.size()),
        ws(fmha_backward_workspace_bytes(pr.T, pr.heads, pr.hd)) {
    p.qkv = qkv.ptr;
    p.ctx = ctx.ptr;
    p.lse = lse.ptr;
    p.d_ctx = dctx.ptr;
    p.d_qkv = dqkv.ptr;
    p.workspace = ws.ptr;
    p.workspace_bytes = ws.bytes();
    p.cu_seqlens = cu.ptr;
    p.sample_ids = sid.ptr;
    p.num_seqs = static_cast<int32_t>(pr.lens.size());
    p.num_launch_seqs = p.num_seqs;
    p.num_tokens = pr.T;
    p.max_seqlen = pr.max_len;
    p.num_heads = pr.heads;
    p.head_dim = pr.hd;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(pr.hd)));
    p.dropout_p = pr.p;
    p.seed = pr.seed;
    p.step = pr.step;
    p.op_id = pr.op_id;
    p.fp16 = pr.fp16;
  }
  bool ok() const {
    return qkv.ptr && ctx.ptr && dctx.ptr && dqkv.ptr && lse.ptr && bias.ptr && cu.ptr && idx.ptr && sid.ptr && ws.ptr;
  }
};

void upload(GpuRun& g, const Problem& pr) {
  ASSERT_TRUE(g.ok()) << "cudaMalloc failed";
  CK(cudaMemcpy(g.qkv.ptr, pr.qkv16.data(), g.qkv.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.dctx.ptr, pr.dctx16.data(), g.dctx.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.cu.ptr, pr.cu.data(), g.cu.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(g.sid.ptr, pr.sample_ids.data(), g.sid.bytes(), cudaMemcpyHostToDevice));
}
// 0xFF everywhere an output goes (NaN in bf16/fp16/fp32), so an element the kernels forget shows up as non-finite.
void poison(GpuRun& g) {
  CK(cudaMemset(g.ctx.ptr, 0xFF, g.ctx.bytes()));
  CK(cudaMemset(g.lse.ptr, 0xFF, g.lse.bytes()));
  CK(cudaMemset(g.dqkv.ptr, 0xFF, g.dqkv.bytes()));
  CK(cudaMemset(g.ws.ptr, 0xFF, g.ws.bytes()));  // fmha_backward must zero what it accumulates into
}
Out download(GpuRun& g, const Problem& pr) {
  Out o;
  std::vector<uint16_t> c(g.ctx.count), d(g.dqkv.count);
  o.lse.resize(g.lse.count);
  EXPECT_EQ(cudaMemcpy(c.data(), g.ctx.ptr, g.ctx.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d.data(), g.dqkv.ptr, g.dqkv.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(o.lse.data(), g.lse.ptr, g.lse.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  o.ctx.resize(c.size());
  o.dqkv.resize(d.size());
  for (size_t i = 0; i < c.size(); ++i) o.ctx[i] = from16(c[i], pr.fp16);
  for (size_t i = 0; i < d.size(); ++i) o.dqkv[i] = from16(d[i], pr.fp16);
  return o;
}

// The bias gradient (FmhaParams::d_qkv_bias) accumulates: it starts at bias_start(j) and must end at that plus the
// column sums of the q and v blocks of the d_qkv the same launch wrote (the downloaded 16-bit values, summed in
// double). fp32 atomics in any order: within a few fp32 roundings of the sum of the magnitudes. The k block's part
// (the k bias has no gradient, fmha.h) must be untouched: its start values exactly.
double bias_start(int j) { return 0.5 - 0.01 * j; }
void arm_bias(GpuRun& g) {
  std::vector<float> b(g.bias.count);
  for (size_t j = 0; j < b.size(); ++j) b[j] = static_cast<float>(bias_start(static_cast<int>(j)));
  CK(cudaMemcpy(g.bias.ptr, b.data(), g.bias.bytes(), cudaMemcpyHostToDevice));
  g.p.d_qkv_bias = g.bias.ptr;
}
void check_bias(GpuRun& g, const Problem& pr, const Out& o, const std::string& what) {
  std::vector<float> got(g.bias.count);
  CK(cudaMemcpy(got.data(), g.bias.ptr, g.bias.bytes(), cudaMemcpyDeviceToHost));
  const int n = 3 * pr.H();
  size_t bad = 0;
  double worst = 0;
  for (int j = 0; j < n; ++j) {
    double want = bias_start(j), mag = std::fabs(want);
    if (j >= pr.H() && j < 2 * pr.H()) {  // the k block
      if (got[j] != static_cast<float>(want)) {
        if (bad < 5) ADD_FAILURE() << what << ": d_qkv_bias[" << j << "] (k block) = " << got[j] << ", not its start "
                                   << static_cast<float>(want);
        ++bad;
      }
      continue;
    }
    for (int t = 0; t < pr.T; ++t) {
      const double v = o.dqkv[static_cast<size_t>(t) * n + j];
      want += v;
      mag += std::fabs(v);
    }
    const double err = std::fabs(got[j] - want) / (mag + 1e-30);
    worst = std::max(worst, err);
    if (!(err <= 1e-5)) {
      if (bad < 5)
        ADD_FAILURE() << what << ": d_qkv_bias[" << j << "] = " << got[j] << ", column sum " << want
                      << " (sum of magnitudes " << mag << ")";
      ++bad;
    }
  }
  std::printf("  [%s] d_qkv_bias: worst error %.3e of the column's sum of magnitudes, %zu of %d columns bad\n",
              what.c_str(), worst, bad, n);
}

// Splits d_qkv [T, 3H] into its q, k, v blocks.
std::vector<double> block_of(const std::vector<double>& x, const Problem& pr, int blk) {
  std::vector<double> r;
  const int H = pr.H();
  for (int t = 0; t < pr.T; ++t)
    for (int c = 0; c < H; ++c) r.push_back(x[static_cast<size_t>(t) * 3 * H + blk * H + c]);
  return r;
}
std::vector<float> block_of(const std::vector<float>& x, const Problem& pr, int blk) {
  std::vector<float> r;
  const int H = pr.H();
  for (int t = 0; t < pr.T; ++t)
    for (int c = 0; c < H; ++c) r.push_back(x[static_cast<size_t>(t) * 3 * H + blk * H + c]);
  return r;
}

// Tolerances. The CPU twin computes in fp32 from the same (already rounded) inputs, so its error against the float64
// reference (~1e-7) is a measure of pure fp32 arithmetic noise; 3x that allows for the GPU's different (tiled, online-
// softmax) summation order. On top of that the GPU necessarily rounds to 16 bits where the CPU twin does not:
//   forward: P before the P V product, and ctx itself (unit roundoff u = 2^-8 for bf16, 2^-11 for fp16): per-element
//            relative errors <= u/2 that are independent, so the norm-relative error is about u/2 .. u; floor 1.5 u.
//   lse:     computed in fp32 from exact 16-bit products: no 16-bit rounding at all; floor 1e-5.
//   backward: additionally ctx (in D = dO.O), P' and dS in 16 bits before the tensor-core products, and the outputs;
//            these compound (dS = P (dP - D) is a difference of similar numbers for peaked rows); floor 4 u.
// Measured errors are printed, so the bounds can be tightened once real numbers are in.
struct Tol {
  double ctx, lse, grad;
};
Tol floors(bool fp16) {
  const double u = fp16 ? 1.0 / 2048 : 1.0 / 256;
  return {1.5 * u, 1e-5, 4 * u};
}

// Every output of the GPU against the float64 reference ctx [rows, H], lse [heads, rows], d_qkv [T, 3H] (rows: the
// query rows, T unless the queries are a subset), with the CPU twin's error on the same outputs as the measure of
// fp32 noise.
void compare_outputs(const Problem& pr, const Out& gpu, const Out& cpu, const std::vector<double>& ref_ctx,
                     const std::vector<double>& ref_lse, const std::vector<double>& ref_dqkv, const char* what) {
  const Tol f = floors(pr.fp16);
  ASSERT_EQ(count_nonfinite(gpu.ctx), 0u) << what << ": ctx elements not written (poison 0xFF survived) or NaN";
  ASSERT_EQ(count_nonfinite(gpu.lse), 0u) << what << ": lse elements not written or NaN";
  ASSERT_EQ(count_nonfinite(gpu.dqkv), 0u) << what << ": d_qkv elements not written or NaN";
  struct Item {
    const char* name;
    std::vector<double> r;
    std::vector<float> g, c;
    double floor;
  };
  std::vector<Item> items;
  items.push_back({"ctx", ref_ctx, gpu.ctx, cpu.ctx, f.ctx});
  items.push_back({"lse", ref_lse, gpu.lse, cpu.lse, f.lse});
  const char* names[3] = {"dq", "dk", "dv"};
  for (int blk = 0; blk < 3; ++blk)
    items.push_back({names[blk], block_of(ref_dqkv, pr, blk), block_of(gpu.dqkv, pr, blk),
                     block_of(cpu.dqkv, pr, blk), f.grad});
  for (const Item& it : items) {
    const double eg = rel_err(it.r, it.g), ec = rel_err(it.r, it.c);
    const double mg = max_err(it.r, it.g), mc = max_err(it.r, it.c);
    const double bound = 3 * ec + it.floor;
    std::printf("  [%s] %-3s  rel err gpu %.3e  cpu %.3e  (bound %.3e)   max err gpu %.3e  cpu %.3e\n", what, it.name,
                eg, ec, bound, mg, mc);
    EXPECT_LE(eg, bound) << what << ": " << it.name << " relative error of the GPU vs float64 exceeds the bound";
    // Element-wise: a wrong mask bit or a mis-tiled row shows here even when the norm hides it. 10x the norm floor
    // covers the tail of the per-element rounding distribution.
    EXPECT_LE(mg, 3 * mc + 10 * it.floor) << what << ": " << it.name << " worst element of the GPU vs float64";
  }
}

void compare_all(const Problem& pr, const Out& gpu, const Out& cpu, const Ref& ref, const char* what) {
  compare_outputs(pr, gpu, cpu, ref.ctx, ref.lse, ref.dqkv, what);
}

std::string variant_label(int fwd, int bwd) {
  return std::string("fwd ") + fmha_forward_variant_name(fwd) + ", bwd " + fmha_backward_variant_name(bwd);
}

// Runs every variant: pass v uses forward variant v % count and backward variant v % count, so each of both lists runs
// at least once; all are compared with the same CPU twin and float64 reference.
void run_case(const std::vector<int32_t>& lens, int heads, int hd, float p, bool fp16, const char* what) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device: nopad_cuda_tests runs on a GPU machine (scripts/gpu-tests.sh)";
  const Problem pr = make_problem(lens, heads, hd, p, fp16, 42);
  const Out cpu = cpu_twin(pr);
  const Ref ref = reference64(pr);
  GpuRun g(pr);
  upload(g, pr);
  const int nf = fmha_forward_variant_count(), nb = fmha_backward_variant_count();
  for (int v = 0; v < std::max(nf, nb); ++v)
    for (int with_bias = 0; with_bias < 2; ++with_bias) {  // the dQ kernel differs with the bias gradient
      g.p.fwd_variant = v % nf;
      g.p.bwd_variant = v % nb;
      const std::string label = std::string(what) + " [" + variant_label(g.p.fwd_variant, g.p.bwd_variant) +
                                (with_bias ? ", d_qkv_bias" : "") + "]";
      SCOPED_TRACE(label);
      poison(g);
      g.p.d_qkv_bias = nullptr;
      if (with_bias) arm_bias(g);
      fmha_forward(g.p, nullptr);
      fmha_backward(g.p, nullptr);
      CK(cudaDeviceSynchronize());
      const Out gpu = download(g, pr);
      compare_all(pr, gpu, cpu, ref, label.c_str());
      if (with_bias) check_bias(g, pr, gpu, label);
      g.p.d_qkv_bias = nullptr;
    }
}

const std::vector<int32_t> kMixedLens = {1, 2, 17, 63, 64, 65, 127, 128, 129, 255, 511, 512, 700};

TEST(Fmha, Bf16Hd64Heads16MixedLengths) { run_case(kMixedLens, 16, 64, 0.0f, false, "bf16 hd64 h16"); }
TEST(Fmha, Bf16Hd64Heads2MixedLengths) { run_case(kMixedLens, 2, 64, 0.0f, false, "bf16 hd64 h2"); }
TEST(Fmha, Bf16Hd64Heads16Dropout) { run_case(kMixedLens, 16, 64, 0.1f, false, "bf16 hd64 h16 p0.1"); }
TEST(Fmha, Fp16Hd64Heads2Dropout) { run_case(kMixedLens, 2, 64, 0.1f, true, "fp16 hd64 h2 p0.1"); }
// The same lengths without the 700: a launch whose longest sequence is exactly 8 tiles of 64 (the BERT maximum), so
// the longest sequence ends on a tile edge and every shorter one leaves surplus CTAs that exit at once.
const std::vector<int32_t> kLensTo512 = {1, 2, 17, 63, 64, 65, 127, 128, 129, 255, 320, 449, 511, 512};
TEST(Fmha, Bf16Hd64Heads16LengthsTo512) { run_case(kLensTo512, 16, 64, 0.0f, false, "bf16 hd64 h16 L<=512"); }
TEST(Fmha, Bf16Hd64Heads16DropoutLengthsTo512) {
  run_case(kLensTo512, 16, 64, 0.1f, false, "bf16 hd64 h16 p0.1 L<=512");
}
TEST(Fmha, Fp16Hd64Heads2DropoutLengthsTo512) { run_case(kLensTo512, 2, 64, 0.1f, true, "fp16 hd64 h2 p0.1 L<=512"); }
TEST(Fmha, Bf16Hd32Heads2Dropout) { run_case({1, 17, 64, 65, 200}, 2, 32, 0.1f, false, "bf16 hd32 h2 p0.1"); }
TEST(Fmha, Bf16Hd128Heads2Dropout) { run_case({1, 17, 64, 65, 200}, 2, 128, 0.1f, false, "bf16 hd128 h2 p0.1"); }

// Query rows (FmhaParams::q_cu_seqlens: the sparse last layer's attention). Per sequence no query, all of its rows,
// or ~30% of them, at shuffled positions; d_ctx is zero outside the query rows, so the float64 reference of the full
// attention is the expected result: its query rows' ctx and lse, and its whole d_qkv (the q block of the other rows
// is 0). Every variant, with and without the bias gradient; all outputs poisoned first.
void run_rows_case(const std::vector<int32_t>& lens, int heads, int hd, float p, bool fp16, const char* what) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device: nopad_cuda_tests runs on a GPU machine (scripts/gpu-tests.sh)";
  Problem pr = make_problem(lens, heads, hd, p, fp16, 43);
  const int B = static_cast<int>(lens.size()), H = pr.H(), T = pr.T;
  std::mt19937 rng(11);
  std::vector<int32_t> q_cu{0}, q_pos, rows;
  int max_q = 0;
  for (int b = 0; b < B; ++b) {
    const int L = lens[b];
    std::vector<int32_t> perm(static_cast<size_t>(L));
    for (int i = 0; i < L; ++i) perm[static_cast<size_t>(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const int n = b % 4 == 1 ? 0 : (b % 4 == 3 ? L : std::max(1, L * 3 / 10));
    for (int i = 0; i < n; ++i) {
      q_pos.push_back(perm[static_cast<size_t>(i)]);
      rows.push_back(pr.cu[b] + perm[static_cast<size_t>(i)]);
    }
    q_cu.push_back(static_cast<int32_t>(q_pos.size()));
    max_q = std::max(max_q, n);
  }
  const int N = static_cast<int>(q_pos.size());
  std::vector<char> is_query(static_cast<size_t>(T), 0);
  for (int r : rows) is_query[static_cast<size_t>(r)] = 1;
  for (int t = 0; t < T; ++t)
    if (!is_query[static_cast<size_t>(t)])
      for (int c = 0; c < H; ++c) {
        pr.dctx16[static_cast<size_t>(t) * H + c] = 0;  // +0 in bf16 and fp16
        pr.dctx[static_cast<size_t>(t) * H + c] = 0.0f;
      }
  const Ref ref = reference64(pr);
  // The query side, gathered: q_qkv [N, 3H], d_ctx [N, H].
  std::vector<uint16_t> qq16(static_cast<size_t>(N) * 3 * H), dctx_r16(static_cast<size_t>(N) * H);
  std::vector<float> qq(qq16.size()), dctx_r(dctx_r16.size());
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < 3 * H; ++c) {
      qq16[static_cast<size_t>(i) * 3 * H + c] = pr.qkv16[static_cast<size_t>(rows[i]) * 3 * H + c];
      qq[static_cast<size_t>(i) * 3 * H + c] = pr.qkv[static_cast<size_t>(rows[i]) * 3 * H + c];
    }
    for (int c = 0; c < H; ++c) {
      dctx_r16[static_cast<size_t>(i) * H + c] = pr.dctx16[static_cast<size_t>(rows[i]) * H + c];
      dctx_r[static_cast<size_t>(i) * H + c] = pr.dctx[static_cast<size_t>(rows[i]) * H + c];
    }
  }
  // CPU twin (fp32) of the rows form.
  ops::CpuBackend<ops::CpuF32> cpu(0);
  ops::SeqView seqs{T, B, pr.max_len, pr.cu.data(), pr.sample_ids.data()};
  ops::SeqView qv{N, B, max_q, q_cu.data(), pr.sample_ids.data()};
  qv.row_positions = q_pos.data();
  const ops::Dropout drop = pr.dropout();
  Out cpu_rows;
  cpu_rows.ctx.resize(static_cast<size_t>(N) * H);
  cpu_rows.lse.resize(static_cast<size_t>(heads) * N);
  cpu_rows.dqkv.resize(pr.qkv.size());
  cpu.attention_forward_rows(pr.qkv.data(), seqs, qq.data(), qv, heads, hd, drop, cpu_rows.ctx.data(),
                             cpu_rows.lse.data());
  cpu.attention_backward_rows(dctx_r.data(), pr.qkv.data(), seqs, qq.data(), qv, cpu_rows.ctx.data(),
                              cpu_rows.lse.data(), heads, hd, drop, cpu_rows.dqkv.data(), nullptr);
  // Reference rows in the rows layout.
  std::vector<double> r_ctx(cpu_rows.ctx.size()), r_lse(cpu_rows.lse.size());
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < H; ++c) r_ctx[static_cast<size_t>(i) * H + c] = ref.ctx[static_cast<size_t>(rows[i]) * H + c];
    for (int h = 0; h < heads; ++h)
      r_lse[static_cast<size_t>(h) * N + i] = ref.lse[static_cast<size_t>(h) * T + rows[i]];
  }

  GpuRun g(pr);
  upload(g, pr);
  DevBuf<uint16_t> d_qq(qq16.size()), d_ctx_r(static_cast<size_t>(N) * H), d_dctx_r(dctx_r16.size());
  DevBuf<float> d_lse_r(static_cast<size_t>(heads) * N);
  DevBuf<int32_t> d_qcu(q_cu.size()), d_qpos(q_pos.size());
  ASSERT_TRUE(d_qq.ptr && d_ctx_r.ptr && d_dctx_r.ptr && d_lse_r.ptr && d_qcu.ptr && d_qpos.ptr);
  CK(cudaMemcpy(d_qq.ptr, qq16.data(), d_qq.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_dctx_r.ptr, dctx_r16.data(), d_dctx_r.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_qcu.ptr, q_cu.data(), d_qcu.bytes(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_qpos.ptr, q_pos.data(), d_qpos.bytes(), cudaMemcpyHostToDevice));
  g.p.ctx = d_ctx_r.ptr;
  g.p.lse = d_lse_r.ptr;
  g.p.d_ctx = d_dctx_r.ptr;
  g.p.q_qkv = d_qq.ptr;
  g.p.q_cu_seqlens = d_qcu.ptr;
  g.p.q_positions = d_qpos.ptr;
  g.p.num_q_tokens = N;
  g.p.max_q_seqlen = max_q;
  const int nf = fmha_forward_variant_count(), nb = fmha_backward_variant_count();
  for (int v = 0; v < std::max(nf, nb); ++v)
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      g.p.fwd_variant = v % nf;
      g.p.bwd_variant = v % nb;
      const std::string label = std::string(what) + " rows [" + variant_label(g.p.fwd_variant, g.p.bwd_variant) +
                                (with_bias ? ", d_qkv_bias" : "") + "]";
      SCOPED_TRACE(label);
      poison(g);
      CK(cudaMemset(d_ctx_r.ptr, 0xFF, d_ctx_r.bytes()));
      CK(cudaMemset(d_lse_r.ptr, 0xFF, d_lse_r.bytes()));
      g.p.d_qkv_bias = nullptr;
      if (with_bias) arm_bias(g);
      fmha_forward(g.p, nullptr);
      fmha_backward(g.p, nullptr);
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> ctx16(d_ctx_r.count), dq16(g.dqkv.count);
      Out gpu;
      gpu.lse.resize(d_lse_r.count);
      CK(cudaMemcpy(ctx16.data(), d_ctx_r.ptr, d_ctx_r.bytes(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(gpu.lse.data(), d_lse_r.ptr, d_lse_r.bytes(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(dq16.data(), g.dqkv.ptr, g.dqkv.bytes(), cudaMemcpyDeviceToHost));
      for (uint16_t x : ctx16) gpu.ctx.push_back(from16(x, fp16));
      for (uint16_t x : dq16) gpu.dqkv.push_back(from16(x, fp16));
      compare_outputs(pr, gpu, cpu_rows, r_ctx, r_lse, ref.dqkv, label.c_str());
      size_t nonzero_q = 0;
      for (int t = 0; t < T; ++t)
        if (!is_query[static_cast<size_t>(t)])
          for (int c = 0; c < H; ++c) nonzero_q += gpu.dqkv[static_cast<size_t>(t) * 3 * H + c] != 0.0f;
      EXPECT_EQ(nonzero_q, 0u) << label << ": the q block of rows that are no query must be zero";
      if (with_bias) check_bias(g, pr, gpu, label);
      g.p.d_qkv_bias = nullptr;
    }
}

const std::vector<int32_t> kRowsLens = {1, 17, 64, 65, 130, 512, 200, 63, 129, 3};
TEST(Fmha, QueryRowsBf16Hd64) { run_rows_case(kRowsLens, 2, 64, 0.0f, false, "bf16 hd64 h2"); }
TEST(Fmha, QueryRowsBf16Hd64Dropout) { run_rows_case(kRowsLens, 3, 64, 0.1f, false, "bf16 hd64 h3 p0.1"); }
TEST(Fmha, QueryRowsFp16Hd64Dropout) { run_rows_case(kRowsLens, 2, 64, 0.1f, true, "fp16 hd64 h2 p0.1"); }
TEST(Fmha, QueryRowsBf16Hd32Hd128Dropout) {
  run_rows_case({1, 17, 64, 65, 200}, 2, 32, 0.1f, false, "bf16 hd32 h2 p0.1");
  run_rows_case({1, 17, 64, 65, 200}, 2, 128, 0.1f, false, "bf16 hd128 h2 p0.1");
}

// The mask the kernels must reproduce drops a fraction threshold / 256 = 0.1015625 (p = 0.1) of the attention
// probabilities: count on the host with the same Philox function over every (sequence, head, query, key) of the mixed
// batch; within 5 sigma.
TEST(Fmha, DropoutFractionOfTheMask) {
  const Problem pr = make_problem(kMixedLens, 16, 64, 0.1f, false, 1);
  const uint64_t key = dropout_stream_key(pr.seed, pr.step, pr.op_id);
  const double q = attention_dropout_threshold(pr.p) / 256.0;
  uint64_t dropped = 0, total = 0;
  for (size_t b = 0; b < pr.lens.size(); ++b)
    for (int h = 0; h < pr.heads; ++h)
      for (int i = 0; i < pr.lens[b]; ++i)
        for (int j = 0; j < pr.lens[b]; ++j) {
          dropped += attention_dropout_keep_key(key, pr.sample_ids[b], element_attention(h, i, j), pr.p) ? 0 : 1;
          ++total;
        }
  const double frac = static_cast<double>(dropped) / static_cast<double>(total);
  const double sigma = std::sqrt(q * (1 - q) / static_cast<double>(total));
  std::printf("  dropped %llu of %llu = %.6f (p = 0.1: threshold / 256 = %.7f, sigma %.2e)\n",
              static_cast<unsigned long long>(dropped), static_cast<unsigned long long>(total), frac, q, sigma);
  EXPECT_LE(std::fabs(frac - q), 5 * sigma);
}

// Grouped launches: the short and the long sequences as two launches (seq_index subsets, one shared workspace) give
// the same results as one launch over all sequences, for every variant. ctx, lse, dk, dv are deterministic (bitwise
// equal); dq is summed with float atomics in an unspecified order, so it is compared to 1 unit in the last 16-bit
// place.
TEST(Fmha, SeqIndexSubsetsMatchOneLaunch) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device: nopad_cuda_tests runs on a GPU machine (scripts/gpu-tests.sh)";
  const std::vector<int32_t> lens = {700, 17, 129, 1, 512, 64, 65, 255, 2, 128};
  const Problem pr = make_problem(lens, 16, 64, 0.1f, false, 7);
  GpuRun g(pr);
  upload(g, pr);
  std::vector<int32_t> short_idx, long_idx;
  int short_max = 0, long_max = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (lens[b] <= 128) {
      short_idx.push_back(static_cast<int32_t>(b));
      short_max = std::max(short_max, lens[b]);
    } else {
      long_idx.push_back(static_cast<int32_t>(b));
      long_max = std::max(long_max, lens[b]);
    }
  }
  std::vector<int32_t> all_idx = short_idx;
  all_idx.insert(all_idx.end(), long_idx.begin(), long_idx.end());
  CK(cudaMemcpy(g.idx.ptr, all_idx.data(), all_idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

  const int nf = fmha_forward_variant_count(), nb = fmha_backward_variant_count();
  for (int v = 0; v < std::max(nf, nb); ++v) {
    g.p.fwd_variant = v % nf;
    g.p.bwd_variant = v % nb;
    SCOPED_TRACE(variant_label(g.p.fwd_variant, g.p.bwd_variant));
    poison(g);
    fmha_forward(g.p, nullptr);
    fmha_backward(g.p, nullptr);
    CK(cudaDeviceSynchronize());
    const Out one = download(g, pr);

    poison(g);
    FmhaParams ps = g.p, pl = g.p;
    ps.seq_index = g.idx.ptr;
    ps.num_launch_seqs = static_cast<int32_t>(short_idx.size());
    ps.max_seqlen = short_max;
    pl.seq_index = g.idx.ptr + short_idx.size();
    pl.num_launch_seqs = static_cast<int32_t>(long_idx.size());
    pl.max_seqlen = long_max;
    fmha_forward(pl, nullptr);
    fmha_forward(ps, nullptr);
    fmha_backward(ps, nullptr);
    fmha_backward(pl, nullptr);
    CK(cudaDeviceSynchronize());
    const Out two = download(g, pr);
    ASSERT_EQ(count_nonfinite(two.ctx) + count_nonfinite(two.lse) + count_nonfinite(two.dqkv), 0u)
        << "the two subset launches left elements unwritten";
    EXPECT_EQ(0, std::memcmp(one.ctx.data(), two.ctx.data(), one.ctx.size() * sizeof(float))) << "ctx differs";
    EXPECT_EQ(0, std::memcmp(one.lse.data(), two.lse.data(), one.lse.size() * sizeof(float))) << "lse differs";
    const int H = pr.H();
    size_t bad_kv = 0, bad_q = 0;
    for (int t = 0; t < pr.T; ++t)
      for (int c = 0; c < 3 * H; ++c) {
        const float a = one.dqkv[static_cast<size_t>(t) * 3 * H + c], b = two.dqkv[static_cast<size_t>(t) * 3 * H + c];
        if (c >= H) {
          bad_kv += a != b;
        } else {
          bad_q += std::fabs(a - b) > std::fabs(a) * (1.0f / 128) + 1e-6f;
        }
      }
    EXPECT_EQ(bad_kv, 0u) << "dk/dv elements differ between one launch and two subset launches";
    EXPECT_EQ(bad_q, 0u) << "dq elements differ by more than one bf16 ulp between one launch and two subset launches";
  }
}

// Planned launches (fmha_forward_planned / fmha_backward_planned, ops/attention_groups.h): every schedule (one launch
// in batch order, one launch longest first, length groups on 1, 2 and 4 streams, 64- and 128-token buckets) computes
// exactly what one plain launch computes (ctx, lse, dk, dv bitwise; dq up to its atomics' order), writes every
// element (outputs and workspace poisoned first), and leaves nothing running past the join (the outputs are read
// after synchronising only the caller's stream). A sequence of length 0 and lengths at every tile edge are included.
TEST(Fmha, PlannedLaunchesMatchOneLaunch) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device: nopad_cuda_tests runs on a GPU machine (scripts/gpu-tests.sh)";
  const std::vector<int32_t> lens = {129, 1, 700, 0, 2, 63, 512, 64, 65, 127, 128, 511, 300, 17, 384, 385, 256, 90};
  const Problem pr = make_problem(lens, 16, 64, 0.1f, false, 11);
  GpuRun g(pr);
  upload(g, pr);
  std::vector<int32_t> order(lens.size());
  ops::order_by_length(pr.cu.data(), static_cast<int32_t>(lens.size()), order.data());
  CK(cudaMemcpy(g.idx.ptr, order.data(), order.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FmhaStreams streams(ops::AttentionSchedule::kMaxStreams);

  poison(g);
  fmha_forward(g.p, stream);
  fmha_backward(g.p, stream);
  CK(cudaStreamSynchronize(stream));
  const Out one = download(g, pr);
  ASSERT_EQ(count_nonfinite(one.ctx) + count_nonfinite(one.lse) + count_nonfinite(one.dqkv), 0u);

  struct Case {
    ops::AttentionMode mode;
    int streams, bucket;
  };
  const Case cases[] = {{ops::AttentionMode::kSingle, 1, 64},  {ops::AttentionMode::kSorted, 1, 64},
                        {ops::AttentionMode::kGrouped, 1, 64}, {ops::AttentionMode::kGrouped, 2, 64},
                        {ops::AttentionMode::kGrouped, 4, 64}, {ops::AttentionMode::kGrouped, 4, 128}};
  for (const Case& c : cases) {
    ops::AttentionSchedule s;
    s.mode = c.mode;
    s.streams = c.streams;
    s.bucket_tokens = c.bucket;
    ops::AttentionPlan plan;
    ops::plan_attention(pr.cu.data(), order.data(), static_cast<int32_t>(lens.size()), s, plan);
    const std::string label = std::string(ops::attention_mode_name(c.mode)) + ", " + std::to_string(c.streams) +
                              " streams, bucket " + std::to_string(c.bucket) + ": " + std::to_string(plan.num_groups) +
                              " launches on " + std::to_string(plan.num_streams) + " streams";
    SCOPED_TRACE(label);
    if (c.mode == ops::AttentionMode::kGrouped && c.streams > 1) EXPECT_GT(plan.num_streams, 1);
    poison(g);
    arm_bias(g);  // every group adds its rows' column sums (from its own stream)
    fmha_forward_planned(g.p, g.idx.ptr, plan, streams, stream);
    fmha_backward_planned(g.p, g.idx.ptr, plan, streams, stream);
    CK(cudaStreamSynchronize(stream));  // the join must have made the caller's stream wait for the side streams
    g.p.d_qkv_bias = nullptr;
    const Out two = download(g, pr);
    check_bias(g, pr, two, label);
    ASSERT_EQ(count_nonfinite(two.ctx) + count_nonfinite(two.lse) + count_nonfinite(two.dqkv), 0u)
        << "planned launches left elements unwritten";
    EXPECT_EQ(0, std::memcmp(one.ctx.data(), two.ctx.data(), one.ctx.size() * sizeof(float))) << "ctx differs";
    EXPECT_EQ(0, std::memcmp(one.lse.data(), two.lse.data(), one.lse.size() * sizeof(float))) << "lse differs";
    const int H = pr.H();
    size_t bad_kv = 0, bad_q = 0;
    for (int t = 0; t < pr.T; ++t)
      for (int col = 0; col < 3 * H; ++col) {
        const size_t i = static_cast<size_t>(t) * 3 * H + col;
        const float a = one.dqkv[i], b = two.dqkv[i];
        if (col >= H) {
          bad_kv += a != b;
        } else {
          bad_q += std::fabs(a - b) > std::fabs(a) * (1.0f / 128) + 1e-6f;
        }
      }
    EXPECT_EQ(bad_kv, 0u) << "dk/dv differ from one plain launch (which ran without the bias gradient)";
    EXPECT_EQ(bad_q, 0u) << "dq differs from one plain launch by more than one bf16 ulp";
    std::printf("  planned launches OK: %s\n", label.c_str());
  }
  CK(cudaStreamDestroy(stream));
}

TEST(Fmha, RejectsBadParams) {
  FmhaParams p;
  alignas(16) int dummy[4] = {0, 0, 0, 0};
  p.qkv = p.ctx = dummy;
  p.lse = reinterpret_cast<float*>(dummy);
  p.cu_seqlens = dummy;
  p.num_seqs = 1;
  p.num_tokens = 1;
  p.max_seqlen = 1;
  p.num_heads = 1;
  p.head_dim = 48;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "head_dim 48";
  p.head_dim = 64;
  p.qkv = nullptr;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "null qkv";
  p.qkv = dummy;
  p.dropout_p = 0.1f;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "dropout without sample_ids";
  p.sample_ids = reinterpret_cast<const uint64_t*>(dummy);
  p.dropout_p = 0.999f;  // threshold ceil(0.999 * 256) = 256: nothing could be kept
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "p whose 8-bit threshold keeps nothing";
  p.dropout_p = 1.0f;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "p = 1";
  p.dropout_p = 0.0f;
  p.fwd_variant = fmha_forward_variant_count();
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "forward variant out of range";
  p.fwd_variant = -1;
  p.d_ctx = p.d_qkv = p.workspace = dummy;
  p.workspace_bytes = 4;
  EXPECT_THROW(fmha_backward(p, nullptr), nopad::Error) << "workspace too small";
  p.workspace_bytes = 1 << 20;
  p.bwd_variant = -2;
  EXPECT_THROW(fmha_backward(p, nullptr), nopad::Error) << "backward variant out of range";
  p.bwd_variant = -1;
  // Query rows: every piece named, no grouping, no more queries than rows.
  p.q_cu_seqlens = dummy;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "q_cu_seqlens without q_qkv / q_positions";
  p.q_qkv = dummy;
  p.q_positions = dummy;
  p.num_q_tokens = 1;
  p.max_q_seqlen = 2;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "max_q_seqlen > max_seqlen";
  p.max_q_seqlen = 1;
  p.seq_index = dummy;
  p.num_launch_seqs = 1;
  EXPECT_THROW(fmha_forward(p, nullptr), nopad::Error) << "query rows with seq_index";
  p.seq_index = nullptr;
  p.q_cu_seqlens = nullptr;
  EXPECT_THROW(fmha_backward(p, nullptr), nopad::Error) << "q_qkv without q_cu_seqlens";
}

// Variant selection: the field when >= 0, else NOPAD_FMHA_{FWD,BWD}_VARIANT, else the default; names exist.
TEST(Fmha, VariantSelection) {
  FmhaParams p;
  const int nf = fmha_forward_variant_count(), nb = fmha_backward_variant_count();
  ASSERT_GE(nf, 1);
  ASSERT_GE(nb, 1);
  for (int v = 0; v < nf; ++v) {
    p.fwd_variant = v;
    EXPECT_EQ(fmha_forward_variant(p), v);
    EXPECT_GT(std::strlen(fmha_forward_variant_name(v)), 0u);
  }
  for (int v = 0; v < nb; ++v) {
    p.bwd_variant = v;
    EXPECT_EQ(fmha_backward_variant(p), v);
    EXPECT_GT(std::strlen(fmha_backward_variant_name(v)), 0u);
  }
  p.fwd_variant = p.bwd_variant = -1;
  p.max_seqlen = 512;  // a launch with phase-2 lengths (shorter launches below)
  const int df = fmha_forward_variant(p), db = fmha_backward_variant(p);
  EXPECT_TRUE(df >= 0 && df < nf);
  EXPECT_TRUE(db >= 0 && db < nb);
  p.dropout_p = 0.1f;
  const int db_drop = fmha_backward_variant(p);
  EXPECT_TRUE(db_drop >= 0 && db_drop < nb);
  // The backward's default by launch size, where ws128q is the default at all (a wgmma build on sm_90 without
  // NOPAD_FMHA_BWD_VARIANT): wg64 for a launch of sequences of at most 256 tokens with fewer than 16 ws128q items
  // (128-key blocks x heads x sequences) per SM, ws128q otherwise; elsewhere one variant whatever the size.
  p.head_dim = 64;
  p.num_heads = 16;
  struct Size {
    int32_t max_seqlen, seqs;
    bool few;
  };
  const Size sizes[] = {{256, 4, true}, {1, 4, true}, {257, 4, false}, {128, 4096, false}, {512, 128, false},
                        {128, 64, true}};
  p.max_seqlen = 512;
  p.num_seqs = 128;
  const bool size_rule = std::strcmp(fmha_backward_variant_name(fmha_backward_variant(p)), "ws128q") == 0 &&
                         std::getenv("NOPAD_FMHA_BWD_VARIANT") == nullptr;
  for (const Size& z : sizes) {
    p.max_seqlen = z.max_seqlen;
    p.num_seqs = z.seqs;
    const char* name = fmha_backward_variant_name(fmha_backward_variant(p));
    if (size_rule) {
      EXPECT_STREQ(name, z.few ? "wg64" : "ws128q") << "max_seqlen " << z.max_seqlen << ", " << z.seqs << " sequences";
    } else {
      EXPECT_EQ(fmha_backward_variant(p), db_drop) << "max_seqlen " << z.max_seqlen << ", " << z.seqs << " sequences";
    }
  }
  // A launch over a subset (seq_index) counts its own sequences.
  if (size_rule) {
    alignas(16) static int32_t subset[4] = {0, 1, 2, 3};
    p.max_seqlen = 128;
    p.num_seqs = 4096;
    p.seq_index = subset;
    p.num_launch_seqs = 4;
    EXPECT_STREQ(fmha_backward_variant_name(fmha_backward_variant(p)), "wg64") << "4 of 4096 sequences";
    p.seq_index = nullptr;
    p.num_launch_seqs = 0;
  }
  p.max_seqlen = 0;
  p.num_seqs = 0;
  std::printf("  default variants (with the environment): forward %d %s, backward %d %s (dropout 0), %d %s (dropout)\n",
              df, fmha_forward_variant_name(df), db, fmha_backward_variant_name(db), db_drop,
              fmha_backward_variant_name(db_drop));
  EXPECT_THROW(fmha_forward_variant_name(nf), nopad::Error);
}

// Elements of x that differ from the reference r by more than rel * |r| + abs_tol (and non-finite ones); max |x - r|.
struct Agreement {
  size_t bad = 0;
  double max_abs = 0;
  bool bitwise = true;
};
Agreement agree(const std::vector<float>& r, const std::vector<float>& x, double rel, double abs_tol) {
  Agreement a;
  for (size_t i = 0; i < r.size(); ++i) {
    const double d = std::fabs(static_cast<double>(x[i]) - r[i]);
    a.bitwise = a.bitwise && std::memcmp(&x[i], &r[i], sizeof(float)) == 0;
    if (!std::isfinite(x[i]) || d > rel * std::fabs(r[i]) + abs_tol) ++a.bad;
    if (std::isfinite(d)) a.max_abs = std::max(a.max_abs, d);
  }
  return a;
}

// Performance smoke: 64 sequences of 128..384 tokens (T ~ 16,200), 16 heads x 64, bf16, dropout 0 and 0.1, the same
// inputs for every variant. One line per forward variant (forward alone), one per backward variant (backward alone,
// after the default forward), then the default pair as forward and forward+backward (the historical line) and the
// fastest pair. Each variant's outputs must agree with the default variant's to 2 units in the last 16-bit place
// (they differ only in fp32 summation order, and dq in its atomics' order); "bitwise" says when they are identical.
TEST(Fmha, PerfSmoke) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device: nopad_cuda_tests runs on a GPU machine (scripts/gpu-tests.sh)";
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> len(128, 384);
  std::vector<int32_t> lens(64);
  for (auto& l : lens) l = len(rng);
  Problem pr = make_problem(lens, 16, 64, 0.1f, false, 9);
  GpuRun g(pr);
  upload(g, pr);
  double flop = 0;  // forward: 2 products of 2 L^2 hd flops per head
  for (int l : lens) flop += 4.0 * l * l * pr.hd * pr.heads;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int iters = 20;
  // Mean time of one call of fn over `iters` calls, after one warm-up call.
  const auto time_ms = [&](const auto& fn) {
    fn();
    float ms = 0;
    if (cudaEventRecord(e0) != cudaSuccess) return -1.0;
    for (int i = 0; i < iters; ++i) fn();
    if (cudaEventRecord(e1) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
        cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
      return -1.0;
    return static_cast<double>(ms) / iters;
  };
  const double ulp2 = 2.0 / 256;  // 2 bf16 units in the last place, relative
  const int nf = fmha_forward_variant_count(), nb = fmha_backward_variant_count();
  for (const float drop_p : {0.0f, 0.1f}) {
    g.p.dropout_p = drop_p;
    // The default backward depends on the dropout (wg64b without, wg64 with it on Hopper).
    FmhaParams defaults = g.p;
    defaults.fwd_variant = defaults.bwd_variant = -1;
    const int def_f = fmha_forward_variant(defaults), def_b = fmha_backward_variant(defaults);
    // The default variants' outputs: the reference every variant is compared with.
    g.p.fwd_variant = def_f;
    g.p.bwd_variant = def_b;
    poison(g);
    fmha_forward(g.p, nullptr);
    fmha_backward(g.p, nullptr);
    CK(cudaDeviceSynchronize());
    const Out ref = download(g, pr);
    ASSERT_EQ(count_nonfinite(ref.ctx) + count_nonfinite(ref.lse) + count_nonfinite(ref.dqkv), 0u);

    double best_f = 1e30, best_b = 1e30;
    int best_fv = def_f, best_bv = def_b;
    for (int v = 0; v < nf; ++v) {
      g.p.fwd_variant = v;
      poison(g);
      fmha_forward(g.p, nullptr);
      CK(cudaDeviceSynchronize());
      const Out o = download(g, pr);
      const Agreement ac = agree(ref.ctx, o.ctx, ulp2, 1e-6), al = agree(ref.lse, o.lse, 1e-5, 1e-5);
      const double ms = time_ms([&] { fmha_forward(g.p, nullptr); });
      std::printf("  fmha perf: T=%d, 16x64, p=%.1f: forward  variant %d %-7s %.3f ms (%.1f TFLOP/s); vs default: "
                  "ctx %s (max |diff| %.1e, %zu beyond 2 ulp), lse %s (%zu beyond 1e-5)\n",
                  pr.T, static_cast<double>(drop_p), v, fmha_forward_variant_name(v), ms, flop / ms * 1e-9,
                  ac.bitwise ? "bitwise" : "differs", ac.max_abs, ac.bad, al.bitwise ? "bitwise" : "differs", al.bad);
      EXPECT_EQ(ac.bad, 0u) << "forward variant " << fmha_forward_variant_name(v) << ": ctx disagrees with the default";
      EXPECT_EQ(al.bad, 0u) << "forward variant " << fmha_forward_variant_name(v) << ": lse disagrees with the default";
      if (ms > 0 && ms < best_f && ac.bad == 0 && al.bad == 0) best_f = ms, best_fv = v;
    }
    g.p.fwd_variant = def_f;
    for (int v = 0; v < nb; ++v) {
      g.p.bwd_variant = v;
      poison(g);
      fmha_forward(g.p, nullptr);
      fmha_backward(g.p, nullptr);
      CK(cudaDeviceSynchronize());
      const Out o = download(g, pr);
      std::vector<float> rq, rkv, oq, okv;  // the dq block, and the dk/dv blocks
      for (size_t i = 0; i < o.dqkv.size(); ++i) {
        const bool q = (i % (3 * static_cast<size_t>(pr.H()))) < static_cast<size_t>(pr.H());
        (q ? rq : rkv).push_back(ref.dqkv[i]);
        (q ? oq : okv).push_back(o.dqkv[i]);
      }
      const Agreement aq = agree(rq, oq, ulp2, 1e-6), akv = agree(rkv, okv, ulp2, 1e-6);
      const double ms = time_ms([&] { fmha_backward(g.p, nullptr); });
      std::printf("  fmha perf: T=%d, 16x64, p=%.1f: backward variant %d %-7s %.3f ms (%.1f TFLOP/s counting 2.5x the "
                  "forward FLOPs); vs default: dq %s (max |diff| %.1e, %zu beyond 2 ulp), dk/dv %s (%zu beyond)\n",
                  pr.T, static_cast<double>(drop_p), v, fmha_backward_variant_name(v), ms, 2.5 * flop / ms * 1e-9,
                  aq.bitwise ? "bitwise" : "differs", aq.max_abs, aq.bad, akv.bitwise ? "bitwise" : "differs",
                  akv.bad);
      EXPECT_EQ(aq.bad + akv.bad, 0u) << "backward variant " << fmha_backward_variant_name(v)
                                      << ": d_qkv disagrees with the default";
      if (ms > 0 && ms < best_b && aq.bad + akv.bad == 0) best_b = ms, best_bv = v;
    }

    // The default pair, in the historical format, and the fastest pair.
    g.p.fwd_variant = def_f;
    g.p.bwd_variant = def_b;
    const double ms_f = time_ms([&] { fmha_forward(g.p, nullptr); });
    const double ms_fb = time_ms([&] {
      fmha_forward(g.p, nullptr);
      fmha_backward(g.p, nullptr);
    });
    std::printf("  fmha perf: T=%d, 16x64, p=%.1f: forward %.3f ms (%.1f TFLOP/s), forward+backward %.3f ms "
                "(%.1f TFLOP/s counting 3.5x the forward FLOPs) [default: fwd %s, bwd %s]\n",
                pr.T, static_cast<double>(drop_p), ms_f, flop / ms_f * 1e-9, ms_fb, 3.5 * flop / ms_fb * 1e-9,
                fmha_forward_variant_name(def_f), fmha_backward_variant_name(def_b));
    g.p.fwd_variant = best_fv;
    g.p.bwd_variant = best_bv;
    const double ms_best = time_ms([&] {
      fmha_forward(g.p, nullptr);
      fmha_backward(g.p, nullptr);
    });
    std::printf("  fmha perf: T=%d, 16x64, p=%.1f: fastest pair fwd %s + bwd %s: forward+backward %.3f ms "
                "(%.1f TFLOP/s counting 3.5x the forward FLOPs)\n",
                pr.T, static_cast<double>(drop_p), fmha_forward_variant_name(best_fv),
                fmha_backward_variant_name(best_bv), ms_best, 3.5 * flop / ms_best * 1e-9);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

}  // namespace
}  // namespace nopad::cuda
