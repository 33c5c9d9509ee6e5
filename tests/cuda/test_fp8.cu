// FP8 on the GPU against its CPU twins (needs a GPU: nopad_cuda_tests; the product tests need compute capability 8.9+
// and check the clean refusal elsewhere):
//   Fp8Twin     core/fp8.h equals cuda_fp8.h's own host conversion (__nv_cvt_float_to_fp8, __NV_SATFINITE) for every
//               bf16 and every 251st float bit pattern, and its decoding for all 256 codes.
//   Fp8Cast     launch_fp8_cast bit for bit against fp8_quantize: all 65536 bf16 patterns (NaN, inf, subnormals, -0)
//               under scales that overflow, underflow, are not powers of two or overflow fp32 itself, both formats,
//               row-major and transposed copies, the amax (NaN propagating, a running maximum over two casts);
//               awkward shapes (rows and columns not multiples of the 64 x 64 tile or of 16, one row, one column), a
//               padded transposed leading dimension, an unaligned input (the scalar path). Outputs are poisoned
//               before every launch with the complement of the expected byte, so an unwritten byte always fails.
//   Fp8Scaling  launch_fp8_update_scales over 300 steps of random amaxes including 0, +-inf, NaN, subnormal and
//               huge values, for four recipes, equal to fp8_update_scaling (scales, inverses, rings, heads, and the
//               amax slots reset to 0) after every step.
//   Fp8Gemm     the three products on BERT-like shapes (rows 333..2999, odd; k and n 1024..4096) with inputs
//               quantised by the cast and the device recipe, against a twin that decodes the fp8 operands exactly,
//               multiplies in double and applies the inverse scales; fast accumulation on and off; bias and beta;
//               the refusals of bad shapes; the epilogue probe.
//
// The products' bound. Each output is sum_t a_t b_t s (s = the two inverse scales) over K terms; S = sum_t |a_t b_t| s.
// The products of two fp8 values are exact; what rounds is the accumulation and the output:
//   * fp32 accumulation: <= K 2^-24 S (the classical bound of a recursive fp32 sum);
//   * the FP8 tensor cores add each wgmma's K = 32 products into their accumulator keeping about 14 bits (DeepSeek-V3
//     report, section 3.3). We allow 13 bits (a factor 2 of margin): each accumulator update errs by <= 2^-13 S, and
//     there are at most ceil(K/32) updates before a promotion to fp32: 2^-13 ceil(K/32) S. Without fast accumulation
//     the partial sums are promoted periodically (cublasLt.h), at an interval cuBLASLt does not document, so the same
//     bound (sound for any interval) serves both modes; the norm check below tells them apart;
//   * the output: bf16 rounding (8 significant bits) <= 2^-8 |y| (half an ulp, relative to the value; 2^-9 would be
//     the bound of a 9-bit format), fp32 <= 2^-24 |y|; plus 2^-20 |y| for the epilogue's fp32 scale, bias and beta
//     operations, and 2^-23 |C| for the accumulated term (beta = 1).
// The inputs are uniform in [-0.5, 1) (mean 0.25), so S ~ 3 |y|: the bound is 2^-13 ceil(K/32) S (0.4% of S at K =
// 1024, 1.6% at 4096) plus the rounding, while a wrong operand, layout or scale moves outputs by ~10% at K = 1024 and
// ~5% (with tails far beyond the bound among a million outputs) at 4096. A second, statistical check: the norm of the
// error over the norm of the reference <= 2^-7 (+ ceil(K/32) 2^-14 with fast accumulation, the drift of a truncating
// accumulator over its updates), where bf16 rounding alone gives ~2^-9.5 and a layout error > 2^-5.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fp8.h"
#include "ops/cuda/fp8_cast.h"
#include "ops/cuda/gemm_fp8.h"
#include "ops/fp8_recipe.h"

namespace nopad::cuda {
namespace {

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A device buffer that frees itself.
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t b) : bytes(b) {
    if (cudaMalloc(&p, b == 0 ? 16 : b) != cudaSuccess) p = nullptr;
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void upload(const Dev& d, const std::vector<T>& v) {
  ASSERT_NE(d.p, nullptr);
  ASSERT_EQ(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}
template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

// ------------------------------------------------------------------------------------------------ the twin vs CUDA

TEST(Fp8Twin, MatchesCudaHeaderOnHost) {
  size_t bad = 0;
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += (i < 65536 ? 1 : 251)) {
    // The first 65536 steps are every bf16 pattern (shifted into the float's top half), then every 251st float.
    const uint32_t u = i < 65536 ? static_cast<uint32_t>(i) << 16 : static_cast<uint32_t>(i);
    const float x = from_bits(u);
    for (const Fp8Format f : kFormats) {
      const uint8_t want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
      const uint8_t got = fp8_encode(x, f);
      if (got != want && bad++ < 5)
        ADD_FAILURE() << fp8_format_name(f) << " float 0x" << std::hex << u << ": twin 0x" << int(got) << ", CUDA 0x"
                      << int(want);
    }
  }
  EXPECT_EQ(bad, 0u);
  for (int c = 0; c < 256; ++c) {
    __nv_fp8_e4m3 a;
    a.__x = static_cast<__nv_fp8_storage_t>(c);
    __nv_fp8_e5m2 b;
    b.__x = static_cast<__nv_fp8_storage_t>(c);
    const float fa = static_cast<float>(a), fb = static_cast<float>(b);
    const float ta = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE4M3);
    const float tb = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE5M2);
    EXPECT_TRUE(std::isnan(fa) ? std::isnan(ta) : bits_of(fa) == bits_of(ta)) << "E4M3 code " << c;
    EXPECT_TRUE(std::isnan(fb) ? std::isnan(tb) : bits_of(fb) == bits_of(tb)) << "E5M2 code " << c;
  }
  static_assert(sizeof(fp8e4m3) == sizeof(__nv_fp8_e4m3) && sizeof(fp8e5m2) == sizeof(__nv_fp8_e5m2));
}

