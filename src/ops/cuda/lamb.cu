// FusedLamb kernels and host side (contract in lamb.h). One step is four launches:
//   1. grad_sumsq:  one block per chunk, partial_g[c] = sum g^2 over the chunk
//   2. finalize:    one block sums partial_g in a fixed order; norm, skip flag, clip multiplier, step count, c1, c2
//   3. moments:     one block per chunk; m, v updated in place; partial_w[c] = sum w^2, partial_u[c] = sum u^2
//   4. apply:       one block per chunk; each block sums its tensor's partials (same order in every block, so all
//                   blocks of a tensor get the same ratio), recomputes u from the new m, v and the old w exactly as
//                   pass 3 did, w -= lr * ratio * u, and writes the 16-bit copy (bf16 or fp16: a template)
// Element-wise arithmetic uses the _rn intrinsics so that nvcc does not contract into FMAs: the CPU twin computes
// each product and sum rounded separately, and matching it bit for bit keeps m and v identical to the CPU's.
#include "ops/cuda/lamb.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "ops/cuda/check.h"

namespace nopad::cuda {

struct FusedLamb::DeviceState {
  double grad_norm;  // ||grad_scale * g||
  float g_mul;       // grad_scale, times the clip factor when clipping
  float c1, c2;      // bias corrections of the current step (1 without bias correction)
  int32_t skipped;   // 1: the last step changed nothing
  int32_t pad;
  int64_t step;      // completed steps
};

namespace {

constexpr int kThreads = 256;
constexpr int kFinalizeThreads = 1024;

struct Chunk {
  int64_t start;   // element offset in the flat range
  int32_t length;  // <= kChunk
  int32_t tensor;
};

struct TensorInfo {
  int32_t chunk_begin;
  int32_t chunk_count;
  float wd;           // 0 for no_weight_decay tensors
  int32_t use_ratio;  // trust ratio applies to this tensor
};

struct Hyper {
  float b1, one_minus_b1, b2, one_minus_b2, eps;
  double beta1, beta2, max_grad_norm;
  int32_t bias_correction;
};

// Sum over the block, fixed order (warp shuffles, then the warp sums in order); the result is valid in thread 0.
template <int kBlock>
__device__ float block_sum(float x) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "block size");
  __shared__ float warp_sums[kBlock / 32];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kBlock / 32; ++w) total += warp_sums[w];
  __syncthreads();  // warp_sums may be reused by a following call
  return total;
}

__global__ void __launch_bounds__(kThreads) grad_sumsq_kernel(const Chunk* __restrict__ chunks,
                                                              const float* __restrict__ g,
                                                              float* __restrict__ partial_g) {
  const Chunk c = chunks[blockIdx.x];
  const float* gp = g + c.start;
  float s = 0.0f;
  const int vec = c.start % 4 == 0 ? c.length / 4 : 0;  // 16-byte vectors (chunks of 4-aligned tensors), then a tail
  for (int i = threadIdx.x; i < vec; i += kThreads) {
    const float4 x = reinterpret_cast<const float4*>(gp)[i];
    s = __fadd_rn(s, __fmul_rn(x.x, x.x));
    s = __fadd_rn(s, __fmul_rn(x.y, x.y));
    s = __fadd_rn(s, __fmul_rn(x.z, x.z));
    s = __fadd_rn(s, __fmul_rn(x.w, x.w));
  }
  for (int i = 4 * vec + threadIdx.x; i < c.length; i += kThreads) s = __fadd_rn(s, __fmul_rn(gp[i], gp[i]));
  s = block_sum<kThreads>(s);
  if (threadIdx.x == 0) partial_g[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const float* __restrict__ partial_g,
                                                                    int32_t num_chunks, float grad_scale, Hyper h,
                                                                    FusedLamb::DeviceState* __restrict__ st) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < num_chunks; i += kFinalizeThreads) s += partial_g[i];
  s = block_sum<kFinalizeThreads>(s);
  if (threadIdx.x != 0) return;
  const double norm = fabs(static_cast<double>(grad_scale)) * sqrt(static_cast<double>(s));
  st->grad_norm = norm;
  if (!isfinite(norm) || !isfinite(grad_scale)) {
    st->skipped = 1;  // moments/apply return early; the step count stays
    return;
  }
  st->skipped = 0;
  double g_mul = grad_scale;
  if (h.max_grad_norm > 0 && norm > h.max_grad_norm) g_mul = grad_scale / (norm / h.max_grad_norm);
  const int64_t t = st->step + 1;
  double c1 = 1, c2 = 1;
  if (h.bias_correction) {
    c1 = 1 - pow(h.beta1, static_cast<double>(t));
    c2 = 1 - pow(h.beta2, static_cast<double>(t));
  }
  st->g_mul = static_cast<float>(g_mul);
  st->c1 = static_cast<float>(c1);
  st->c2 = static_cast<float>(c2);
  st->step = t;
}

