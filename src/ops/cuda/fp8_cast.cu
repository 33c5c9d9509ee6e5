// The scaled bf16 -> fp8 cast (row-major and transposed copies, amax) and the batched delayed-scaling update: see
// fp8_cast.h. CPU twins: fp8_quantize (core/fp8.h), fp8_update_scaling (ops/fp8_recipe.cpp).
#include "ops/cuda/fp8_cast.h"

#include <cuda_fp8.h>

#include <cfloat>
#include <cstring>

#include "core/error.h"
#include "ops/cuda/check.h"

namespace nopad::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;      // rows and columns of a block's tile
constexpr int kPerThread = 16;  // consecutive elements a thread converts (two 16-byte loads, one 16-byte store)
constexpr int kTileWords = kTile / 4 + 1;  // a tile row in 32-bit words, one word of padding (2-way bank conflicts)

template <Fp8Format F>
__device__ __forceinline__ uint32_t cvt_pair(float a, float b) {
  constexpr __nv_fp8_interpretation_t kind = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind));  // a: low byte
}

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits) { return __uint_as_float(bits << 16); }

// Block maximum of v (threads' |x| bits), then one atomicMax per block: the unsigned order of the bits is the order of
// the non-negative floats, NaN above inf.
__device__ __forceinline__ void block_amax(uint32_t v, float* amax) {
  __shared__ uint32_t warp_max[kThreads / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    if (m != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), m);
  }
}

// blockIdx.x: a tile of 64 rows (of rows, or of ld_t with the transposed copy), blockIdx.y: a tile of 64 columns.
// Thread t converts row t / 4 of the tile, columns (t % 4) * 16 .. + 16; with the transposed copy it then writes tile
// column t / 4, rows (t % 4) * 16 .. + 16 (four threads write 64 contiguous bytes of a row of q_t).
template <Fp8Format F, bool kTranspose>
__global__ void __launch_bounds__(kThreads)
    fp8_cast_kernel(const uint16_t* __restrict__ x, int64_t rows, int64_t cols, const float* __restrict__ scale_ptr,
                    uint8_t* __restrict__ q, uint8_t* __restrict__ q_t, int64_t ld_t, float* __restrict__ amax,
                    bool vec) {
  __shared__ __align__(16) uint32_t tile[kTranspose ? kTile : 1][kTileWords];
  const float scale = *scale_ptr;
  const int t = threadIdx.x;
  const int lr = t >> 2, lc = (t & 3) * kPerThread;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kTile + lr;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile + lc;
  uint32_t abs_max = 0;
  uint32_t out[4] = {0, 0, 0, 0};  // 16 fp8 bytes, element e in byte e % 4 of word e / 4; zeros outside the matrix
  if (r < rows && c0 < cols) {
    const int64_t base = r * cols + c0;
    if (vec) {  // cols % 16 == 0: the 16 elements are inside the row and 32-byte aligned
      const uint4 lo = *reinterpret_cast<const uint4*>(x + base);
      const uint4 hi = *reinterpret_cast<const uint4*>(x + base + 8);
      const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t b0 = w[i] & 0xFFFFu, b1 = w[i] >> 16;
        abs_max = max(abs_max, max(b0 & 0x7FFFu, b1 & 0x7FFFu));
        const uint32_t pair = cvt_pair<F>(__fmul_rn(bf16_bits_to_float(b0), scale),
                                          __fmul_rn(bf16_bits_to_float(b1), scale));
        out[i >> 1] |= pair << ((i & 1) * 16);
      }
      if (q != nullptr) *reinterpret_cast<uint4*>(q + base) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
      for (int e = 0; e < kPerThread && c0 + e < cols; e += 2) {
        const uint32_t b0 = x[base + e], b1 = c0 + e + 1 < cols ? x[base + e + 1] : 0u;
        abs_max = max(abs_max, max(b0 & 0x7FFFu, b1 & 0x7FFFu));
        const uint32_t pair = cvt_pair<F>(__fmul_rn(bf16_bits_to_float(b0), scale),
                                          __fmul_rn(bf16_bits_to_float(b1), scale));
        const uint32_t keep = c0 + e + 1 < cols ? 0xFFFFu : 0xFFu;
        out[e >> 2] |= (pair & keep) << ((e & 3) * 8);
        if (q != nullptr) {
          q[base + e] = static_cast<uint8_t>(pair);
          if (c0 + e + 1 < cols) q[base + e + 1] = static_cast<uint8_t>(pair >> 8);
        }
      }
    }
  }
  if (kTranspose) {
#pragma unroll
    for (int i = 0; i < 4; ++i) tile[lr][lc / 4 + i] = out[i];
  }
  if (amax != nullptr) block_amax(abs_max << 16, amax);  // syncs the block, so the tile is complete
  if (kTranspose) {
    if (amax == nullptr) __syncthreads();
    const int cc = t >> 2, chunk = t & 3;
    const int64_t c = static_cast<int64_t>(blockIdx.y) * kTile + cc;
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile + chunk * kPerThread;
    if (c < cols && r0 < ld_t) {  // ld_t % 16 == 0: the 16 rows r0.. are all below ld_t
      uint32_t col[4] = {0, 0, 0, 0};
      const int shift = (cc & 3) * 8;
#pragma unroll
      for (int j = 0; j < kPerThread; ++j)
        col[j >> 2] |= ((tile[chunk * kPerThread + j][cc >> 2] >> shift) & 0xFFu) << ((j & 3) * 8);
      *reinterpret_cast<uint4*>(q_t + c * ld_t + r0) = make_uint4(col[0], col[1], col[2], col[3]);
    }
  }
}