// ------------------------------------------------------------------------------------------------ the cast

struct CastCase {
  std::vector<bf16> x;  // [rows, cols]
  int64_t rows = 0, cols = 0, ld_t = 0;
  size_t x_offset = 0;  // elements the device input is shifted by (1: unaligned, the scalar path)
};

// Runs the cast (row-major and transposed outputs, amax starting at amax0) and compares everything with the twin.
void check_cast(const CastCase& c, Fp8Format f, float scale, float amax0 = 0.0f) {
  SCOPED_TRACE(std::string(fp8_format_name(f)) + " rows " + std::to_string(c.rows) + " cols " +
               std::to_string(c.cols) + " ld_t " + std::to_string(c.ld_t) + " scale " + std::to_string(scale) +
               " offset " + std::to_string(c.x_offset));
  const size_t n = static_cast<size_t>(c.rows * c.cols), nt = static_cast<size_t>(c.cols * c.ld_t);
  std::vector<uint8_t> want(n), want_t(nt, 0);
  const float twin_amax = fp8_quantize(c.x.data(), n, scale, f, want.data());
  const float want_amax = from_bits(std::max(bits_of(twin_amax), bits_of(amax0)));
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t k = 0; k < c.cols; ++k)
      want_t[static_cast<size_t>(k * c.ld_t + r)] = want[static_cast<size_t>(r * c.cols + k)];
  // Poison: the complement of every expected byte, so an unwritten byte can never pass.
  std::vector<uint8_t> poison(n), poison_t(nt);
  for (size_t i = 0; i < n; ++i) poison[i] = static_cast<uint8_t>(~want[i]);
  for (size_t i = 0; i < nt; ++i) poison_t[i] = static_cast<uint8_t>(~want_t[i]);
  Dev dx((n + c.x_offset) * sizeof(bf16)), dq(n), dqt(nt), dscale(4), damax(4);
  ASSERT_TRUE(dx.p && dq.p && dqt.p && dscale.p && damax.p);
  if (n > 0) CK(cudaMemcpy(dx.as<bf16>() + c.x_offset, c.x.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
  upload(dq, poison);
  upload(dqt, poison_t);
  CK(cudaMemcpy(dscale.p, &scale, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(damax.p, &amax0, 4, cudaMemcpyHostToDevice));
  Fp8CastArgs a;
  a.x = dx.as<bf16>() + c.x_offset;
  a.rows = c.rows;
  a.cols = c.cols;
  a.format = f;
  a.scale = dscale.as<float>();
  a.q = dq.as<uint8_t>();
  a.q_t = dqt.as<uint8_t>();
  a.ld_t = c.ld_t;
  a.amax = damax.as<float>();
  launch_fp8_cast(a, nullptr);
  CK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = download<uint8_t>(dq.p, n), got_t = download<uint8_t>(dqt.p, nt);
  const float got_amax = download<float>(damax.p, 1)[0];
  size_t bad = 0, bad_t = 0;
  for (size_t i = 0; i < n; ++i)
    if (got[i] != want[i] && bad++ < 3)
      ADD_FAILURE() << "q[" << i / c.cols << "][" << i % c.cols << "] = 0x" << std::hex << int(got[i]) << ", twin 0x"
                    << int(want[i]) << " (x bits 0x" << c.x[i].bits << ")";
  for (size_t i = 0; i < nt; ++i)
    if (got_t[i] != want_t[i] && bad_t++ < 3)
      ADD_FAILURE() << "q_t[" << i / c.ld_t << "][" << i % c.ld_t << "] = 0x" << std::hex << int(got_t[i])
                    << ", twin 0x" << int(want_t[i]);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(bad_t, 0u);
  EXPECT_EQ(bits_of(got_amax), bits_of(want_amax)) << "amax " << got_amax << ", twin " << want_amax;
}

std::vector<bf16> all_bf16_patterns() {
  std::vector<bf16> x(65536);
  for (uint32_t i = 0; i < 65536; ++i) x[i].bits = static_cast<uint16_t>(i * 40503u);  // a permutation of 0..65535
  return x;
}

TEST(Fp8Cast, EveryBf16PatternEveryScale) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  CastCase c;
  c.x = all_bf16_patterns();
  c.rows = 256;
  c.cols = 256;
  c.ld_t = 256;
  // 1; overflowing (x 2^10, x 2^20: most values saturate); underflowing (2^-10, 2^-30: most flush to +-0 or land
  // among the subnormals); not powers of two; 3e38, where the fp32 product itself overflows to inf (saturates).
  for (const float scale : {1.0f, 1024.0f, 1048576.0f, 0.0009765625f, 9.3132257e-10f, 0.7f, 13.37f, 3e38f}) {
    for (const Fp8Format f : kFormats) check_cast(c, f, scale);
  }
  // The same patterns as one long row (its transposed copy: 65536 rows of 16, one value and 15 zeros each) and as
  // one column (scalar loads: cols % 16 != 0).
  CastCase row = c;
  row.rows = 1;
  row.cols = 65536;
  row.ld_t = 16;
  check_cast(row, Fp8Format::kE4M3, 0.37f);
  CastCase col = c;
  col.rows = 65536;
  col.cols = 1;
  col.ld_t = 65536;
  check_cast(col, Fp8Format::kE5M2, 5.0f);
}

TEST(Fp8Cast, AwkwardShapesTransposeAndAmax) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 999);
  const int64_t shapes[][2] = {{1, 1},     {1, 16},   {3, 5},     {63, 64},  {65, 65},  {64, 48}, {1001, 1000},
                               {100, 4096}, {2049, 48}, {7, 1024}, {129, 3072}, {17, 24}, {500, 1}};
  int i = 0;
  for (const auto& s : shapes) {
    CastCase c;
    c.rows = s[0];
    c.cols = s[1];
    c.ld_t = fp8_transposed_ld(c.rows) + (i % 3 == 2 ? 48 : 0);  // sometimes more padding than needed
    c.x.resize(static_cast<size_t>(c.rows * c.cols));
    for (bf16& v : c.x) {
      const int p = pick(rng);
      v = to_bf16(p < 3 ? nd(rng) * 1e-6f : p < 6 ? nd(rng) * 1e4f : nd(rng) * 3.0f);
    }
    const Fp8Format f = kFormats[i % 2];
    check_cast(c, f, 1.0f);
    check_cast(c, f, fp8_max(f) / 11.0f);
    check_cast(c, f, 0.11f, 2.5f);  // amax starts at 2.5: a running maximum (usually overtaken)
    check_cast(c, f, 0.11f, 1e30f);  // ... or not
    c.x_offset = 1;  // unaligned input: the scalar path
    check_cast(c, f, 2.0f);
    ++i;
  }
  // An inf without NaN gives an inf amax.
  CastCase c;
  c.rows = 33;
  c.cols = 80;
  c.ld_t = fp8_transposed_ld(33);
  c.x.assign(33 * 80, to_bf16(0.5f));
  c.x[1234] = bf16{0xFF80};
  check_cast(c, Fp8Format::kE5M2, 3.0f);
}