// u = (m / c1) / (sqrt(v / c2) + eps) + wd * w, rounded step by step as the CPU twin.
__device__ __forceinline__ float lamb_update(float m, float v, float w, float c1, float c2, float eps, float wd) {
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps);
  return __fadd_rn(__fdiv_rn(__fdiv_rn(m, c1), denom), __fmul_rn(wd, w));
}

__global__ void __launch_bounds__(kThreads) moments_kernel(const Chunk* __restrict__ chunks,
                                                           const TensorInfo* __restrict__ tensors,
                                                           const float* __restrict__ g, const float* __restrict__ w,
                                                           float* __restrict__ m, float* __restrict__ v, Hyper h,
                                                           const FusedLamb::DeviceState* __restrict__ st,
                                                           float* __restrict__ partial_w,
                                                           float* __restrict__ partial_u) {
  if (st->skipped) return;
  const Chunk c = chunks[blockIdx.x];
  const float wd = tensors[c.tensor].wd;
  const float g_mul = st->g_mul, c1 = st->c1, c2 = st->c2;
  float w_sq = 0.0f, u_sq = 0.0f;
  // One element: the twin's arithmetic; m and v updated in place, the sums of w^2 and u^2 accumulated.
  auto one = [&](float gr, float& mr, float& vr, float wj) {
    const float gj = __fmul_rn(gr, g_mul);
    mr = __fadd_rn(__fmul_rn(h.b1, mr), __fmul_rn(h.one_minus_b1, gj));
    vr = __fadd_rn(__fmul_rn(h.b2, vr), __fmul_rn(__fmul_rn(h.one_minus_b2, gj), gj));
    const float u = lamb_update(mr, vr, wj, c1, c2, h.eps, wd);
    w_sq = __fadd_rn(w_sq, __fmul_rn(wj, wj));
    u_sq = __fadd_rn(u_sq, __fmul_rn(u, u));
  };
  // 16-byte vectors where the chunk starts 4-aligned (every tensor of a BERT layout), then the tail element-wise.
  const int vec = c.start % 4 == 0 ? c.length / 4 : 0;
  for (int i = threadIdx.x; i < vec; i += kThreads) {
    const int64_t j = c.start + 4 * int64_t{i};
    const float4 g4 = *reinterpret_cast<const float4*>(g + j), w4 = *reinterpret_cast<const float4*>(w + j);
    float4 m4 = *reinterpret_cast<const float4*>(m + j), v4 = *reinterpret_cast<const float4*>(v + j);
    one(g4.x, m4.x, v4.x, w4.x);
    one(g4.y, m4.y, v4.y, w4.y);
    one(g4.z, m4.z, v4.z, w4.z);
    one(g4.w, m4.w, v4.w, w4.w);
    *reinterpret_cast<float4*>(m + j) = m4;
    *reinterpret_cast<float4*>(v + j) = v4;
  }
  for (int i = 4 * vec + threadIdx.x; i < c.length; i += kThreads) {
    const int64_t j = c.start + i;
    float mj = m[j], vj = v[j];
    one(g[j], mj, vj, w[j]);
    m[j] = mj;
    v[j] = vj;
  }
  w_sq = block_sum<kThreads>(w_sq);
  u_sq = block_sum<kThreads>(u_sq);
  if (threadIdx.x == 0) {
    partial_w[blockIdx.x] = w_sq;
    partial_u[blockIdx.x] = u_sq;
  }
}

