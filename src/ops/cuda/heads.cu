// Kernels of the MLM and NSP heads (CPU twins: mlm_head_loss_* and nsp_head_loss_* in ops/cpu/cpu_backend.cpp):
// row gather, scatter and scatter-add, the row-wise softmax cross-entropy (forward writes probabilities in place of the
// logits and adds the loss / correct count into one scalar each), its gradient, and tanh forward/backward.
// The softmax CE and its gradient have two implementations each (KernelVariants in dense.h): the first ones (three
// passes over a row / a flat scalar grid) and the row-in-registers / block-per-row ones.
// Every kernel is a template over the 16-bit element type T (bf16 or fp16) of the rows it reads and writes; the
// arithmetic is fp32. With fp16, probabilities below 2^-14 are stored as subnormals (absolute precision 2^-24, far
// below what their share of a gradient needs), and a d_logits value beyond +-65504 (a loss scale too large for the
// batch) becomes +-inf, which is how an overflowing loss-scaled step shows itself (its gradient norm is not finite).
#include <cfloat>
#include <climits>

#include "ops/cuda/check.h"
#include "ops/cuda/kernels.cuh"

namespace nopad::cuda {
namespace {

constexpr int kThreads = 256;

// dst[i] = src[index[i]] for rows of H (H % 8 == 0): one block per row, 16-byte vectors.
template <class T>
__global__ void gather_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ index, int32_t H,
                                   T* __restrict__ dst) {
  const int64_t i = blockIdx.x;
  const T* s = src + int64_t{index[i]} * H;
  T* d = dst + i * H;
  for (int j = threadIdx.x * 8; j < H; j += blockDim.x * 8)
    st16(d + j, ld16(s + j));
}

// dst[index[i]] += src[i] (fp32 add, one rounding), or = src[i] without kAccumulate. Rows of index must be distinct
// (each is one block).
template <class T, bool kAccumulate>
__global__ void scatter_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ index, int32_t H,
                                    T* __restrict__ dst) {
  const int64_t i = blockIdx.x;
  const T* s = src + i * H;
  T* d = dst + int64_t{index[i]} * H;
  for (int j = threadIdx.x * 8; j < H; j += blockDim.x * 8) {
    if constexpr (kAccumulate) {
      float a[8], b[8];
      load8(d + j, a);
      load8(s + j, b);
#pragma unroll
      for (int e = 0; e < 8; ++e) a[e] += b[e];
      store8(d + j, a);
    } else {
      st16(d + j, ld16(s + j));
    }
  }
}

// One block per row of V logits: max/argmax (first index on ties, as the twin's strict '>'), log-sum-exp, then
// probabilities in place. The row's loss and hit are added with one atomic each after the block reductions (the
// float sum's order over rows is not fixed: loss_sum may differ in the last bits between runs).
template <class T, int kBlock>
__global__ void __launch_bounds__(kBlock) softmax_ce_kernel(T* __restrict__ logits, const int32_t* __restrict__ labels,
                                                            int32_t V, int64_t ld, float* loss_sum,
                                                            int32_t* num_correct) {
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  __shared__ float red_s[32];
  T* l = logits + static_cast<int64_t>(blockIdx.x) * ld;
  const int label = labels[blockIdx.x];
  const float label_logit = to_f32(l[label]);  // read before the row is overwritten

  float mx = -FLT_MAX;  // -inf would make exp(-inf - -inf) = NaN for an all -inf row; logits are finite here
  int am = INT_MAX;
  for (int v = threadIdx.x; v < V; v += kBlock) {
    const float x = to_f32(l[v]);
    if (x > mx) {  // v increases within a thread: keeps the first maximum
      mx = x;
      am = v;
    }
  }
  // (value, index) reduction: larger value wins, equal values keep the smaller index.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, mx, o);
    const int oi = __shfl_xor_sync(0xffffffffu, am, o);
    if (ov > mx || (ov == mx && oi < am)) {
      mx = ov;
      am = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    red_v[warp] = mx;
    red_i[warp] = am;
  }
  __syncthreads();
  if (warp == 0) {
    mx = lane < kBlock / 32 ? red_v[lane] : -FLT_MAX;
    am = lane < kBlock / 32 ? red_i[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, mx, o);
      const int oi = __shfl_xor_sync(0xffffffffu, am, o);
      if (ov > mx || (ov == mx && oi < am)) {
        mx = ov;
        am = oi;
      }
    }
    if (lane == 0) {
      red_v[0] = mx;
      red_i[0] = am;
    }
  }
  __syncthreads();
  mx = red_v[0];
  am = red_i[0];

  float sum = 0.0f;
  for (int v = threadIdx.x; v < V; v += kBlock) sum += expf(to_f32(l[v]) - mx);
  sum = block_sum(sum, red_s);
  const float lse = mx + logf(sum);
  for (int v = threadIdx.x; v < V; v += kBlock) l[v] = from_f32<T>(expf(to_f32(l[v]) - lse));
  if (threadIdx.x == 0) {
    atomicAdd(loss_sum, lse - label_logit);
    atomicAdd(num_correct, am == label ? 1 : 0);
  }
}