TEST(Fp8Cast, MicroBatchesShareOneAmaxAndTheScaleComesFromTheDevice) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  // Two casts of one tensor (micro-batches) into one amax, then the device update, then a cast with the new scale,
  // all on one stream with no host synchronisation in between.
  const int64_t rows = 300, cols = 128;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<bf16> x1(rows * cols), x2(rows * cols);
  for (bf16& v : x1) v = to_bf16(nd(rng));
  for (bf16& v : x2) v = to_bf16(nd(rng) * 3.0f);
  const ops::Fp8Recipe recipe{1, ops::AmaxAlgo::kMostRecent, 0};
  Fp8Scalings sc({Fp8Format::kE4M3}, recipe);
  Dev d1(x1.size() * 2), d2(x2.size() * 2), dq(x1.size());
  upload(d1, x1);
  upload(d2, x2);
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Fp8CastArgs a;
  a.rows = rows;
  a.cols = cols;
  a.format = Fp8Format::kE4M3;
  a.scale = sc.scale(0);
  a.amax = sc.amax(0);
  a.x = d1.as<bf16>();
  launch_fp8_cast(a, s);  // amax only (no outputs), scale 1
  a.x = d2.as<bf16>();
  launch_fp8_cast(a, s);
  sc.update(s);
  a.x = d1.as<bf16>();
  a.q = dq.as<uint8_t>();
  a.amax = nullptr;
  launch_fp8_cast(a, s);
  CK(cudaStreamSynchronize(s));
  CK(cudaStreamDestroy(s));
  const float amax = std::max(fp8_quantize(x1.data(), x1.size(), 1.0f, Fp8Format::kE4M3, nullptr),
                              fp8_quantize(x2.data(), x2.size(), 1.0f, Fp8Format::kE4M3, nullptr));
  ops::Fp8TensorScaling twin = ops::make_fp8_scaling(recipe, Fp8Format::kE4M3);
  ops::fp8_update_scaling(recipe, amax, twin);
  EXPECT_EQ(bits_of(download<float>(sc.scale(0), 1)[0]), bits_of(twin.scale));
  EXPECT_EQ(download<float>(sc.amax(0), 1)[0], 0.0f);  // reset by the update
  std::vector<uint8_t> want(x1.size());
  fp8_quantize(x1.data(), x1.size(), twin.scale, Fp8Format::kE4M3, want.data());
  EXPECT_TRUE(download<uint8_t>(dq.p, want.size()) == want);
  EXPECT_GT(twin.scale, 1.0f);  // the test means something: the amax (~25) maps below 448 with a scale above 1
}

