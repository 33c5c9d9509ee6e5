// Blocked GEMM and small vector helpers for the CPU backend (see cpu_gemm.h). The micro-kernel keeps a 4 x 16 block
// of C in registers while walking k; on x86-64 GCC also builds an AVX2 clone chosen at run time (target_clones), so
// the default -O3 build is not stuck with SSE2.
#include "ops/cpu/cpu_gemm.h"

#include <algorithm>
#include <cstring>

#include "core/threads.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define NOPAD_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define NOPAD_MULTIVERSION
#endif

namespace nopad::ops::cpu {
namespace {

constexpr int64_t kTileM = 64, kTileN = 256, kTileK = 128;  // C tile and k block (B block 128 x 256 stays in L2)
constexpr int kMicroM = 6;  // rows of C per micro-kernel: 12 accumulator registers

// 32-byte vectors (GCC/Clang vector extensions): one AVX register in the x86-64-v3 clone, two SSE registers in the
// default one. The _u types allow unaligned loads and stores.
typedef float vf __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(32), aligned(4)));
typedef double vd __attribute__((vector_size(32)));
typedef double vd_u __attribute__((vector_size(32), aligned(8)));
template <class S>
struct Vec;
template <>
struct Vec<float> {
  using V = vf;
  using U = vf_u;
};
template <>
struct Vec<double> {
  using V = vd;
  using U = vd_u;
};

// C[mb, nb] += A[mb, kb] B[kb, nb] for one tile, everything already offset. The micro-kernel holds a
// kMicroM x (2 vectors) block of C in registers while walking k: per k, 2 loads of B, kMicroM broadcasts of A.
template <class S>
__attribute__((always_inline)) inline void tile_kernel(int64_t mb, int64_t nb, int64_t kb, const S* A, int64_t a_row,
                                                       int64_t a_col, const S* __restrict B, int64_t ldb,
                                                       S* __restrict C, int64_t ldc) {
  using V = typename Vec<S>::V;
  using U = typename Vec<S>::U;
  constexpr int64_t kLanes = 32 / sizeof(S), kCols = 2 * kLanes;
  int64_t i = 0;
  for (; i + kMicroM <= mb; i += kMicroM) {
    int64_t j = 0;
    for (; j + kCols <= nb; j += kCols) {
      V acc0[kMicroM], acc1[kMicroM];
      for (int r = 0; r < kMicroM; ++r) {
        acc0[r] = *reinterpret_cast<const U*>(C + (i + r) * ldc + j);
        acc1[r] = *reinterpret_cast<const U*>(C + (i + r) * ldc + j + kLanes);
      }
      const S* a = A + i * a_row;
      for (int64_t k = 0; k < kb; ++k) {
        const V b0 = *reinterpret_cast<const U*>(B + k * ldb + j);
        const V b1 = *reinterpret_cast<const U*>(B + k * ldb + j + kLanes);
        for (int r = 0; r < kMicroM; ++r) {
          const S av = a[r * a_row + k * a_col];
          acc0[r] += av * b0;
          acc1[r] += av * b1;
        }
      }
      for (int r = 0; r < kMicroM; ++r) {
        *reinterpret_cast<U*>(C + (i + r) * ldc + j) = acc0[r];
        *reinterpret_cast<U*>(C + (i + r) * ldc + j + kLanes) = acc1[r];
      }
    }
    for (; j < nb; ++j)  // column tail
      for (int r = 0; r < kMicroM; ++r) {
        S acc = C[(i + r) * ldc + j];
        for (int64_t k = 0; k < kb; ++k) acc += A[(i + r) * a_row + k * a_col] * B[k * ldb + j];
        C[(i + r) * ldc + j] = acc;
      }
  }
  for (; i < mb; ++i) {  // row tail: axpy form, vectorises over j
    S* c = C + i * ldc;
    for (int64_t k = 0; k < kb; ++k) {
      const S a = A[i * a_row + k * a_col];
      const S* b = B + k * ldb;
      for (int64_t j = 0; j < nb; ++j) c[j] += a * b[j];
    }
  }
}