template <Fp8Format F>
void launch_cast_format(const Fp8CastArgs& a, bool vec, cudaStream_t stream) {
  const int64_t row_extent = a.q_t != nullptr ? a.ld_t : a.rows;
  const int64_t row_tiles = (row_extent + kTile - 1) / kTile, col_tiles = (a.cols + kTile - 1) / kTile;
  NOPAD_CHECK(row_tiles <= 0x7FFFFFFF && col_tiles <= 65535, "launch_fp8_cast: the matrix [", a.rows, ", ", a.cols,
              "] is too large for one launch");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const auto* x = reinterpret_cast<const uint16_t*>(a.x);
  if (a.q_t != nullptr)
    fp8_cast_kernel<F, true>
        <<<grid, kThreads, 0, stream>>>(x, a.rows, a.cols, a.scale, a.q, a.q_t, a.ld_t, a.amax, vec);
  else
    fp8_cast_kernel<F, false><<<grid, kThreads, 0, stream>>>(x, a.rows, a.cols, a.scale, a.q, nullptr, 0, a.amax, vec);
  NOPAD_CUDA_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// One thread per tensor: the recipe step of ops/fp8_recipe.cpp, number for number.
__global__ void fp8_update_scales_kernel(Fp8ScalingTable t, ops::AmaxAlgo algo, float scaled_max_e4m3,
                                         float scaled_max_e5m2) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= t.n) return;
  const int64_t at = static_cast<int64_t>(i) * kFp8ScalarStride;  // amax, scale, scale_inv
  const float step_amax = t.amax[at];
  t.amax[at] = 0.0f;  // the next step's casts start their running maximum from zero
  float* ring = t.history + static_cast<int64_t>(i) * t.history_len;
  if (isfinite(step_amax) && step_amax > 0.0f) {
    const int head = t.head[i];
    ring[head] = step_amax;
    t.head[i] = head + 1 == t.history_len ? 0 : head + 1;
  }
  float amax = step_amax;
  if (algo == ops::AmaxAlgo::kMax) {
    amax = 0.0f;
    for (int j = 0; j < t.history_len; ++j) amax = fmaxf(amax, ring[j]);  // finite, >= 0: exact, order-free
  }
  float scale = t.scale[at];
  if (isfinite(amax) && amax > 0.0f) {
    scale = __fdiv_rn(t.format[i] == static_cast<uint8_t>(Fp8Format::kE4M3) ? scaled_max_e4m3 : scaled_max_e5m2,
                      amax);
    if (isinf(scale)) scale = FLT_MAX;
  }
  t.scale[at] = scale;
  t.scale_inv[at] = __fdiv_rn(1.0f, scale);
}

}  // namespace

void launch_fp8_cast(const Fp8CastArgs& a, cudaStream_t stream) {
  NOPAD_CHECK(a.scale != nullptr, "launch_fp8_cast: no scale pointer (the device float the values are multiplied by)");
  NOPAD_CHECK(a.rows >= 0 && a.cols >= 0, "launch_fp8_cast: negative shape [", a.rows, ", ", a.cols, "]");
  NOPAD_CHECK(a.rows == 0 || a.cols == 0 || a.x != nullptr, "launch_fp8_cast: no input for [", a.rows, ", ", a.cols,
              "]");
  if (a.q_t != nullptr) {
    NOPAD_CHECK(a.ld_t >= a.rows && a.ld_t % 16 == 0, "launch_fp8_cast: the transposed copy's leading dimension ",
                a.ld_t, " must be >= rows (", a.rows, ") and a multiple of 16 (fp8_transposed_ld gives ",
                fp8_transposed_ld(a.rows), ")");
    NOPAD_CHECK(aligned16(a.q_t), "launch_fp8_cast: the transposed copy is not 16-byte aligned");
  }
  if (a.cols == 0 || (a.q_t == nullptr && a.rows == 0) || (a.q_t != nullptr && a.ld_t == 0)) return;
  const bool vec = a.cols % kPerThread == 0 && aligned16(a.x) && (a.q == nullptr || aligned16(a.q));
  if (a.format == Fp8Format::kE4M3)
    launch_cast_format<Fp8Format::kE4M3>(a, vec, stream);
  else
    launch_cast_format<Fp8Format::kE5M2>(a, vec, stream);
}