TEST(Fp8Cast, RefusesBadArguments) {
  Fp8CastArgs a;
  a.rows = 4;
  a.cols = 4;
  EXPECT_THROW(launch_fp8_cast(a, nullptr), Error);  // no scale
  float* fake = reinterpret_cast<float*>(uintptr_t{256});
  a.scale = fake;
  a.x = reinterpret_cast<const bf16*>(fake);
  a.q_t = reinterpret_cast<uint8_t*>(uintptr_t{512});
  a.ld_t = 8;  // not a multiple of 16
  try {
    launch_fp8_cast(a, nullptr);
    FAIL() << "ld_t 8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
  a.ld_t = 0;  // below rows
  EXPECT_THROW(launch_fp8_cast(a, nullptr), Error);
}

// ------------------------------------------------------------------------------------------------ the scale update

TEST(Fp8Scaling, DeviceUpdateMatchesCpuRecipe) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  const int n = 37;
  std::vector<Fp8Format> formats(n);
  for (int i = 0; i < n; ++i) formats[static_cast<size_t>(i)] = kFormats[(i * 7) % 3 == 0 ? 1 : 0];
  const ops::Fp8Recipe recipes[] = {{1, ops::AmaxAlgo::kMostRecent, 0},
                                    {16, ops::AmaxAlgo::kMax, 0},
                                    {5, ops::AmaxAlgo::kMax, 2},
                                    {3, ops::AmaxAlgo::kMostRecent, 1}};
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> kind(0, 99);
  std::normal_distribution<float> log_amax(0.0f, 6.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (const ops::Fp8Recipe& r : recipes) {
    SCOPED_TRACE(std::string(ops::amax_algo_name(r.algo)) + " L=" + std::to_string(r.history_len) +
                 " margin=" + std::to_string(r.margin));
    Fp8Scalings sc(formats, r);
    std::vector<ops::Fp8TensorScaling> twin;
    for (const Fp8Format f : formats) twin.push_back(ops::make_fp8_scaling(r, f));
    const Fp8ScalingTable& t = sc.table();
    int checked_kept = 0;
    for (int step = 0; step < 300; ++step) {
      std::vector<float> amax(n);
      for (float& a : amax) {
        const int k = kind(rng);
        a = k < 10 ? 0.0f
            : k < 13 ? inf
            : k < 15 ? -inf  // never produced by a cast (amax >= 0), handled anyway
            : k < 18 ? std::numeric_limits<float>::quiet_NaN()
            : k < 20 ? 1e-41f * static_cast<float>(k)  // subnormal: 448 / a overflows -> FLT_MAX
            : k < 22 ? 3e38f
                     : std::exp2(log_amax(rng));
      }
      for (int i = 0; i < n; ++i)  // each tensor's slot (kFp8ScalarStride apart)
        ASSERT_EQ(cudaMemcpy(sc.amax(i), &amax[static_cast<size_t>(i)], sizeof(float), cudaMemcpyHostToDevice),
                  cudaSuccess);
      sc.update(nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (int i = 0; i < n; ++i) {
        const float before = twin[static_cast<size_t>(i)].scale;
        ops::fp8_update_scaling(r, amax[static_cast<size_t>(i)], twin[static_cast<size_t>(i)]);
        checked_kept += twin[static_cast<size_t>(i)].scale == before;
      }
      const size_t slots = static_cast<size_t>(n) * kFp8ScalarStride;
      const auto scale_all = download<float>(t.scale, slots), inv_all = download<float>(t.scale_inv, slots);
      const auto reset_all = download<float>(t.amax, slots);
      std::vector<float> scale(n), inv(n), reset(n);
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        scale[i] = scale_all[i * kFp8ScalarStride];
        inv[i] = inv_all[i * kFp8ScalarStride];
        reset[i] = reset_all[i * kFp8ScalarStride];
        // cuBLASLt needs each scale pointer on its own 256 bytes (fp8_cast.h)
        ASSERT_EQ(reinterpret_cast<uintptr_t>(sc.scale_inv(static_cast<int>(i))) % 256, 0u);
        ASSERT_EQ(reinterpret_cast<uintptr_t>(sc.scale(static_cast<int>(i))) % 256, 0u);
        ASSERT_EQ(reinterpret_cast<uintptr_t>(sc.amax(static_cast<int>(i))) % 256, 0u);
      }
      const auto hist = download<float>(t.history, static_cast<size_t>(n) * r.history_len);
      const auto head = download<int32_t>(t.head, n);
      for (int i = 0; i < n; ++i) {
        const ops::Fp8TensorScaling& w = twin[static_cast<size_t>(i)];
        ASSERT_EQ(bits_of(scale[i]), bits_of(w.scale)) << "step " << step << " tensor " << i << ": " << scale[i]
                                                       << " vs " << w.scale << " (amax " << amax[i] << ")";
        ASSERT_EQ(bits_of(inv[i]), bits_of(w.scale_inv)) << "step " << step << " tensor " << i;
        ASSERT_EQ(reset[i], 0.0f);
        ASSERT_EQ(head[i], w.head) << "step " << step << " tensor " << i;
        for (int j = 0; j < r.history_len; ++j)
          ASSERT_EQ(bits_of(hist[static_cast<size_t>(i * r.history_len + j)]),
                    bits_of(w.history[static_cast<size_t>(j)]));
      }
    }
    EXPECT_GT(checked_kept, 100);  // the kept-scale branches ran
  }
}

// ------------------------------------------------------------------------------------------------ the products

// A bf16 tensor quantised on the device as training will: a cast for the amax (scale 1), the device update
// (most recent), the cast with that scale (row-major and/or transposed copies).
struct Quantised {
  std::unique_ptr<Dev> q, q_t;
  int64_t rows = 0, cols = 0, ld_t = 0;
  float scale_inv = 1.0f;  // host copy
  std::unique_ptr<Fp8Scalings> sc;
  const float* d_scale_inv() const { return sc->scale_inv(0); }
};

Quantised quantise(const std::vector<bf16>& x, int64_t rows, int64_t cols, Fp8Format f, bool row_major,
                   bool transposed) {
  Quantised out;
  out.rows = rows;
  out.cols = cols;
  out.ld_t = fp8_transposed_ld(rows);
  out.sc = std::make_unique<Fp8Scalings>(std::vector<Fp8Format>{f}, ops::Fp8Recipe{});
  Dev dx(x.size() * sizeof(bf16));
  EXPECT_EQ(cudaMemcpy(dx.p, x.data(), x.size() * sizeof(bf16), cudaMemcpyHostToDevice), cudaSuccess);
  Fp8CastArgs a;
  a.x = dx.as<bf16>();
  a.rows = rows;
  a.cols = cols;
  a.format = f;
  a.scale = out.sc->scale(0);
  a.amax = out.sc->amax(0);
  launch_fp8_cast(a, nullptr);
  out.sc->update(nullptr);
  if (row_major) out.q = std::make_unique<Dev>(static_cast<size_t>(rows * cols));
  if (transposed) out.q_t = std::make_unique<Dev>(static_cast<size_t>(cols * out.ld_t));
  a.amax = nullptr;
  a.q = row_major ? out.q->as<uint8_t>() : nullptr;
  a.q_t = transposed ? out.q_t->as<uint8_t>() : nullptr;
  a.ld_t = out.ld_t;
  launch_fp8_cast(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out.scale_inv = download<float>(out.sc->scale_inv(0), 1)[0];
  EXPECT_NE(out.scale_inv, 1.0f);  // a real scale, so a product that ignores it fails
  return out;
}

std::vector<float> decode_all(const void* d, size_t n, Fp8Format f) {
  float table[256];
  for (int c = 0; c < 256; ++c) table[c] = fp8_decode(static_cast<uint8_t>(c), f);
  const std::vector<uint8_t> q = download<uint8_t>(d, n);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = table[q[i]];
  return v;
}

// ref[p][q] = s sum_t A[p][t] B[q][t] and S[p][q] = s sum_t |A[p][t] B[q][t]|, A [P, K] and B [Q, K] row-major, in
// double (the fp8 products are exact in float, their sums nearly exact in double), threads over p.
void twin_product(const std::vector<float>& A, const std::vector<float>& B, int64_t P, int64_t Q, int64_t K, double s,
                  std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(static_cast<size_t>(P * Q), 0.0);
  mag.assign(static_cast<size_t>(P * Q), 0.0);
  const int threads = static_cast<int>(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&, w] {
      for (int64_t p = w; p < P; p += threads) {
        const float* a = A.data() + p * K;
        for (int64_t q = 0; q < Q; ++q) {
          const float* b = B.data() + q * K;
          double acc = 0, abs_acc = 0;
          for (int64_t t = 0; t < K; ++t) {
            const double prod = static_cast<double>(a[t]) * b[t];
            acc += prod;
            abs_acc += std::fabs(prod);
          }
          ref[static_cast<size_t>(p * Q + q)] = acc * s;
          mag[static_cast<size_t>(p * Q + q)] = abs_acc * s;
        }
      }
    });
  for (std::thread& t : pool) t.join();
}

// Compares the product's output with ref (+ extra = bias and beta C terms, already in ref) under the bound above.
void check_product(const std::vector<float>& got, const std::vector<double>& ref, const std::vector<double>& mag,
                   const std::vector<double>& c_abs, int64_t K, bool fast, bool bf16_out) {
  const double kblocks = std::ceil(static_cast<double>(K) / 32.0);
  const double gamma = kblocks * std::ldexp(1.0, -13) + K * std::ldexp(1.0, -24);
  const double out_u = bf16_out ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  size_t bad = 0;
  double err2 = 0, ref2 = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    const double bound = gamma * mag[i] + (out_u + std::ldexp(1.0, -20)) * std::fabs(r) +
                         (c_abs.empty() ? 0.0 : std::ldexp(1.0, -23) * c_abs[i]) + 1e-30;
    const double e = std::fabs(g - r);
    if (!(e <= bound) && bad++ < 5)
      ADD_FAILURE() << "element " << i << ": got " << g << ", reference " << r << ", |error| " << e << " > bound "
                    << bound << " (S = " << mag[i] << ")";
    if (std::isfinite(e)) worst = std::max(worst, e / bound);
    err2 += (g - r) * (g - r);
    ref2 += r * r;
  }
  EXPECT_EQ(bad, 0u) << "of " << got.size();
  const double rel = std::sqrt(err2 / ref2);
  const double rel_tol = std::ldexp(1.0, -7) + (fast ? kblocks * std::ldexp(1.0, -14) : 0.0);
  EXPECT_LE(rel, rel_tol) << "norm-relative error";
  std::printf("  K %6lld fast %d: norm-relative error %.3e (tolerance %.3e), worst element at %.3f of its bound\n",
              static_cast<long long>(K), fast ? 1 : 0, rel, rel_tol, worst);
}