NOPAD_MULTIVERSION void tile_f32(int64_t mb, int64_t nb, int64_t kb, const float* A, int64_t a_row, int64_t a_col,
                                 const float* B, int64_t ldb, float* C, int64_t ldc) {
  tile_kernel<float>(mb, nb, kb, A, a_row, a_col, B, ldb, C, ldc);
}
NOPAD_MULTIVERSION void tile_f64(int64_t mb, int64_t nb, int64_t kb, const double* A, int64_t a_row, int64_t a_col,
                                 const double* B, int64_t ldb, double* C, int64_t ldc) {
  tile_kernel<double>(mb, nb, kb, A, a_row, a_col, B, ldb, C, ldc);
}
inline void tile(int64_t mb, int64_t nb, int64_t kb, const float* A, int64_t a_row, int64_t a_col, const float* B,
                 int64_t ldb, float* C, int64_t ldc) {
  tile_f32(mb, nb, kb, A, a_row, a_col, B, ldb, C, ldc);
}
inline void tile(int64_t mb, int64_t nb, int64_t kb, const double* A, int64_t a_row, int64_t a_col, const double* B,
                 int64_t ldb, double* C, int64_t ldc) {
  tile_f64(mb, nb, kb, A, a_row, a_col, B, ldb, C, ldc);
}

template <class S>
__attribute__((always_inline)) inline S dot_kernel(const S* a, const S* b, int64_t n) {
  S acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  S sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}
NOPAD_MULTIVERSION float dot_f32(const float* a, const float* b, int64_t n) { return dot_kernel(a, b, n); }
NOPAD_MULTIVERSION double dot_f64(const double* a, const double* b, int64_t n) { return dot_kernel(a, b, n); }

}  // namespace

template <class S>
void gemm(int64_t M, int64_t N, int64_t K, const S* A, int64_t a_row, int64_t a_col, const S* B, int64_t ldb, S* C,
          int64_t ldc, bool accumulate, int threads) {
  if (M <= 0 || N <= 0) return;
  const int64_t tiles_m = (M + kTileM - 1) / kTileM, tiles_n = (N + kTileN - 1) / kTileN;
  parallel_for(static_cast<size_t>(tiles_m * tiles_n), threads, [&](size_t t) {
    const int64_t i0 = static_cast<int64_t>(t) / tiles_n * kTileM, j0 = static_cast<int64_t>(t) % tiles_n * kTileN;
    const int64_t mb = std::min(kTileM, M - i0), nb = std::min(kTileN, N - j0);
    if (!accumulate)
      for (int64_t i = 0; i < mb; ++i) std::fill_n(C + (i0 + i) * ldc + j0, nb, S(0));
    for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
      const int64_t kb = std::min(kTileK, K - k0);
      tile(mb, nb, kb, A + i0 * a_row + k0 * a_col, a_row, a_col, B + k0 * ldb + j0, ldb, C + i0 * ldc + j0, ldc);
    }
  });
}

template <class S>
void transpose(const S* src, int64_t rows, int64_t cols, S* dst, int threads) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  parallel_for(static_cast<size_t>(blocks), threads, [&](size_t blk) {
    const int64_t r0 = static_cast<int64_t>(blk) * kBlock, r1 = std::min(rows, r0 + kBlock);
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
    }
  });
}

template <>
float dot<float>(const float* a, const float* b, int64_t n) {
  return dot_f32(a, b, n);
}
template <>
double dot<double>(const double* a, const double* b, int64_t n) {
  return dot_f64(a, b, n);
}

template void gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                          int64_t, bool, int);
template void gemm<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t, const double*, int64_t,
                           double*, int64_t, bool, int);
template void transpose<float>(const float*, int64_t, int64_t, float*, int);
template void transpose<double>(const double*, int64_t, int64_t, double*, int);

}  // namespace nopad::ops::cpu