void launch_fp8_update_scales(const Fp8ScalingTable& t, const ops::Fp8Recipe& r, cudaStream_t stream) {
  ops::validate(r);
  NOPAD_CHECK(t.history_len == r.history_len, "launch_fp8_update_scales: the table's rings have ", t.history_len,
              " entries but the recipe's history_len is ", r.history_len);
  if (t.n == 0) return;
  NOPAD_CHECK(t.amax && t.history && t.head && t.scale && t.scale_inv && t.format,
              "launch_fp8_update_scales: a table array is missing");
  constexpr int kUpdateThreads = 128;
  fp8_update_scales_kernel<<<(t.n + kUpdateThreads - 1) / kUpdateThreads, kUpdateThreads, 0, stream>>>(
      t, r.algo, ops::fp8_scaled_max(Fp8Format::kE4M3, r.margin), ops::fp8_scaled_max(Fp8Format::kE5M2, r.margin));
  NOPAD_CUDA_CHECK_LAUNCH();
}

// ------------------------------------------------------------------------------------------------ Fp8Scalings

namespace {
size_t round256(size_t b) { return (b + 255) / 256 * 256; }
}  // namespace

Fp8Scalings::Fp8Scalings(const std::vector<Fp8Format>& formats, const ops::Fp8Recipe& recipe)
    : recipe_(recipe), formats_(formats) {
  ops::validate(recipe);
  const size_t n = formats.size(), len = static_cast<size_t>(recipe.history_len);
  const size_t f_bytes = n * kFp8ScalarStride * sizeof(float), h_bytes = round256(n * len * sizeof(float));
  const size_t i_bytes = round256(n * sizeof(int32_t)), u_bytes = round256(n);
  memory_ = cuda_malloc_or_throw(4 * f_bytes + h_bytes + i_bytes + u_bytes, "the FP8 scaling table");
  char* p = static_cast<char*>(memory_);
  table_.n = static_cast<int>(n);
  table_.history_len = recipe.history_len;
  table_.amax = reinterpret_cast<float*>(p);
  table_.scale = reinterpret_cast<float*>(p + f_bytes);
  table_.scale_inv = reinterpret_cast<float*>(p + 2 * f_bytes);
  table_.history = reinterpret_cast<float*>(p + 4 * f_bytes);
  table_.head = reinterpret_cast<int32_t*>(p + 4 * f_bytes + h_bytes);
  table_.format = reinterpret_cast<const uint8_t*>(p + 4 * f_bytes + h_bytes + i_bytes);
  reset();
}

Fp8Scalings::~Fp8Scalings() {
  if (memory_) cudaFree(memory_);  // destructors do not throw
}

void Fp8Scalings::reset() {
  const size_t n = formats_.size();
  if (n == 0) return;
  std::vector<float> ones(n * kFp8ScalarStride, 0.0f);  // scale = scale_inv = 1 at each tensor's slot
  for (size_t i = 0; i < n; ++i) ones[i * kFp8ScalarStride] = 1.0f;
  std::vector<uint8_t> fmt(n);
  for (size_t i = 0; i < n; ++i) fmt[i] = static_cast<uint8_t>(formats_[i]);
  NOPAD_CUDA_CHECK(cudaMemset(table_.amax, 0, n * kFp8ScalarStride * sizeof(float)));
  NOPAD_CUDA_CHECK(cudaMemset(table_.history, 0, n * static_cast<size_t>(table_.history_len) * sizeof(float)));
  NOPAD_CUDA_CHECK(cudaMemset(table_.head, 0, n * sizeof(int32_t)));
  NOPAD_CUDA_CHECK(cudaMemcpy(table_.scale, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  NOPAD_CUDA_CHECK(cudaMemcpy(table_.scale_inv, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  NOPAD_CUDA_CHECK(cudaMemcpy(const_cast<uint8_t*>(table_.format), fmt.data(), n, cudaMemcpyHostToDevice));
  NOPAD_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace nopad::cuda