std::vector<bf16> random_bf16(size_t n, std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> u(-0.5f, 1.0f);
  std::vector<bf16> v(n);
  for (bf16& x : v) x = to_bf16(u(rng) * scale);
  return v;
}

struct Shape {
  int64_t rows, in, out;  // x [rows, in], W [out, in]
};
// Rows odd (not multiples of 16), BERT-large's layers: attention output 1024->1024, QKV 1024->3072, FFN in
// 1024->4096, FFN out 4096->1024.
const Shape kShapes[] = {{2999, 1024, 1024}, {1001, 1024, 3072}, {333, 1024, 4096}, {517, 4096, 1024}};

TEST(Fp8Gemm, ForwardDgradWgradMatchTheTwin) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  Fp8Gemm gemm;
  if (!gemm.supported()) {  // the clean refusal is the behaviour on GPUs without FP8 tensor cores
    Dev a(1 << 20), s(16), y(1 << 20);
    Fp8ForwardArgs f;
    f.rows = 16;
    f.n = 16;
    f.k = 16;
    f.x = f.w = a.as<uint8_t>();
    f.x_scale_inv = f.w_scale_inv = s.as<float>();
    f.y = y.as<bf16>();
    try {
      gemm.forward(f, nullptr);
      FAIL() << "an FP8 product ran on a GPU without FP8 tensor cores";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("compute capability"), std::string::npos) << e.what();
    }
    return;
  }
  std::mt19937 rng(1234);
  for (const Shape& sh : kShapes) {
    SCOPED_TRACE("rows " + std::to_string(sh.rows) + " in " + std::to_string(sh.in) + " out " +
                 std::to_string(sh.out));
    std::printf("shape rows %lld, %lld -> %lld\n", static_cast<long long>(sh.rows), static_cast<long long>(sh.in),
                static_cast<long long>(sh.out));
    const std::vector<bf16> x = random_bf16(static_cast<size_t>(sh.rows * sh.in), rng, 3.0f);
    const std::vector<bf16> w = random_bf16(static_cast<size_t>(sh.out * sh.in), rng, 0.05f);
    const std::vector<bf16> dy = random_bf16(static_cast<size_t>(sh.rows * sh.out), rng, 1e-3f);
    const std::vector<bf16> bias = random_bf16(static_cast<size_t>(sh.out), rng, 2.0f);
    const Quantised qx = quantise(x, sh.rows, sh.in, Fp8Format::kE4M3, true, true);
    const Quantised qw = quantise(w, sh.out, sh.in, Fp8Format::kE4M3, true, true);
    const Quantised qdy = quantise(dy, sh.rows, sh.out, Fp8Format::kE5M2, true, true);
    Dev dbias(bias.size() * 2);
    upload(dbias, bias);

    // Forward: y[rows, out] = x W^T + bias, and the same product accumulated onto y0 (beta = 1, no bias).
    {
      const std::vector<float> X = decode_all(qx.q->p, static_cast<size_t>(sh.rows * sh.in), Fp8Format::kE4M3);
      const std::vector<float> W = decode_all(qw.q->p, static_cast<size_t>(sh.out * sh.in), Fp8Format::kE4M3);
      std::vector<double> ref, mag;
      twin_product(X, W, sh.rows, sh.out, sh.in, static_cast<double>(qx.scale_inv) * qw.scale_inv, ref, mag);
      const std::vector<bf16> y0 = random_bf16(ref.size(), rng, 10.0f);
      Dev dy_out(ref.size() * 2);
      for (const bool fast : {true, false}) {
        for (const bool accumulate : {false, true}) {
          if (accumulate && !fast) continue;
          std::vector<double> want = ref, c_abs;
          if (accumulate) {
            upload(dy_out, y0);
            c_abs.resize(ref.size());
            for (size_t i = 0; i < want.size(); ++i) {
              want[i] += to_float(y0[i]);
              c_abs[i] = std::fabs(to_float(y0[i]));
            }
          } else {
            CK(cudaMemset(dy_out.p, 0xFF, dy_out.bytes));  // poison: NaN
            for (size_t i = 0; i < want.size(); ++i) want[i] += to_float(bias[i % static_cast<size_t>(sh.out)]);
          }
          Fp8ForwardArgs f;
          f.rows = sh.rows;
          f.n = sh.out;
          f.k = sh.in;
          f.x = qx.q->as<uint8_t>();
          f.x_scale_inv = qx.d_scale_inv();
          f.w = qw.q->as<uint8_t>();
          f.w_scale_inv = qw.d_scale_inv();
          f.y = dy_out.as<bf16>();
          f.bias = accumulate ? nullptr : dbias.as<bf16>();
          f.beta = accumulate ? 1.0f : 0.0f;
          f.fast_accum = fast;
          gemm.forward(f, nullptr);
          CK(cudaDeviceSynchronize());
          std::vector<float> got(ref.size());
          const std::vector<bf16> g16 = download<bf16>(dy_out.p, ref.size());
          for (size_t i = 0; i < got.size(); ++i) got[i] = to_float(g16[i]);
          SCOPED_TRACE(std::string("forward fast ") + (fast ? "on" : "off") + (accumulate ? " beta 1" : " bias"));
          std::printf(" forward%s", accumulate ? " (beta 1)" : " (bias)");
          check_product(got, want, mag, c_abs, sh.in, fast, true);
        }
      }
    }
    // Data gradient: dx[rows, in] = dy W, from dy as stored and W's transposed copy [in, out].
    {
      const std::vector<float> DY = decode_all(qdy.q->p, static_cast<size_t>(sh.rows * sh.out), Fp8Format::kE5M2);
      ASSERT_EQ(qw.ld_t, sh.out);  // out % 16 == 0: the copy of W is exactly [in, out]
      const std::vector<float> WT = decode_all(qw.q_t->p, static_cast<size_t>(sh.in * sh.out), Fp8Format::kE4M3);
      std::vector<double> ref, mag;
      twin_product(DY, WT, sh.rows, sh.in, sh.out, static_cast<double>(qdy.scale_inv) * qw.scale_inv, ref, mag);
      Dev ddx(ref.size() * 2);
      for (const bool fast : {false, true}) {
        CK(cudaMemset(ddx.p, 0xFF, ddx.bytes));
        Fp8DgradArgs d;
        d.rows = sh.rows;
        d.n = sh.out;
        d.k = sh.in;
        d.dy = qdy.q->as<uint8_t>();
        d.dy_scale_inv = qdy.d_scale_inv();
        d.w_t = qw.q_t->as<uint8_t>();
        d.w_scale_inv = qw.d_scale_inv();
        d.dx = ddx.as<bf16>();
        d.fast_accum = fast;
        gemm.dgrad(d, nullptr);
        CK(cudaDeviceSynchronize());
        const std::vector<bf16> g16 = download<bf16>(ddx.p, ref.size());
        std::vector<float> got(ref.size());
        for (size_t i = 0; i < got.size(); ++i) got[i] = to_float(g16[i]);
        SCOPED_TRACE(std::string("dgrad fast ") + (fast ? "on" : "off"));
        std::printf(" dgrad");
        check_product(got, ref, mag, {}, sh.out, fast, true);
      }
    }
    // Weight gradient: dW[out, in] (+)= dy^T x, from both transposed copies (rows padded with zeros to ld_t).
    {
      ASSERT_EQ(qdy.ld_t, qx.ld_t);
      const int64_t ld = qx.ld_t;
      ASSERT_GT(ld, sh.rows);  // the padding is exercised
      const std::vector<float> DYT = decode_all(qdy.q_t->p, static_cast<size_t>(sh.out * ld), Fp8Format::kE5M2);
      const std::vector<float> XT = decode_all(qx.q_t->p, static_cast<size_t>(sh.in * ld), Fp8Format::kE4M3);
      std::vector<double> ref, mag;
      twin_product(DYT, XT, sh.out, sh.in, ld, static_cast<double>(qdy.scale_inv) * qx.scale_inv, ref, mag);
      std::vector<float> dw0(ref.size());
      std::normal_distribution<float> nd(0.0f, 0.01f);
      for (float& v : dw0) v = nd(rng);
      Dev ddw(ref.size() * 4);
      for (const bool fast : {false, true}) {
        for (const float beta : {1.0f, 0.0f}) {
          if (fast && beta == 0.0f) continue;
          std::vector<double> want = ref, c_abs;
          if (beta == 1.0f) {
            upload(ddw, dw0);
            c_abs.resize(ref.size());
            for (size_t i = 0; i < want.size(); ++i) {
              want[i] += dw0[i];
              c_abs[i] = std::fabs(dw0[i]);
            }
          } else {
            CK(cudaMemset(ddw.p, 0xFF, ddw.bytes));
          }
          Fp8WgradArgs g;
          g.rows = sh.rows;
          g.n = sh.out;
          g.k = sh.in;
          g.ld_t = ld;
          g.dy_t = qdy.q_t->as<uint8_t>();
          g.dy_scale_inv = qdy.d_scale_inv();
          g.x_t = qx.q_t->as<uint8_t>();
          g.x_scale_inv = qx.d_scale_inv();
          g.dw = ddw.as<float>();
          g.beta = beta;
          g.fast_accum = fast;
          gemm.wgrad(g, nullptr);
          CK(cudaDeviceSynchronize());
          const std::vector<float> got = download<float>(ddw.p, ref.size());
          SCOPED_TRACE(std::string("wgrad fast ") + (fast ? "on" : "off") + " beta " + std::to_string(beta));
          std::printf(" wgrad (beta %g)", beta);
          check_product(got, want, mag, c_abs, ld, fast, false);
        }
      }
    }
  }
}