// The 16-bit copy's rounding (to nearest even).
__device__ __forceinline__ void round_to(float x, __nv_bfloat16* out) { *out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void round_to(float x, __half* out) { *out = __float2half_rn(x); }

template <class T>
__global__ void __launch_bounds__(kThreads) apply_kernel(const Chunk* __restrict__ chunks,
                                                         const TensorInfo* __restrict__ tensors,
                                                         const float* __restrict__ partial_w,
                                                         const float* __restrict__ partial_u,
                                                         const float* __restrict__ m, const float* __restrict__ v,
                                                         float* __restrict__ w, T* __restrict__ w16,
                                                         float lr, Hyper h,
                                                         const FusedLamb::DeviceState* __restrict__ st) {
  if (st->skipped) return;
  __shared__ float ratio_s;
  const Chunk c = chunks[blockIdx.x];
  const TensorInfo t = tensors[c.tensor];
  if (t.use_ratio) {
    // Every block of the tensor runs this same fixed-order sum, so they all agree on the ratio.
    float ws = 0.0f, us = 0.0f;
    for (int i = threadIdx.x; i < t.chunk_count; i += kThreads) {
      ws += partial_w[t.chunk_begin + i];
      us += partial_u[t.chunk_begin + i];
    }
    ws = block_sum<kThreads>(ws);
    us = block_sum<kThreads>(us);
    if (threadIdx.x == 0) {
      const double w_norm = sqrt(static_cast<double>(ws)), u_norm = sqrt(static_cast<double>(us));
      ratio_s = (w_norm != 0 && u_norm != 0) ? static_cast<float>(w_norm / u_norm) : 1.0f;
    }
    __syncthreads();
  }
  const float ratio = t.use_ratio ? ratio_s : 1.0f;
  const float step = __fmul_rn(lr, ratio);
  const float c1 = st->c1, c2 = st->c2;
  auto updated = [&](float mj, float vj, float wj) {
    return __fsub_rn(wj, __fmul_rn(step, lamb_update(mj, vj, wj, c1, c2, h.eps, t.wd)));
  };
  // 16-byte vectors of m, v, w (8 bytes of the 16-bit copy) where the chunk starts 4-aligned, then the tail.
  const int vec = c.start % 4 == 0 ? c.length / 4 : 0;
  for (int i = threadIdx.x; i < vec; i += kThreads) {
    const int64_t j = c.start + 4 * int64_t{i};
    const float4 m4 = *reinterpret_cast<const float4*>(m + j), v4 = *reinterpret_cast<const float4*>(v + j);
    float4 w4 = *reinterpret_cast<const float4*>(w + j);
    w4.x = updated(m4.x, v4.x, w4.x);
    w4.y = updated(m4.y, v4.y, w4.y);
    w4.z = updated(m4.z, v4.z, w4.z);
    w4.w = updated(m4.w, v4.w, w4.w);
    *reinterpret_cast<float4*>(w + j) = w4;
    alignas(8) T q[4];
    round_to(w4.x, &q[0]);
    round_to(w4.y, &q[1]);
    round_to(w4.z, &q[2]);
    round_to(w4.w, &q[3]);
    *reinterpret_cast<uint2*>(w16 + j) = *reinterpret_cast<const uint2*>(q);
  }
  for (int i = 4 * vec + threadIdx.x; i < c.length; i += kThreads) {
    const int64_t j = c.start + i;
    const float nw = updated(m[j], v[j], w[j]);
    w[j] = nw;
    round_to(nw, &w16[j]);
  }
}

template <class T>
__global__ void to_16bit_kernel(const float* __restrict__ w, T* __restrict__ w16, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    round_to(w[i], &w16[i]);
}

Hyper make_hyper(const OptimizerOptions& o) {
  Hyper h{};
  h.b1 = static_cast<float>(o.beta1);
  h.b2 = static_cast<float>(o.beta2);
  // The CPU twin computes (1.0f - b1) in float from the float beta: the same value here.
  h.one_minus_b1 = 1.0f - h.b1;
  h.one_minus_b2 = 1.0f - h.b2;
  h.eps = static_cast<float>(o.eps);
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.max_grad_norm = o.max_grad_norm;
  h.bias_correction = o.bias_correction ? 1 : 0;
  return h;
}

}  // namespace

std::vector<LambTensor> lamb_tensors(const ParamLayout& layout) {
  std::vector<LambTensor> out;
  out.reserve(layout.tensors().size());
  for (const ParamTensor& t : layout.tensors()) out.push_back({t.offset, t.numel, t.no_weight_decay});
  return out;
}

