// Device helpers shared by the CUDA backend's kernels (layernorm.cu, dense.cu, heads.cu): 16-bit <-> fp32 vectors of 8
// (one 16-byte load/store) for both element types the backend runs (bf16 and fp16), warp and block reductions,
// exact-erf GELU, the dropout keep-scale drawn from core/philox.h exactly as the CPU twin draws it, and the row ->
// sequence lookup. The kernels are templates over the 16-bit element type T (__nv_bfloat16 or __half): arithmetic is
// fp32 in both, only the loads, the stores and the rounding of results (round to nearest even) depend on T.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/philox.h"
#include "ops/cuda/dense.h"  // KernelVariants, LnVariant

namespace nopad::cuda {

using bf = __nv_bfloat16;
using hf = __half;

// The device type of a host 16-bit storage type (core/dtype.h: layout-identical, so pointers are reinterpreted).
template <class Host>
struct DeviceType;
template <>
struct DeviceType<nopad::bf16> {
  using type = bf;
};
template <>
struct DeviceType<nopad::f16> {
  using type = hf;
};
template <class Host>
using device_t = typename DeviceType<Host>::type;

// Two values of T in 4 bytes, and the fp32 conversions (round to nearest even; fp16 overflows to +-inf past 65504).
template <class T>
struct Pair16;
template <>
struct Pair16<bf> {
  using type = __nv_bfloat162;
};
template <>
struct Pair16<hf> {
  using type = __half2;
};
template <class T>
using pair16_t = typename Pair16<T>::type;

__device__ __forceinline__ float to_f32(bf x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(hf x) { return __half2float(x); }
__device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_f32x2(__half2 x) { return __half22float2(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ bf from_f32<bf>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ hf from_f32<hf>(float x) {
  return __float2half_rn(x);
}
template <class T>
__device__ __forceinline__ pair16_t<T> from_f32x2(float a, float b);
template <>
__device__ __forceinline__ __nv_bfloat162 from_f32x2<bf>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ __half2 from_f32x2<hf>(float a, float b) {
  return __floats2half2_rn(a, b);
}

// 8 values of T = 16 bytes: the unit of every vectorised load/store here (callers guarantee 16-byte alignment: H % 8
// == 0 and 256-byte aligned base pointers from cudaMalloc). Memory is accessed only through ld16/st16, which move a
// uint4: one 128-bit instruction. (Copying a Vec8 straight from memory compiles to four 32-bit accesses, one per
// member, so a warp would touch every sector four times.)
template <class T>
struct alignas(16) Vec8 {
  pair16_t<T> h[4];
};
template <class T>
__device__ __forceinline__ Vec8<T> ld16(const T* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  Vec8<T> x;
  memcpy(&x, &u, sizeof x);  // a register move
  return x;
}
template <class T>
__device__ __forceinline__ void st16(T* p, const Vec8<T>& x) {
  uint4 u;
  memcpy(&u, &x, sizeof u);
  *reinterpret_cast<uint4*>(p) = u;
}

template <class T>
__device__ __forceinline__ void unpack8(const Vec8<T>& x, float v[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_f32x2(x.h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <class T>
__device__ __forceinline__ Vec8<T> pack8(const float v[8]) {
  Vec8<T> x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.h[i] = from_f32x2<T>(v[2 * i], v[2 * i + 1]);
  return x;
}
template <class T>
__device__ __forceinline__ void load8(const T* p, float v[8]) {
  unpack8(ld16(p), v);
}
template <class T>
__device__ __forceinline__ void store8(T* p, const float v[8]) {
  st16(p, pack8<T>(v));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. `smem` holds 32
// floats; the function ends with a barrier, so it may be called again with the same smem.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? smem[lane] : 0.0f;
  r = warp_sum(r);
  __syncthreads();
  return r;
}

// gelu(x), and gelu'(x) into grad, sharing the erf (tanh) evaluation, as the CPU twin computes them (ops/cpu/
// cpu_gelu.h): the exact-erf GELU (BERT's "gelu") or the tanh approximation (Hugging Face "gelu_new", accurate tanhf).
template <bool kTanh>
__device__ __forceinline__ float gelu_and_grad_fn(float x, float& grad) {
  if constexpr (kTanh) {
    const float c = 0.79788456080286535588f;
    const float th = tanhf(c * (x + 0.044715f * x * x * x));
    grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * c * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * x * (1.0f + th);
  } else {
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143267794f;
    grad = cdf + x * pdf;
    return x * cdf;
  }
}

// Dropout of one call (core/philox.h's 16-bit contract): the mixed stream key and p. The threshold ceil(p * 65536) and
// the keep-scale 65536 / (65536 - threshold) are derived from p on the device (dropout_threshold, dropout_keep_scale:
// exact, and the same float the CPU twin uses); they depend only on kernel parameters, so the compiler computes them
// once per thread. `inv_keep` is no longer read (the scale follows from p); it stays until the host code that fills
// it (cuda_backend.cu's dropout_args) drops it. Callers validate p with dropout_p_supported.
struct DropoutArgs {
  uint64_t stream_key = 0;
  float p = 0.0f;
  float inv_keep = 1.0f;  // unused, see above
};
// keep-scale when kept, 0 when dropped, 1 without dropout (the twin's DropoutMask::scale).
__device__ __forceinline__ float dropout_scale(const DropoutArgs& d, uint64_t sample_id, uint64_t element) {
  const uint32_t threshold = dropout_threshold(d.p);
  if (threshold == 0) return 1.0f;
  return dropout_bits16(d.stream_key, sample_id, element, kPhiloxRounds) >= threshold ? dropout_keep_scale(threshold)
                                                                                       : 0.0f;
}
// Eight consecutive features j0..j0+7 of one row, j0 % 8 == 0: exactly one Philox block (element_hidden(pos, j0) >> 3
// covers features j0..j0+7), feature j0 + i taking 16-bit field i. Same values as dropout_scale per element.
// The same with the threshold (> 0) and keep-scale already computed (dropout_threshold, dropout_keep_scale): kernels
// that draw once per row in a loop take them out of it.
__device__ __forceinline__ void dropout_scale8(uint64_t stream_key, uint32_t threshold, float scale,
                                               uint64_t sample_id, uint32_t pos, uint32_t j0, float s[8]) {
  const Philox4x32 r =
      dropout_philox(stream_key, sample_id, dropout_block_index(element_hidden(pos, j0)), kPhiloxRounds);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    s[2 * w] = (r.v[w] & 0xFFFFu) >= threshold ? scale : 0.0f;  // low half: feature j0 + 2w
    s[2 * w + 1] = (r.v[w] >> 16) >= threshold ? scale : 0.0f;  // high half: feature j0 + 2w + 1
  }
}
__device__ __forceinline__ void dropout_scale8(const DropoutArgs& d, uint64_t sample_id, uint32_t pos, uint32_t j0,
                                               float s[8]) {
  const uint32_t threshold = dropout_threshold(d.p);
  if (threshold == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 1.0f;
    return;
  }
  dropout_scale8(d.stream_key, threshold, dropout_keep_scale(threshold), sample_id, pos, j0, s);
}

// Sequence b holding row t: the last b with cu_seqlens[b] <= t (binary search over B+1 entries; B is small).
__device__ __forceinline__ int32_t row_to_seq(const int32_t* cu_seqlens, int32_t num_seqs, int64_t t) {
  int32_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (cu_seqlens[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// ------------------------------------------------------------------------------------------------ host launchers
// All enqueue on `stream`, check the launch, and never synchronise. The templates over the element type T are
// instantiated for bf (bf16) and hf (fp16) in their .cu files.

// layernorm.cu: the row-wise LayerNorm family. kPlain: LN(x). kEmbed: LN(word[tok] + position[pos] +
// token_type[seg]) then dropout. kResidual: LN(dropout(x + bias) + residual). Requires H % 8 == 0, H <= 1024.
enum class LnKind { kPlain, kEmbed, kResidual };
template <class T>
struct LnArgs {
  int64_t rows = 0;
  int32_t H = 0;
  float eps = 0.0f;
  const T* gamma = nullptr;
  const T* beta = nullptr;
  const T* x = nullptr;  // kPlain, kResidual
  const T* bias = nullptr;
  const T* residual = nullptr;
  const int32_t* tokens = nullptr;  // kEmbed
  const int32_t* positions = nullptr;
  const int32_t* segments = nullptr;
  const T* word = nullptr;
  const T* position = nullptr;
  const T* token_type = nullptr;
  const int32_t* cu_seqlens = nullptr;  // dropout keys (kEmbed, kResidual with p > 0)
  const uint64_t* sample_ids = nullptr;
  const int32_t* row_pos = nullptr;  // kResidual: each row's position in its sequence (null: row - cu_seqlens[b])
  int32_t num_seqs = 0;
  DropoutArgs drop;
  T* out = nullptr;  // forward
  float* mean_out = nullptr;
  float* rstd_out = nullptr;
  const T* d_out = nullptr;  // backward
  const float* mean = nullptr;
  const float* rstd = nullptr;
  T* dz = nullptr;   // gradient at the LN input (kPlain: d_x; kResidual: d_residual)
  T* d_x = nullptr;  // kResidual: dz * mask
  float* d_word = nullptr;  // kEmbed scatter targets (+=, atomics)
  float* d_position = nullptr;
  float* d_token_type = nullptr;
  float* partial = nullptr;  // [blocks][nacc][H]: d_gamma | d_beta (| d_bias, kResidual) sums of each block
};
// `v` picks the implementation (dense.h, KernelVariants); sm_count sizes the row-group grid.
template <class T>
void launch_ln_forward(LnKind kind, const LnArgs<T>& a, const LnVariant& v, int sm_count, cudaStream_t stream);
// Blocks of the backward grid (a pure function of its arguments and the device: the reduction order is fixed); the
// caller sizes partial as [blocks][nacc][H] and passes the same kind, H, rows and v to launch_ln_backward<T>.
template <class T>
int ln_backward_blocks(LnKind kind, int32_t H, int64_t rows, const LnVariant& v, int sm_count);
template <class T>
void launch_ln_backward(LnKind kind, const LnArgs<T>& a, const LnVariant& v, int blocks, cudaStream_t stream);
// out_q[j] += sum over b of partial[b][q][j] for q < nacc (fixed order; null outputs skipped). partial is [blocks][nacc][H].
void launch_column_finish(const float* partial, int blocks, int H, int nacc, float* out0, float* out1, float* out2,
                          cudaStream_t stream);

// dense.cu: elementwise GELU and column sums (the d_bias reduction, first stage). tanh: the tanh approximation
// (ops::Activation::kGeluTanh), else the exact erf GELU.
// y = gelu(pre) and pre_grad = gelu'(pre) in place (pre_grad holds pre on entry); wide: 4 vectors in flight per
// thread (KernelVariants::gelu_forward_wide), else the first kernel.
template <class T>
void launch_gelu_forward(T* pre_grad, T* y, int64_t count, bool wide, bool tanh, cudaStream_t stream);
// out = dy * scale elementwise (the backward through a saved activation derivative).
template <class T>
void launch_scale(const T* dy, const T* scale, T* out, int64_t count, cudaStream_t stream);
int column_sum_chunks(int64_t rows);
// partial[c][j] = sum of m[r][j] over the rows r of chunk c (m is [rows, n], rows ld >= n elements apart).
template <class T>
void launch_column_sum_partial(const T* m, int64_t rows, int32_t n, int64_t ld, int chunks, float* partial,
                               cudaStream_t stream);
// The one-pass kernel over dy [rows, n]: with scale (and dpre) it writes dpre = dy * scale (scale: the saved
// activation derivative); with partial it writes partial[c][j] = sum over the rows of chunk c of dpre (or dy) [r][j],
// c < dense_grad_chunks(rows). Needs dense_grad_pass_supported (n % 8 == 0, 16-byte aligned pointers).
bool dense_grad_pass_supported(int32_t n, const void* dy, const void* scale, const void* dpre);
int dense_grad_chunks(int64_t rows);
template <class T>
void launch_dense_grad_pass(const T* dy, const T* scale, T* dpre, int64_t rows, int32_t n, float* partial,
                            cudaStream_t stream);

// heads.cu
template <class T>
void launch_gather_rows(const T* src, const int32_t* index, int32_t count, int32_t H, T* dst, cudaStream_t stream);
// dst[index[i]] (+)= src[i] for distinct rows index[i]; accumulate adds in fp32 and rounds once.
template <class T>
void launch_scatter_rows(const T* src, const int32_t* index, int32_t count, int32_t H, T* dst, bool accumulate,
                         cudaStream_t stream);
// registers / rows_kernel: KernelVariants::softmax_ce_registers / ce_backward_rows (used where V allows, else the
// first kernels). Rows of V logits lie ld >= V elements apart; columns V .. ld-1 are neither read nor written.
template <class T>
void launch_softmax_ce_forward(T* logits, const int32_t* labels, int32_t rows, int32_t V, int64_t ld,
                               float* loss_sum, int32_t* num_correct, bool registers, cudaStream_t stream);
template <class T>
void launch_ce_backward(T* probs, const int32_t* labels, int32_t rows, int32_t V, int64_t ld, float scale,
                        bool rows_kernel, cudaStream_t stream);
template <class T>
void launch_tanh_forward(T* x, int64_t count, cudaStream_t stream);
template <class T>
void launch_tanh_backward(T* d, const T* y, int64_t count, cudaStream_t stream);

}  // namespace nopad::cuda