// The engine keeps every tensor's scale in one Fp8Scalings table; the products must run from its pointers (cuBLASLt
// refused them when the scales were packed 4 bytes apart) and give the same bits as with one table per operand.
TEST(Fp8Gemm, ScalesFromOneTable) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  Fp8Gemm gemm;
  if (!gemm.supported()) return;  // the refusal on such GPUs: ForwardDgradWgradMatchTheTwin
  std::mt19937 rng(5);
  const int64_t rows = 200, in = 256, out = 192;
  const Quantised qx = quantise(random_bf16(static_cast<size_t>(rows * in), rng, 3.0f), rows, in, Fp8Format::kE4M3,
                                true, true);
  const Quantised qw = quantise(random_bf16(static_cast<size_t>(out * in), rng, 0.05f), out, in, Fp8Format::kE4M3,
                                true, true);
  const Quantised qdy = quantise(random_bf16(static_cast<size_t>(rows * out), rng, 1e-3f), rows, out,
                                 Fp8Format::kE5M2, true, true);
  Fp8Scalings table({Fp8Format::kE4M3, Fp8Format::kE4M3, Fp8Format::kE5M2, Fp8Format::kE4M3}, ops::Fp8Recipe{});
  const Quantised* ops3[3] = {&qx, &qw, &qdy};
  for (int i = 0; i < 3; ++i)  // slots 1..3: none at the allocation's start
    CK(cudaMemcpy(table.scale_inv(i + 1), ops3[i]->d_scale_inv(), sizeof(float), cudaMemcpyDeviceToDevice));
  Dev y_own(static_cast<size_t>(rows * out) * 2), y_tab(y_own.bytes);
  Dev dx_own(static_cast<size_t>(rows * in) * 2), dx_tab(dx_own.bytes);
  Dev dw_own(static_cast<size_t>(out * in) * 4), dw_tab(dw_own.bytes);
  for (const bool shared : {false, true}) {
    const float* sx = shared ? table.scale_inv(1) : qx.d_scale_inv();
    const float* sw = shared ? table.scale_inv(2) : qw.d_scale_inv();
    const float* sdy = shared ? table.scale_inv(3) : qdy.d_scale_inv();
    Dev& y = shared ? y_tab : y_own;
    Dev& dx = shared ? dx_tab : dx_own;
    Dev& dw = shared ? dw_tab : dw_own;
    CK(cudaMemset(y.p, 0xFF, y.bytes));  // poison: NaN
    CK(cudaMemset(dx.p, 0xFF, dx.bytes));
    CK(cudaMemset(dw.p, 0xFF, dw.bytes));
    Fp8ForwardArgs f;
    f.rows = rows;
    f.n = out;
    f.k = in;
    f.x = qx.q->as<uint8_t>();
    f.x_scale_inv = sx;
    f.w = qw.q->as<uint8_t>();
    f.w_scale_inv = sw;
    f.y = y.as<bf16>();
    gemm.forward(f, nullptr);
    Fp8DgradArgs d;
    d.rows = rows;
    d.n = out;
    d.k = in;
    d.dy = qdy.q->as<uint8_t>();
    d.dy_scale_inv = sdy;
    d.w_t = qw.q_t->as<uint8_t>();
    d.w_scale_inv = sw;
    d.dx = dx.as<bf16>();
    gemm.dgrad(d, nullptr);
    Fp8WgradArgs g;
    g.rows = rows;
    g.n = out;
    g.k = in;
    g.ld_t = qx.ld_t;
    g.dy_t = qdy.q_t->as<uint8_t>();
    g.dy_scale_inv = sdy;
    g.x_t = qx.q_t->as<uint8_t>();
    g.x_scale_inv = sx;
    g.dw = dw.as<float>();
    g.beta = 0.0f;
    gemm.wgrad(g, nullptr);
    CK(cudaDeviceSynchronize());
  }
  const auto same = [](const Dev& a, const Dev& b, const char* what) {
    const std::vector<uint8_t> u = download<uint8_t>(a.p, a.bytes), v = download<uint8_t>(b.p, b.bytes);
    EXPECT_TRUE(u == v) << what << ": the products from one table differ from those with a table per operand";
    const std::vector<uint8_t> poison(u.size(), 0xFF);
    EXPECT_FALSE(u == poison) << what << " was not written";
  };
  same(y_own, y_tab, "forward");
  same(dx_own, dx_tab, "dgrad");
  same(dw_own, dw_tab, "wgrad");
}