FusedLamb::FusedLamb(std::vector<LambTensor> tensors, size_t total_numel, OptimizerOptions options,
                     cudaStream_t stream)
    : tensors_(std::move(tensors)), total_(total_numel), options_(options), stream_(stream) {
  NOPAD_CHECK(options_.beta1 >= 0 && options_.beta1 < 1 && options_.beta2 >= 0 && options_.beta2 < 1,
              "FusedLamb: betas must lie in [0, 1), got beta1=", options_.beta1, " beta2=", options_.beta2);
  NOPAD_CHECK(options_.eps > 0, "FusedLamb: eps must be > 0, got ", options_.eps);
  NOPAD_CHECK(options_.weight_decay >= 0, "FusedLamb: weight_decay must be >= 0, got ", options_.weight_decay);

  // Chunk table, and a check that the tensors are disjoint and inside the range.
  std::vector<Chunk> chunks;
  std::vector<TensorInfo> info;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const LambTensor& t = tensors_[i];
    NOPAD_CHECK(t.offset <= total_ && t.numel <= total_ - t.offset, "FusedLamb: tensor ", i, " [", t.offset, ", +",
                t.numel, ") lies outside the parameter range of ", total_, " elements");
    ranges.emplace_back(t.offset, t.offset + t.numel);
    TensorInfo ti{};
    ti.chunk_begin = static_cast<int32_t>(chunks.size());
    ti.wd = t.no_weight_decay ? 0.0f : static_cast<float>(options_.weight_decay);
    ti.use_ratio = (options_.trust_ratio == TrustRatio::kAllTensors || ti.wd != 0.0f) ? 1 : 0;
    for (size_t s = 0; s < t.numel; s += kChunk) {
      const size_t len = std::min<size_t>(kChunk, t.numel - s);
      chunks.push_back({static_cast<int64_t>(t.offset + s), static_cast<int32_t>(len), static_cast<int32_t>(i)});
    }
    ti.chunk_count = static_cast<int32_t>(chunks.size()) - ti.chunk_begin;
    info.push_back(ti);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    NOPAD_CHECK(ranges[i].first >= ranges[i - 1].second, "FusedLamb: tensors overlap at element ", ranges[i].first);
  NOPAD_CHECK(chunks.size() < static_cast<size_t>(INT32_MAX), "FusedLamb: too many chunks");
  num_chunks_ = chunks.size();

  master_ = static_cast<float*>(cuda_malloc_or_throw(total_ * sizeof(float), "LAMB master weights"));
  m_ = static_cast<float*>(cuda_malloc_or_throw(total_ * sizeof(float), "LAMB exp_avg"));
  v_ = static_cast<float*>(cuda_malloc_or_throw(total_ * sizeof(float), "LAMB exp_avg_sq"));
  chunks_ = cuda_malloc_or_throw(chunks.size() * sizeof(Chunk), "LAMB chunk table");
  tensor_info_ = cuda_malloc_or_throw(info.size() * sizeof(TensorInfo), "LAMB tensor table");
  partial_g_ = static_cast<float*>(cuda_malloc_or_throw(num_chunks_ * sizeof(float), "LAMB partial sums"));
  partial_w_ = static_cast<float*>(cuda_malloc_or_throw(num_chunks_ * sizeof(float), "LAMB partial sums"));
  partial_u_ = static_cast<float*>(cuda_malloc_or_throw(num_chunks_ * sizeof(float), "LAMB partial sums"));
  state_ = static_cast<DeviceState*>(cuda_malloc_or_throw(sizeof(DeviceState), "LAMB state"));

  NOPAD_CUDA_CHECK(cudaMemsetAsync(master_, 0, total_ * sizeof(float), stream_));
  NOPAD_CUDA_CHECK(cudaMemsetAsync(m_, 0, total_ * sizeof(float), stream_));
  NOPAD_CUDA_CHECK(cudaMemsetAsync(v_, 0, total_ * sizeof(float), stream_));
  NOPAD_CUDA_CHECK(cudaMemsetAsync(state_, 0, sizeof(DeviceState), stream_));
  if (!chunks.empty())
    NOPAD_CUDA_CHECK(cudaMemcpyAsync(chunks_, chunks.data(), chunks.size() * sizeof(Chunk), cudaMemcpyHostToDevice,
                                     stream_));
  if (!info.empty())
    NOPAD_CUDA_CHECK(cudaMemcpyAsync(tensor_info_, info.data(), info.size() * sizeof(TensorInfo),
                                     cudaMemcpyHostToDevice, stream_));
  // The host tables are about to go out of scope.
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

FusedLamb::~FusedLamb() {
  // Destructors must not throw: errors here are ignored (the context may already be torn down at exit).
  (void)cudaStreamSynchronize(stream_);
  for (void* p : {static_cast<void*>(master_), static_cast<void*>(m_), static_cast<void*>(v_), chunks_,
                  tensor_info_, static_cast<void*>(partial_g_), static_cast<void*>(partial_w_),
                  static_cast<void*>(partial_u_), static_cast<void*>(state_)})
    if (p != nullptr) (void)cudaFree(p);
}

void FusedLamb::step(const float* grads, bf16* weight_copy, float lr, float grad_scale) {
  step_impl(grads, reinterpret_cast<__nv_bfloat16*>(weight_copy), lr, grad_scale);
}
void FusedLamb::step(const float* grads, f16* weight_copy, float lr, float grad_scale) {
  step_impl(grads, reinterpret_cast<__half*>(weight_copy), lr, grad_scale);
}

template <class T>
void FusedLamb::step_impl(const float* grads, T* weight_copy, float lr, float grad_scale) {
  const Hyper h = make_hyper(options_);
  const auto* chunks = static_cast<const Chunk*>(chunks_);
  const auto* info = static_cast<const TensorInfo*>(tensor_info_);
  const unsigned grid = static_cast<unsigned>(num_chunks_);
  if (grid > 0) {
    grad_sumsq_kernel<<<grid, kThreads, 0, stream_>>>(chunks, grads, partial_g_);
    NOPAD_CUDA_CHECK_LAUNCH();
  }
  // Also with no chunks, so that the norm (0), the step count and the skip flag behave as on the CPU.
  finalize_kernel<<<1, kFinalizeThreads, 0, stream_>>>(partial_g_, static_cast<int32_t>(num_chunks_), grad_scale, h,
                                                       state_);
  NOPAD_CUDA_CHECK_LAUNCH();
  if (grid == 0) return;
  moments_kernel<<<grid, kThreads, 0, stream_>>>(chunks, info, grads, master_, m_, v_, h, state_, partial_w_,
                                                 partial_u_);
  NOPAD_CUDA_CHECK_LAUNCH();
  apply_kernel<T><<<grid, kThreads, 0, stream_>>>(chunks, info, partial_w_, partial_u_, m_, v_, master_, weight_copy,
                                                  lr, h, state_);
  NOPAD_CUDA_CHECK_LAUNCH();
}

FusedLamb::DeviceState FusedLamb::read_state() const {
  DeviceState s{};
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(&s, state_, sizeof(s), cudaMemcpyDeviceToHost, stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return s;
}

size_t FusedLamb::state_size() { return sizeof(DeviceState); }

FusedLamb::Stats FusedLamb::decode_state(const void* host_copy) {
  DeviceState s{};
  std::memcpy(&s, host_copy, sizeof(s));
  return Stats{s.grad_norm, s.skipped != 0, s.step};
}

double FusedLamb::last_grad_norm() const { return read_state().grad_norm; }
bool FusedLamb::last_step_skipped() const { return read_state().skipped != 0; }
int64_t FusedLamb::step_count() const { return read_state().step; }

void FusedLamb::load_master(const float* host) {
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(master_, host, total_ * sizeof(float), cudaMemcpyHostToDevice, stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void FusedLamb::download_master(float* host) const {
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(host, master_, total_ * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void FusedLamb::load_moments(const float* host_m, const float* host_v, int64_t step_count) {
  NOPAD_CHECK(step_count >= 0, "FusedLamb: step count must be >= 0, got ", step_count);
  DeviceState s = read_state();
  s.step = step_count;
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(m_, host_m, total_ * sizeof(float), cudaMemcpyHostToDevice, stream_));
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(v_, host_v, total_ * sizeof(float), cudaMemcpyHostToDevice, stream_));
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(state_, &s, sizeof(s), cudaMemcpyHostToDevice, stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void FusedLamb::download_moments(float* host_m, float* host_v) const {
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(host_m, m_, total_ * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(host_v, v_, total_ * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void FusedLamb::write_weight_copy(bf16* weight_copy) {
  write_copy_impl(reinterpret_cast<__nv_bfloat16*>(weight_copy));
}
void FusedLamb::write_weight_copy(f16* weight_copy) { write_copy_impl(reinterpret_cast<__half*>(weight_copy)); }

template <class T>
void FusedLamb::write_copy_impl(T* weight_copy) {
  if (total_ == 0) return;
  const size_t blocks = std::min<size_t>((total_ + kThreads - 1) / kThreads, 4096);
  to_16bit_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream_>>>(master_, weight_copy, total_);
  NOPAD_CUDA_CHECK_LAUNCH();
}

}  // namespace nopad::cuda