// One-read variant (KernelVariants::softmax_ce_registers): the row is read once into registers as 16-bit pairs (V even,
// V <= 2 * kCeBlock * kCePairs), then max/argmax, the sum of exponentials and the probabilities all come from those
// registers: one HBM read and one write of the logits instead of three reads (the first-index tie rule and the
// arithmetic are those of softmax_ce_kernel; only the order of the exp sum differs). Two 512-thread blocks per SM
// keep two rows' loads in flight; 30 pairs per thread (V <= 30720, BERT's 30522) is what fits 64 registers without
// spilling.
constexpr int kCeBlock = 512, kCePairs = 30;
template <class T>
__global__ void __launch_bounds__(kCeBlock, 2) softmax_ce_regs_kernel(T* __restrict__ logits,
                                                                     const int32_t* __restrict__ labels, int32_t V,
                                                                     int64_t ld, float* loss_sum,
                                                                     int32_t* num_correct) {
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  __shared__ float red_s[32];
  __shared__ float label_logit;  // read before the row is overwritten (shared: no register held through the kernel)
  pair16_t<T>* row = reinterpret_cast<pair16_t<T>*>(logits + static_cast<int64_t>(blockIdx.x) * ld);
  const int32_t pairs = V / 2;
  const int label = labels[blockIdx.x];
  if (threadIdx.x == 0) label_logit = to_f32(logits[static_cast<int64_t>(blockIdx.x) * ld + label]);
  pair16_t<T> x[kCePairs];
#pragma unroll
  for (int i = 0; i < kCePairs; ++i) {
    const int p = threadIdx.x + i * kCeBlock;
    if (p < pairs) x[i] = row[p];
  }
  float mx = -FLT_MAX;
  int am = INT_MAX;
#pragma unroll
  for (int i = 0; i < kCePairs; ++i) {  // indices increase with i, and .x before .y: keeps the first maximum
    const int p = threadIdx.x + i * kCeBlock;
    if (p >= pairs) continue;
    const float2 f = to_f32x2(x[i]);
    if (f.x > mx) {
      mx = f.x;
      am = 2 * p;
    }
    if (f.y > mx) {
      mx = f.y;
      am = 2 * p + 1;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, mx, o);
    const int oi = __shfl_xor_sync(0xffffffffu, am, o);
    if (ov > mx || (ov == mx && oi < am)) {
      mx = ov;
      am = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    red_v[warp] = mx;
    red_i[warp] = am;
  }
  __syncthreads();
  if (warp == 0) {
    mx = lane < kCeBlock / 32 ? red_v[lane] : -FLT_MAX;
    am = lane < kCeBlock / 32 ? red_i[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, mx, o);
      const int oi = __shfl_xor_sync(0xffffffffu, am, o);
      if (ov > mx || (ov == mx && oi < am)) {
        mx = ov;
        am = oi;
      }
    }
    if (lane == 0) {
      red_v[0] = mx;
      red_i[0] = am;
    }
  }
  __syncthreads();
  mx = red_v[0];
  am = red_i[0];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kCePairs; ++i) {
    const int p = threadIdx.x + i * kCeBlock;
    if (p >= pairs) continue;
    const float2 f = to_f32x2(x[i]);
    sum += expf(f.x - mx) + expf(f.y - mx);
  }
  sum = block_sum(sum, red_s);
  const float lse = mx + logf(sum);