TEST(Fp8Gemm, RefusesBadShapesAndLayouts) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  Fp8Gemm gemm;
  Dev buf(1 << 20), s(16);
  auto* p = buf.as<uint8_t>();
  auto expect_refusal = [](auto&& call, const char* words) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected a refusal mentioning '" << words << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  Fp8ForwardArgs f;
  f.rows = 33;
  f.n = 64;
  f.k = 40;  // not a multiple of 16
  f.x = f.w = p;
  f.x_scale_inv = f.w_scale_inv = s.as<float>();
  f.y = reinterpret_cast<bf16*>(p + 4096);
  expect_refusal([&] { gemm.forward(f, nullptr); }, "multiple of 16");
  f.k = 64;
  f.n = 60;  // bf16 output rows of 120 bytes
  expect_refusal([&] { gemm.forward(f, nullptr); }, "multiple of 8");
  f.n = 64;
  f.x = p + 8;  // 8-byte aligned only
  expect_refusal([&] { gemm.forward(f, nullptr); }, "16-byte aligned");
  f.x = p;
  f.x_format = f.w_format = Fp8Format::kE5M2;
  expect_refusal([&] { gemm.forward(f, nullptr); }, "E5M2");
  f.x_format = f.w_format = Fp8Format::kE4M3;
  f.x_scale_inv = nullptr;
  expect_refusal([&] { gemm.forward(f, nullptr); }, "scale_inv");
  f.x_scale_inv = s.as<float>() + 1;  // the next float of an array: cuBLASLt would say only "not supported"
  expect_refusal([&] { gemm.forward(f, nullptr); }, "256-byte aligned");
  f.x_scale_inv = s.as<float>();
  Fp8DgradArgs d;
  d.rows = 10;
  d.n = 1000;  // the reduction, not a multiple of 16
  d.k = 64;
  d.dy = d.w_t = p;
  d.dy_scale_inv = d.w_scale_inv = s.as<float>();
  d.dx = reinterpret_cast<bf16*>(p + 65536);
  expect_refusal([&] { gemm.dgrad(d, nullptr); }, "multiple of 16");
  Fp8WgradArgs g;
  g.rows = 100;
  g.n = 64;
  g.k = 64;
  g.ld_t = 96;  // below rows
  g.dy_t = g.x_t = p;
  g.dy_scale_inv = g.x_scale_inv = s.as<float>();
  g.dw = reinterpret_cast<float*>(p + 65536);
  expect_refusal([&] { gemm.wgrad(g, nullptr); }, "below rows");
  g.ld_t = 104;  // not a multiple of 16
  expect_refusal([&] { gemm.wgrad(g, nullptr); }, "multiple of 16");
  int dev = 0, major = 0, minor = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  EXPECT_EQ(gemm.supported(), major * 10 + minor >= 89);
}

