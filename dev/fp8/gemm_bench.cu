// Experiment (not a test): BERT-large's dense products at a phase-2 step's token count, bf16 cuBLASLt exactly as
// dense.cu issues them (LtGemm, the mapping of ops/cuda/dense.h) against the FP8 products of ops/cuda/gemm_fp8.h, and
// the bf16 -> fp8 cast kernel (ops/cuda/fp8_cast.h) against the H200's 4.8 TB/s.
//
// For each layer product (QKV 1024->3072, attention output 1024->1024, FFN in 1024->4096, FFN out 4096->1024) and each
// pass (forward y = x W^T + b; data gradient dx = dy W; weight gradient dW += dy^T x in fp32): the median of --reps
// calls, each timed alone with CUDA events after --warmup calls, cycling through --rotate independent sets of inputs
// (uniform random, not zero; weights rotate too, so none is served from L2 by a previous call). The FP8 inputs come
// from the bf16 ones through the real pipeline: a cast for the amax, the device scale update, the scaled cast (with
// the transposed copies the backward needs). Each FP8 product is timed with its default accumulation (fast in the
// forward, promoted in the backward: gemm_fp8.h) and with the other one.
//
// One check: the attention-output forward at the full token count, 4096 sampled outputs against a double-precision
// product of the decoded fp8 operands, under the bound of tests/cuda/test_fp8.cu; the program exits 1 if it fails.
//
// Usage: dev_fp8_gemm_bench [--tokens 93000] [--reps 30] [--warmup 5] [--rotate 3]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "ops/cuda/check.h"
#include "ops/cuda/dense.h"
#include "ops/cuda/fp8_cast.h"
#include "ops/cuda/gemm_fp8.h"

namespace nopad::cuda {
namespace {

constexpr double kHbmGBs = 4800.0;  // H200 HBM3e

__global__ void fill_uniform(uint16_t* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B9u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    const __nv_bfloat16 v = __float2bfloat16_rn(lo + (hi - lo) * u);
    p[i] = *reinterpret_cast<const uint16_t*>(&v);
  }
}

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { p = cuda_malloc_or_throw(bytes, "a benchmark buffer"); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

void fill(const Buf& b, size_t n, uint32_t seed, float lo, float hi) {
  fill_uniform<<<1024, 256>>>(b.as<uint16_t>(), n, seed, lo, hi);
  NOPAD_CUDA_CHECK_LAUNCH();
}

// Median of `reps` calls of run(i) (i = call index, for rotating buffers), each between its own pair of events.
double median_ms(const std::function<void(int)>& run, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) run(i);
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(reps));
  for (cudaEvent_t& e : ev) NOPAD_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    NOPAD_CUDA_CHECK(cudaEventRecord(ev[2 * static_cast<size_t>(i)], nullptr));
    run(warmup + i);
    NOPAD_CUDA_CHECK(cudaEventRecord(ev[2 * static_cast<size_t>(i) + 1], nullptr));
  }
  NOPAD_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i)
    NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], ev[2 * static_cast<size_t>(i)],
                                          ev[2 * static_cast<size_t>(i) + 1]));
  for (cudaEvent_t& e : ev) NOPAD_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// One set of a layer's operands: bf16 and their FP8 quantisations (with the transposed copies).
struct OperandSet {
  std::unique_ptr<Buf> x, w, dy, bias;
  std::unique_ptr<Buf> xq, xq_t, wq, wq_t, dyq, dyq_t;
  std::unique_ptr<Fp8Scalings> sc;  // tensors 0 = x (E4M3), 1 = W (E4M3), 2 = dy (E5M2)
};

void cast(const Buf& src, int64_t rows, int64_t cols, Fp8Format f, const Fp8Scalings& sc, int i, uint8_t* q,
          uint8_t* q_t, int64_t ld_t, bool amax_only) {
  Fp8CastArgs a;
  a.x = src.as<bf16>();
  a.rows = rows;
  a.cols = cols;
  a.format = f;
  a.scale = sc.scale(i);
  if (amax_only) {
    a.amax = sc.amax(i);
  } else {
    a.q = q;
    a.q_t = q_t;
    a.ld_t = ld_t;
  }
  launch_fp8_cast(a, nullptr);
}

