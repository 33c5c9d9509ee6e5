// Plain blocked GEMM for the CPU reference backend: C[M, N] (+)= A[M, K] B[K, N].
// A is addressed with two strides (element (i, k) at A[i * a_row + k * a_col]) so both A and A^T can be read without
// copying; B and C are row-major with leading dimensions ldb, ldc. Deterministic: every C element is summed over k in
// the same order whatever the thread count (tiles partition C; k is walked in order inside a tile).
#pragma once
#include <cstdint>

namespace nopad::ops::cpu {

template <class S>
void gemm(int64_t M, int64_t N, int64_t K, const S* A, int64_t a_row, int64_t a_col, const S* B, int64_t ldb, S* C,
          int64_t ldc, bool accumulate, int threads);

// dst[cols, rows] = src[rows, cols]^T.
template <class S>
void transpose(const S* src, int64_t rows, int64_t cols, S* dst, int threads);

// Dot product with 8 independent partial sums (vectorisable without reassociation flags).
template <class S>
S dot(const S* a, const S* b, int64_t n);

}  // namespace nopad::ops::cpu