TEST(Fp8Gemm, EpilogueProbe) {
  ASSERT_TRUE(have_gpu()) << "no CUDA device";
  Fp8Gemm gemm;
  if (!gemm.supported()) {
    EXPECT_THROW(gemm.probe_epilogues(1024, 1024, 1024), Error);
    return;
  }
  const auto table = gemm.probe_epilogues(1024, 4096, 1024);
  std::printf("fp8 epilogue probe (m 1024, n 4096, K 1024; TN): epilogue | E4M3xE4M3->bf16 | E4M3xE5M2->bf16 | "
              "E4M3xE5M2->fp32\n");
  bool default_all = false, bias_forward = false;
  for (const auto& e : table) {
    std::printf("fp8 epilogue %-14s %-3s %-3s %-3s\n", e.name.c_str(), e.e4m3_e4m3_bf16 ? "yes" : "no",
                e.e4m3_e5m2_bf16 ? "yes" : "no", e.e4m3_e5m2_fp32 ? "yes" : "no");
    if (e.name == "DEFAULT") default_all = e.e4m3_e4m3_bf16 && e.e4m3_e5m2_bf16 && e.e4m3_e5m2_fp32;
    if (e.name == "BIAS") bias_forward = e.e4m3_e4m3_bf16;
  }
  EXPECT_EQ(table.size(), 10u);
  EXPECT_TRUE(default_all) << "the three products' plain type combinations must be offered";
  EXPECT_TRUE(bias_forward) << "the forward's bias epilogue must be offered";
}

}  // namespace
}  // namespace nopad::cuda