#pragma unroll
  for (int i = 0; i < kCePairs; ++i) {
    const int p = threadIdx.x + i * kCeBlock;
    if (p >= pairs) continue;
    const float2 f = to_f32x2(x[i]);
    row[p] = from_f32x2<T>(expf(f.x - lse), expf(f.y - lse));
  }
  if (threadIdx.x == 0) {
    atomicAdd(loss_sum, lse - label_logit);
    atomicAdd(num_correct, am == label ? 1 : 0);
  }
}

// d_logits = scale * (probs - onehot(label)), in place: a block per row, 16-bit pairs (V even, 4-byte aligned rows),
// several pairs' loads in flight per thread; same arithmetic as ce_backward_kernel.
constexpr int kCeBwdThreads = 256, kCeBwdUnroll = 4;
template <class T>
__global__ void __launch_bounds__(kCeBwdThreads) ce_backward_rows_kernel(T* __restrict__ probs,
                                                                        const int32_t* __restrict__ labels, int32_t V,
                                                                        int64_t ld, float scale) {
  pair16_t<T>* row = reinterpret_cast<pair16_t<T>*>(probs + static_cast<int64_t>(blockIdx.x) * ld);
  const int32_t pairs = V / 2;
  const int label = labels[blockIdx.x];
  for (int p0 = threadIdx.x; p0 < pairs; p0 += kCeBwdThreads * kCeBwdUnroll) {
    pair16_t<T> x[kCeBwdUnroll];
#pragma unroll
    for (int u = 0; u < kCeBwdUnroll; ++u)
      if (p0 + u * kCeBwdThreads < pairs) x[u] = row[p0 + u * kCeBwdThreads];
#pragma unroll
    for (int u = 0; u < kCeBwdUnroll; ++u) {
      const int p = p0 + u * kCeBwdThreads;
      if (p >= pairs) continue;
      const float2 f = to_f32x2(x[u]);
      float d0 = f.x * scale, d1 = f.y * scale;
      if (2 * p == label) d0 -= scale;
      if (2 * p + 1 == label) d1 -= scale;
      row[p] = from_f32x2<T>(d0, d1);
    }
  }
}

// d_logits = scale * (probs - onehot(label)), in place.
template <class T>
__global__ void ce_backward_kernel(T* __restrict__ probs, const int32_t* __restrict__ labels, int32_t rows,
                                   int32_t V, int64_t ld, float scale) {
  const int64_t count = static_cast<int64_t>(rows) * V;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / V;
    const int32_t v = static_cast<int32_t>(e - r * V);
    T* p = probs + r * ld + v;
    float d = to_f32(*p) * scale;
    if (v == labels[r]) d -= scale;
    *p = from_f32<T>(d);
  }
}

template <class T>
__global__ void tanh_forward_kernel(T* x, int64_t count) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[e] = from_f32<T>(tanhf(to_f32(x[e])));
}

// d *= 1 - y^2 (y = tanh output), in place.
template <class T>
__global__ void tanh_backward_kernel(T* d, const T* __restrict__ y, int64_t count) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float t = to_f32(y[e]);
    d[e] = from_f32<T>(to_f32(d[e]) * (1.0f - t * t));
  }
}