struct Layer {
  const char* name;
  int64_t in, out;
};

struct Options {
  int64_t tokens = 93000;
  int reps = 30, warmup = 5, rotate = 3;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    NOPAD_CHECK(i + 1 < argc, "option ", a, " needs a value");
    char* end = nullptr;
    const long long v = std::strtoll(argv[++i], &end, 10);
    NOPAD_CHECK(end != argv[i] && *end == '\0', "option ", a, ": '", argv[i], "' is not a whole number");
    if (a == "--tokens") o.tokens = v;
    else if (a == "--reps") o.reps = static_cast<int>(v);
    else if (a == "--warmup") o.warmup = static_cast<int>(v);
    else if (a == "--rotate") o.rotate = static_cast<int>(v);
    else fail("unknown option ", a, " (--tokens, --reps, --warmup, --rotate)");
  }
  NOPAD_CHECK(o.tokens >= 16 && o.reps >= 1 && o.warmup >= 0 && o.rotate >= 1, "options out of range (--tokens ",
              o.tokens, ", --reps ", o.reps, ", --warmup ", o.warmup, ", --rotate ", o.rotate,
              "): need --tokens >= 16, --reps >= 1, --warmup >= 0, --rotate >= 1");
  return o;
}

// The sampled check of one forward product (bound of tests/cuda/test_fp8.cu with fast accumulation on).
bool check_forward(const OperandSet& s, const Buf& y_fp8, const Buf& y_bf16, int64_t rows, int64_t in, int64_t out) {
  std::vector<uint8_t> wq(static_cast<size_t>(out * in));
  NOPAD_CUDA_CHECK(cudaMemcpy(wq.data(), s.wq->p, wq.size(), cudaMemcpyDeviceToHost));
  std::vector<uint16_t> bias(static_cast<size_t>(out));
  NOPAD_CUDA_CHECK(cudaMemcpy(bias.data(), s.bias->p, bias.size() * 2, cudaMemcpyDeviceToHost));
  float sinv[3];
  NOPAD_CUDA_CHECK(cudaMemcpy(sinv, s.sc->scale_inv(0), 3 * sizeof(float), cudaMemcpyDeviceToHost));
  std::mt19937 rng(77);
  std::uniform_int_distribution<int64_t> pr(0, rows - 1), pc(0, out - 1);
  const double gamma = std::ceil(in / 32.0) * std::ldexp(1.0, -13);
  double worst = 0, diff2 = 0, ref2 = 0;
  int bad = 0;
  std::vector<uint8_t> xrow(static_cast<size_t>(in));
  for (int i = 0; i < 4096; ++i) {
    const int64_t r = pr(rng), c = pc(rng);
    NOPAD_CUDA_CHECK(cudaMemcpy(xrow.data(), s.xq->as<uint8_t>() + r * in, xrow.size(), cudaMemcpyDeviceToHost));
    uint16_t g8 = 0, g16 = 0;
    NOPAD_CUDA_CHECK(cudaMemcpy(&g8, y_fp8.as<uint16_t>() + r * out + c, 2, cudaMemcpyDeviceToHost));
    NOPAD_CUDA_CHECK(cudaMemcpy(&g16, y_bf16.as<uint16_t>() + r * out + c, 2, cudaMemcpyDeviceToHost));
    double acc = 0, mag = 0;
    for (int64_t t = 0; t < in; ++t) {
      const double p = static_cast<double>(fp8_decode(xrow[static_cast<size_t>(t)], Fp8Format::kE4M3)) *
                       fp8_decode(wq[static_cast<size_t>(c * in + t)], Fp8Format::kE4M3);
      acc += p;
      mag += std::fabs(p);
    }
    const double s2 = static_cast<double>(sinv[0]) * sinv[1];
    const double ref = acc * s2 + to_float(bf16{bias[static_cast<size_t>(c)]});
    const double got = to_float(bf16{g8});
    const double bound = gamma * mag * s2 + (std::ldexp(1.0, -8) + std::ldexp(1.0, -20)) * std::fabs(ref) + 1e-30;
    const double e = std::fabs(got - ref);
    if (!(e <= bound)) ++bad;
    worst = std::max(worst, e / bound);
    diff2 += (got - to_float(bf16{g16})) * (got - to_float(bf16{g16}));
    ref2 += ref * ref;
  }
  std::printf("check: attention-output forward, %lld rows, 4096 sampled outputs vs the decoded fp8 operands in "
              "double: %s (worst error at %.3f of its bound); fp8 vs bf16 products differ by %.2e (norm-relative, "
              "the quantisation)\n",
              static_cast<long long>(rows), bad == 0 ? "OK" : "FAILED", worst, std::sqrt(diff2 / ref2));
  return bad == 0;
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int dev = 0;
  NOPAD_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("fp8 bench: %s (sm_%d%d, %d SMs), cuBLASLt %zu, %lld tokens, median of %d calls after %d, %d rotating "
              "operand sets\n",
              prop.name, prop.major, prop.minor, prop.multiProcessorCount, cublasLtGetVersion(),
              static_cast<long long>(o.tokens), o.reps, o.warmup, o.rotate);
  LtGemm bf16_gemm(0);
  Fp8Gemm fp8_gemm;
  NOPAD_CHECK(fp8_gemm.supported(), "this GPU (sm_", prop.major, prop.minor,
              ") has no FP8 tensor cores");
  const int64_t T = o.tokens, ld = fp8_transposed_ld(T);
  const Layer layers[] = {{"qkv 1024->3072", 1024, 3072},
                          {"attn-out 1024->1024", 1024, 1024},
                          {"ffn-in 1024->4096", 1024, 4096},
                          {"ffn-out 4096->1024", 4096, 1024}};
  std::printf("| %-20s | %-7s | %8s | %8s | %6s | %11s | %11s | %15s |\n", "shape", "product", "bf16 ms", "fp8 ms",
              "ratio", "bf16 TFLOP/s", "fp8 TFLOP/s", "fp8 other acc ms");
  double sum_bf16 = 0, sum_fp8 = 0;
  bool ok = true;
  for (const Layer& L : layers) {
    std::vector<OperandSet> sets(static_cast<size_t>(o.rotate));
    uint32_t seed = 1;
    for (OperandSet& s : sets) {
      s.x = std::make_unique<Buf>(static_cast<size_t>(T * L.in) * 2);
      s.w = std::make_unique<Buf>(static_cast<size_t>(L.out * L.in) * 2);
      s.dy = std::make_unique<Buf>(static_cast<size_t>(T * L.out) * 2);
      s.bias = std::make_unique<Buf>(static_cast<size_t>(L.out) * 2);
      fill(*s.x, static_cast<size_t>(T * L.in), seed++, -2.0f, 3.0f);
      fill(*s.w, static_cast<size_t>(L.out * L.in), seed++, -0.05f, 0.06f);
      fill(*s.dy, static_cast<size_t>(T * L.out), seed++, -1e-3f, 1e-3f);
      fill(*s.bias, static_cast<size_t>(L.out), seed++, -1.0f, 1.0f);
      s.xq = std::make_unique<Buf>(static_cast<size_t>(T * L.in));
      s.xq_t = std::make_unique<Buf>(static_cast<size_t>(L.in * ld));
      s.wq = std::make_unique<Buf>(static_cast<size_t>(L.out * L.in));
      s.wq_t = std::make_unique<Buf>(static_cast<size_t>(L.in * L.out));
      s.dyq = std::make_unique<Buf>(static_cast<size_t>(T * L.out));
      s.dyq_t = std::make_unique<Buf>(static_cast<size_t>(L.out * ld));
      s.sc = std::make_unique<Fp8Scalings>(std::vector<Fp8Format>{Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8Format::kE5M2},
                                           ops::Fp8Recipe{});
      cast(*s.x, T, L.in, Fp8Format::kE4M3, *s.sc, 0, nullptr, nullptr, 0, true);
      cast(*s.w, L.out, L.in, Fp8Format::kE4M3, *s.sc, 1, nullptr, nullptr, 0, true);
      cast(*s.dy, T, L.out, Fp8Format::kE5M2, *s.sc, 2, nullptr, nullptr, 0, true);
      s.sc->update(nullptr);
      cast(*s.x, T, L.in, Fp8Format::kE4M3, *s.sc, 0, s.xq->as<uint8_t>(), s.xq_t->as<uint8_t>(), ld, false);
      cast(*s.w, L.out, L.in, Fp8Format::kE4M3, *s.sc, 1, s.wq->as<uint8_t>(), s.wq_t->as<uint8_t>(), L.out, false);
      cast(*s.dy, T, L.out, Fp8Format::kE5M2, *s.sc, 2, s.dyq->as<uint8_t>(), s.dyq_t->as<uint8_t>(), ld, false);
    }
    Buf y(static_cast<size_t>(T * L.out) * 2), y8(static_cast<size_t>(T * L.out) * 2);
    Buf dx(static_cast<size_t>(T * L.in) * 2), dw(static_cast<size_t>(L.out * L.in) * 4);
    NOPAD_CUDA_CHECK(cudaMemset(dw.p, 0, static_cast<size_t>(L.out * L.in) * 4));
    NOPAD_CUDA_CHECK(cudaDeviceSynchronize());
    auto set = [&](int i) -> const OperandSet& { return sets[static_cast<size_t>(i % o.rotate)]; };
    const double flop = 2.0 * static_cast<double>(T) * L.in * L.out;

    // bf16, as dense.cu issues the three products (dense.h's table).
    auto bf16_fwd = [&](int i) {
      GemmProblem p;
      p.trans_a = true;
      p.m = L.out;
      p.n = T;
      p.k = L.in;
      p.a = set(i).w->p;
      p.lda = L.in;
      p.b = set(i).x->p;
      p.ldb = L.in;
      p.d = y.p;
      p.ldd = L.out;
      p.bias = set(i).bias->p;
      bf16_gemm.run(p, nullptr);
    };
    auto bf16_dgrad = [&](int i) {
      GemmProblem p;
      p.m = L.in;
      p.n = T;
      p.k = L.out;
      p.a = set(i).w->p;
      p.lda = L.in;
      p.b = set(i).dy->p;
      p.ldb = L.out;
      p.d = dx.p;
      p.ldd = L.in;
      bf16_gemm.run(p, nullptr);
    };
    auto bf16_wgrad = [&](int i) {
      GemmProblem p;
      p.trans_b = true;
      p.m = L.in;
      p.n = L.out;
      p.k = T;
      p.a = set(i).x->p;
      p.lda = L.in;
      p.b = set(i).dy->p;
      p.ldb = L.out;
      p.d = dw.p;
      p.ldd = L.in;
      p.d_fp32 = true;
      p.beta = 1.0f;
      bf16_gemm.run(p, nullptr);
    };
    auto fp8_fwd = [&](int i, bool fast) {
      const OperandSet& s = set(i);
      Fp8ForwardArgs a;
      a.rows = T;
      a.n = L.out;
      a.k = L.in;
      a.x = s.xq->as<uint8_t>();
      a.x_scale_inv = s.sc->scale_inv(0);
      a.w = s.wq->as<uint8_t>();
      a.w_scale_inv = s.sc->scale_inv(1);
      a.y = y8.as<bf16>();
      a.bias = s.bias->as<bf16>();
      a.fast_accum = fast;
      fp8_gemm.forward(a, nullptr);
    };
    auto fp8_dgrad = [&](int i, bool fast) {
      const OperandSet& s = set(i);
      Fp8DgradArgs a;
      a.rows = T;
      a.n = L.out;
      a.k = L.in;
      a.dy = s.dyq->as<uint8_t>();
      a.dy_scale_inv = s.sc->scale_inv(2);
      a.w_t = s.wq_t->as<uint8_t>();
      a.w_scale_inv = s.sc->scale_inv(1);
      a.dx = dx.as<bf16>();
      a.fast_accum = fast;
      fp8_gemm.dgrad(a, nullptr);
    };
    auto fp8_wgrad = [&](int i, bool fast) {
      const OperandSet& s = set(i);
      Fp8WgradArgs a;
      a.rows = T;
      a.n = L.out;
      a.k = L.in;
      a.ld_t = ld;
      a.dy_t = s.dyq_t->as<uint8_t>();
      a.dy_scale_inv = s.sc->scale_inv(2);
      a.x_t = s.xq_t->as<uint8_t>();
      a.x_scale_inv = s.sc->scale_inv(0);
      a.dw = dw.as<float>();
      a.fast_accum = fast;
      fp8_gemm.wgrad(a, nullptr);
    };
    struct Row {
      const char* product;
      std::function<void(int)> bf16;
      std::function<void(int, bool)> fp8;
      bool default_fast;
    };
    const Row rows[] = {{"fwd", bf16_fwd, fp8_fwd, Fp8ForwardArgs{}.fast_accum},
                        {"dgrad", bf16_dgrad, fp8_dgrad, Fp8DgradArgs{}.fast_accum},
                        {"wgrad", bf16_wgrad, fp8_wgrad, Fp8WgradArgs{}.fast_accum}};
    for (const Row& r : rows) {
      const double t16 = median_ms(r.bf16, o.warmup, o.reps);
      const double t8 = median_ms([&](int i) { r.fp8(i, r.default_fast); }, o.warmup, o.reps);
      const double t8_other = median_ms([&](int i) { r.fp8(i, !r.default_fast); }, o.warmup, o.reps);
      sum_bf16 += t16;
      sum_fp8 += t8;
      std::printf("| %-20s | %-7s | %8.3f | %8.3f | %5.2fx | %11.1f | %11.1f | %9.3f (%s) |\n", L.name, r.product, t16,
                  t8, t16 / t8, flop / t16 * 1e-9, flop / t8 * 1e-9, t8_other, r.default_fast ? "slow" : "fast");
    }
    if (L.in == 1024 && L.out == 1024) {  // the check, on the outputs of the last default-mode forward and bf16 calls
      fp8_fwd(0, true);
      bf16_fwd(0);
      NOPAD_CUDA_CHECK(cudaDeviceSynchronize());
      ok = check_forward(sets[0], y8, y, T, L.in, L.out) && ok;
    }
  }
  std::printf("sum of the 12 products (one layer of each kind, default accumulation): bf16 %.3f ms, fp8 %.3f ms, "
              "%.2fx\n",
              sum_bf16, sum_fp8, sum_bf16 / sum_fp8);

  // The cast: bytes that must move = 2 per input element + 1 per output copy (+ the transposed copy's padding).
  std::printf("| %-28s | %8s | %8s | %7s |\n", "cast", "ms", "GB/s", "of HBM");
  for (const int64_t cols : {int64_t{1024}, int64_t{3072}, int64_t{4096}}) {
    std::vector<std::unique_ptr<Buf>> src;
    for (int i = 0; i < o.rotate; ++i) {
      src.push_back(std::make_unique<Buf>(static_cast<size_t>(T * cols) * 2));
      fill(*src.back(), static_cast<size_t>(T * cols), 100u + static_cast<uint32_t>(i), -4.0f, 4.0f);
    }
    Buf q(static_cast<size_t>(T * cols)), qt(static_cast<size_t>(cols * ld)), sc(4), amax(4);
    const float one = 1.0f;
    NOPAD_CUDA_CHECK(cudaMemcpy(sc.p, &one, 4, cudaMemcpyHostToDevice));
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const bool transposed : {false, true}) {
        const double t = median_ms(
            [&](int i) {
              Fp8CastArgs a;
              a.x = src[static_cast<size_t>(i % o.rotate)]->as<bf16>();
              a.rows = T;
              a.cols = cols;
              a.format = f;
              a.scale = sc.as<float>();
              a.q = q.as<uint8_t>();
              a.q_t = transposed ? qt.as<uint8_t>() : nullptr;
              a.ld_t = ld;
              a.amax = amax.as<float>();
              launch_fp8_cast(a, nullptr);
            },
            o.warmup, o.reps);
        const double bytes = static_cast<double>(T) * cols * 3 + (transposed ? static_cast<double>(cols) * ld : 0.0);
        const std::string what =
            str_cat("[", T, ", ", cols, "] ", fp8_format_name(f), transposed ? " + transposed" : "");
        std::printf("| %-28s | %8.3f | %8.0f | %6.1f%% |\n", what.c_str(), t, bytes / t * 1e-6,
                    100.0 * bytes / t * 1e-6 / kHbmGBs);
      }
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace nopad::cuda

int main(int argc, char** argv) {
  try {
    return nopad::cuda::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dev_fp8_gemm_bench: %s\n", e.what());
    return 1;
  }
}