int flat_blocks(int64_t count) {
  const int64_t b = (count + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

bool aligned4(const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; }

void check_rows_h(int32_t H) { NOPAD_CHECK(H > 0 && H % 8 == 0, "CUDA head kernels need hidden % 8 == 0, got ", H); }

}  // namespace

template <class T>
void launch_gather_rows(const T* src, const int32_t* index, int32_t count, int32_t H, T* dst, cudaStream_t stream) {
  check_rows_h(H);
  if (count <= 0) return;
  gather_rows_kernel<T><<<count, 128, 0, stream>>>(src, index, H, dst);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_scatter_rows(const T* src, const int32_t* index, int32_t count, int32_t H, T* dst, bool accumulate,
                         cudaStream_t stream) {
  check_rows_h(H);
  if (count <= 0) return;
  if (accumulate) {
    scatter_rows_kernel<T, true><<<count, 128, 0, stream>>>(src, index, H, dst);
  } else {
    scatter_rows_kernel<T, false><<<count, 128, 0, stream>>>(src, index, H, dst);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_softmax_ce_forward(T* logits, const int32_t* labels, int32_t rows, int32_t V, int64_t ld,
                               float* loss_sum, int32_t* num_correct, bool registers, cudaStream_t stream) {
  if (rows <= 0) return;
  NOPAD_CHECK(V > 0, "softmax cross-entropy over an empty vocabulary");
  NOPAD_CHECK(ld >= V, "softmax cross-entropy: row stride ", ld, " below the vocabulary ", V);
  if (registers && V >= 4096 && V % 2 == 0 && ld % 2 == 0 && V <= 2 * kCeBlock * kCePairs && aligned4(logits)) {
    softmax_ce_regs_kernel<T><<<rows, kCeBlock, 0, stream>>>(logits, labels, V, ld, loss_sum, num_correct);
  } else if (V >= 4096) {
    softmax_ce_kernel<T, 1024><<<rows, 1024, 0, stream>>>(logits, labels, V, ld, loss_sum, num_correct);
  } else {
    softmax_ce_kernel<T, 64><<<rows, 64, 0, stream>>>(logits, labels, V, ld, loss_sum, num_correct);
  }
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_ce_backward(T* probs, const int32_t* labels, int32_t rows, int32_t V, int64_t ld, float scale,
                        bool rows_kernel, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(rows) * V;
  if (count <= 0) return;
  NOPAD_CHECK(ld >= V, "cross-entropy backward: row stride ", ld, " below the vocabulary ", V);
  if (rows_kernel && V >= 1024 && V % 2 == 0 && ld % 2 == 0 && aligned4(probs)) {
    ce_backward_rows_kernel<T><<<rows, kCeBwdThreads, 0, stream>>>(probs, labels, V, ld, scale);
    NOPAD_CUDA_CHECK_LAUNCH();
    return;
  }
  ce_backward_kernel<T><<<flat_blocks(count), kThreads, 0, stream>>>(probs, labels, rows, V, ld, scale);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_tanh_forward(T* x, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  tanh_forward_kernel<T><<<flat_blocks(count), kThreads, 0, stream>>>(x, count);
  NOPAD_CUDA_CHECK_LAUNCH();
}

template <class T>
void launch_tanh_backward(T* d, const T* y, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  tanh_backward_kernel<T><<<flat_blocks(count), kThreads, 0, stream>>>(d, y, count);
  NOPAD_CUDA_CHECK_LAUNCH();
}

// The launchers of both element types.
#define NOPAD_HEADS_INSTANTIATE(T)                                                                                \
  template void launch_gather_rows<T>(const T*, const int32_t*, int32_t, int32_t, T*, cudaStream_t);              \
  template void launch_scatter_rows<T>(const T*, const int32_t*, int32_t, int32_t, T*, bool, cudaStream_t);     \
  template void launch_softmax_ce_forward<T>(T*, const int32_t*, int32_t, int32_t, int64_t, float*, int32_t*,      \
                                             bool, cudaStream_t);                                                 \
  template void launch_ce_backward<T>(T*, const int32_t*, int32_t, int32_t, int64_t, float, bool, cudaStream_t);  \
  template void launch_tanh_forward<T>(T*, int64_t, cudaStream_t);                                                \
  template void launch_tanh_backward<T>(T*, const T*, int64_t, cudaStream_t);
NOPAD_HEADS_INSTANTIATE(bf)
NOPAD_HEADS_INSTANTIATE(hf)
#undef NOPAD_HEADS_INSTANTIATE

}  // namespace nopad::cuda
