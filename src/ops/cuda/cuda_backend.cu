// CudaBackendT<P>: memory, the op entry points and their orchestration (which kernels and products, in which order, on
// which scratch). The kernels are in layernorm.cu, dense.cu (cuBLASLt), heads.cu; attention is the fmha module's
// (fmha.h). Each op mirrors its CPU twin in ops/cpu/cpu_backend.cpp; see cuda_backend.h for the execution model.
// One body for both 16-bit policies: the element type reaches the kernels as a template argument (device_t<A>), the
// GEMMs as GemmProblem::type and the attention as FmhaParams::fp16. Instantiated at the end for GpuBf16 and GpuF16.
#include "ops/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/dense.h"
#include "ops/cuda/gemm_sm90.h"
#include "ops/cuda/fmha.h"
#include "ops/cuda/kernels.cuh"
#include "ops/seq_view.h"

namespace nopad::cuda {
namespace {

// Host 16-bit storage types as the kernels' device types (layout-identical, core/dtype.h).
template <class H>
device_t<H>* dev(H* p) {
  return reinterpret_cast<device_t<H>*>(p);
}
template <class H>
const device_t<H>* dev(const H* p) {
  return reinterpret_cast<const device_t<H>*>(p);
}
// The cuBLASLt element type of a host 16-bit type.
template <class H>
constexpr cudaDataType_t gemm_type() {
  return std::is_same_v<H, nopad::f16> ? CUDA_R_16F : CUDA_R_16BF;
}

// Host-side preparation of a dropout call: the twin's validation and stream key; the kernels derive the threshold and
// keep-scale from p (core/philox.h).
DropoutArgs dropout_args(const ops::Dropout& d) {
  NOPAD_CHECK(dropout_p_supported(d.p), "dropout probability must be in [0, ", kDropoutMaxP,
              "] (16-bit draws: a larger p keeps nothing), got ", d.p);
  DropoutArgs a;
  a.p = d.p;
  if (d.p > 0.0f) a.stream_key = dropout_stream_key(d.seed, d.step, d.op_id);
  return a;
}

void check_seqs(const ops::SeqView& s, bool need_sample_ids) {
  NOPAD_CHECK(s.num_tokens >= 0 && s.num_seqs >= 0, "SeqView with negative sizes");
  NOPAD_CHECK(s.num_tokens == 0 || (s.num_seqs > 0 && s.cu_seqlens != nullptr), "SeqView without cu_seqlens");
  NOPAD_CHECK(!need_sample_ids || s.num_tokens == 0 || s.sample_ids != nullptr, "dropout needs SeqView::sample_ids");
}
using ops::require_whole_sequences;

}  // namespace

// ------------------------------------------------------------------------------------------------ setup & memory

template <class P>
CudaBackendT<P>::CudaBackendT(int device) : device_(device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    fail("no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "the driver reports 0 devices",
         "; use --device cpu");
  NOPAD_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count,
              " device(s) visible); use --device cpu or a device index below ", count);
  NOPAD_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop{};
  NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  NOPAD_CHECK(prop.major >= 8, "CUDA device ", device, " (", prop.name, ", sm_", prop.major, prop.minor,
              ") has no bf16 tensor cores; the CUDA backend needs sm_80 or newer (use --device cpu)");
  sm_count_ = prop.multiProcessorCount;
  NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : fences_) NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&uploads_done_, cudaEventDisableTiming));
  gemm_ = std::make_unique<LtGemm>();
  gemm_sm90_prepare();  // the GELU epilogue's lookup tables, uploaded now rather than inside the first step
  attn_schedule_ = ops::attention_schedule_from_env();
  attn_streams_ = std::make_unique<FmhaStreams>(ops::AttentionSchedule::kMaxStreams);
}

template <class P>
void CudaBackendT<P>::set_attention_schedule(const ops::AttentionSchedule& s) {
  ops::validate(s);
  attn_schedule_ = s;
}

template <class P>
CudaBackendT<P>::~CudaBackendT() {
  // No throwing from a destructor: statuses are deliberately ignored while tearing down.
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  for (cudaEvent_t e : op_events_) cudaEventDestroy(e);
  for (cudaEvent_t e : fences_)
    if (e) cudaEventDestroy(e);
  if (uploads_done_) cudaEventDestroy(uploads_done_);
  for (DownloadSlot& slot : downloads_) {
    if (slot.done) cudaEventDestroy(slot.done);
    if (slot.pinned) cudaFreeHost(slot.pinned);
  }
  for (int s = 0; s < kNumSlots; ++s)
    if (scratch_[s]) cudaFree(scratch_[s]);
  for (StagingSlot& slot : staging_) {
    if (slot.copied) cudaEventDestroy(slot.copied);
    if (slot.host) cudaFreeHost(slot.host);
  }
  gemm_.reset();
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

// ------------------------------------------------------------------------------------------------ op timing

template <class P>
class CudaBackendT<P>::OpScope {
 public:
  OpScope(CudaBackendT& b, const char* name, int32_t k = -1, int32_t n = -1) : b_(b) {
    if (!b_.op_timing_) return;
    if (b_.op_depth_ == 0) {
      b_.op_start(name, k, n);
      outer_ = true;
    }
    ++b_.op_depth_;
    active_ = true;
  }
  ~OpScope() {
    if (!active_) return;
    --b_.op_depth_;
    if (outer_) b_.op_stop();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  CudaBackendT& b_;
  bool active_ = false;
  bool outer_ = false;
};

template <class P>
void CudaBackendT<P>::op_start(const char* name, int32_t k, int32_t n) {
  const size_t first = 2 * op_records_.size();
  if (first + 2 > op_events_.size()) {  // grow the pool (doubling); only ever while timing is on
    const size_t target = std::max<size_t>(256, 2 * op_events_.size());
    op_events_.reserve(target);
    while (op_events_.size() < target) {
      cudaEvent_t e = nullptr;
      NOPAD_CUDA_CHECK(cudaEventCreate(&e));
      op_events_.push_back(e);
    }
  }
  size_t key = 0;
  while (key < op_keys_.size() &&
         !(op_keys_[key].k == k && op_keys_[key].n == n && std::string_view(op_keys_[key].name) == name))
    ++key;
  if (key == op_keys_.size()) op_keys_.push_back({name, k, n});
  NOPAD_CUDA_CHECK(cudaEventRecord(op_events_[first], stream_));
  op_records_.push_back({key, first});
}

// Runs in a destructor: a failure is kept and reported by op_times_ms().
template <class P>
void CudaBackendT<P>::op_stop() noexcept {
  const cudaError_t err = cudaEventRecord(op_events_[op_records_.back().first_event + 1], stream_);
  if (err != cudaSuccess && op_timing_error_ == cudaSuccess) op_timing_error_ = err;
}

template <class P>
std::vector<std::pair<std::string, double>> CudaBackendT<P>::op_times_ms() {
  const cudaError_t pending = op_timing_error_;
  op_timing_error_ = cudaSuccess;
  NOPAD_CUDA_CHECK(pending);
  synchronize();
  op_totals_ms_.resize(op_keys_.size(), 0.0);
  for (const OpRecord& r : op_records_) {
    float ms = 0;
    NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, op_events_[r.first_event], op_events_[r.first_event + 1]));
    op_totals_ms_[r.key] += static_cast<double>(ms);
  }
  op_records_.clear();  // the events are free again
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < op_keys_.size(); ++i) {
    std::string name = op_keys_[i].name;
    if (op_keys_[i].k >= 0) name += " k=" + std::to_string(op_keys_[i].k) + " n=" + std::to_string(op_keys_[i].n);
    out.emplace_back(std::move(name), op_totals_ms_[i]);
  }
  return out;
}

template <class P>
void CudaBackendT<P>::reset_op_times() {
  synchronize();
  op_records_.clear();
  op_totals_ms_.assign(op_keys_.size(), 0.0);
  op_timing_error_ = cudaSuccess;
}

// ------------------------------------------------------------------------------------------------ memory

template <class P>
void* CudaBackendT<P>::allocate_bytes(size_t bytes) {
  try {
    void* p = cuda_malloc_or_throw(bytes, "a backend buffer");
    allocated_bytes_ += bytes;
    return p;
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(str_cat(e.what(), " (this backend already holds ",
                              static_cast<double>(allocated_bytes_) / (1024.0 * 1024.0 * 1024.0), " GiB)"));
  }
}

template <class P>
void CudaBackendT<P>::free_bytes(void* ptr) {
  if (ptr) NOPAD_CUDA_CHECK(cudaFree(ptr));
}

// The caller may reuse host_src as soon as an upload returns: the bytes are in a pinned slot by then.
template <class P>
typename CudaBackendT<P>::StagingSlot& CudaBackendT<P>::next_staging_slot(const void* host_src, size_t bytes) {
  StagingSlot& slot = staging_[staging_next_];
  staging_next_ = (staging_next_ + 1) % kStagingSlots;
  if (slot.copied == nullptr) NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
  NOPAD_CUDA_CHECK(cudaEventSynchronize(slot.copied));  // returns at once unless the GPU is kStagingSlots uploads behind
  if (slot.capacity < bytes) {  // grows to the largest upload seen, then never again
    if (slot.host) NOPAD_CUDA_CHECK(cudaFreeHost(slot.host));
    slot.host = nullptr;
    slot.capacity = 0;
    NOPAD_CUDA_CHECK(cudaHostAlloc(&slot.host, bytes, cudaHostAllocDefault));
    slot.capacity = bytes;
  }
  std::memcpy(slot.host, host_src, bytes);
  return slot;
}

template <class P>
void CudaBackendT<P>::upload_bytes(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  OpScope timed(*this, "upload");
  StagingSlot& slot = next_staging_slot(host_src, bytes);
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
  NOPAD_CUDA_CHECK(cudaEventRecord(slot.copied, stream_));
}

template <class P>
void CudaBackendT<P>::upload_bytes_async(void* dst, const void* host_src, size_t bytes) {
  if (!bytes) return;
  StagingSlot& slot = next_staging_slot(host_src, bytes);
  NOPAD_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, copy_stream_));
  NOPAD_CUDA_CHECK(cudaEventRecord(slot.copied, copy_stream_));
  if (capture_mode_) {
    NOPAD_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));  // done before the captured work: no cross-stream node
    return;
  }
  uploads_since_wait_ = true;
}

template <class P>
void CudaBackendT<P>::compute_waits_for_uploads() {
  if (!uploads_since_wait_ || capture_mode_) return;
  NOPAD_CUDA_CHECK(cudaEventRecord(uploads_done_, copy_stream_));
  NOPAD_CUDA_CHECK(cudaStreamWaitEvent(stream_, uploads_done_, 0));
  uploads_since_wait_ = false;
}

template <class P>
uint64_t CudaBackendT<P>::fence_compute() {
  if (capture_mode_) return 0;
  const uint64_t fence = ++fences_made_;  // 0 is "no fence"
  NOPAD_CUDA_CHECK(cudaEventRecord(fences_[fence % kFences], stream_));
  return fence;
}

template <class P>
void CudaBackendT<P>::uploads_wait(uint64_t fence) {
  if (fence == 0) return;
  NOPAD_CHECK(fence <= fences_made_ && fences_made_ - fence < kFences, "CudaBackend::uploads_wait: fence ", fence,
              " is no longer valid (", fences_made_, " fences made; one stays valid for ", kFences - 1, " more)");
  NOPAD_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, fences_[fence % kFences], 0));
}

template <class P>
void CudaBackendT<P>::complete_download(DownloadSlot& slot) {
  if (!slot.pending) return;
  NOPAD_CUDA_CHECK(cudaEventSynchronize(slot.done));
  std::memcpy(slot.host_dst, slot.pinned, slot.bytes);
  slot.pending = false;
}

template <class P>
uint64_t CudaBackendT<P>::download_bytes_async(void* host_dst, const void* src, size_t bytes) {
  if (capture_mode_) return 0;  // the captured step's results are not read
  const uint64_t ticket = ++downloads_made_;
  DownloadSlot& slot = downloads_[ticket % kDownloadSlots];
  complete_download(slot);  // the slot's previous result reaches its owner before the slot is reused
  if (slot.done == nullptr) NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  if (slot.capacity < bytes) {  // grows to the largest download seen, then never again
    if (slot.pinned) NOPAD_CUDA_CHECK(cudaFreeHost(slot.pinned));
    slot.pinned = nullptr;
    slot.capacity = 0;
    NOPAD_CUDA_CHECK(cudaHostAlloc(&slot.pinned, std::max<size_t>(bytes, 256), cudaHostAllocDefault));
    slot.capacity = std::max<size_t>(bytes, 256);
  }
  slot.host_dst = host_dst;
  slot.bytes = bytes;
  slot.ticket = ticket;
  if (bytes) NOPAD_CUDA_CHECK(cudaMemcpyAsync(slot.pinned, src, bytes, cudaMemcpyDeviceToHost, stream_));
  NOPAD_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  slot.pending = true;
  return ticket;
}

template <class P>
void CudaBackendT<P>::wait_download(uint64_t ticket) {
  if (ticket == 0) return;
  NOPAD_CHECK(ticket <= downloads_made_, "CudaBackend::wait_download: unknown ticket ", ticket);
  DownloadSlot& slot = downloads_[ticket % kDownloadSlots];
  if (slot.ticket == ticket) complete_download(slot);  // else it was completed when its slot was reused
}

template <class P>
void CudaBackendT<P>::download_bytes(void* host_dst, const void* src, size_t bytes) {
  if (!bytes) return;
  {
    OpScope timed(*this, "download");  // ends before the wait
    NOPAD_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  }
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <class P>
void CudaBackendT<P>::zero_bytes(void* x, size_t bytes) {
  if (!bytes) return;
  OpScope timed(*this, "zero");
  NOPAD_CUDA_CHECK(cudaMemsetAsync(x, 0, bytes, stream_));
}

template <class P>
void CudaBackendT<P>::synchronize() {
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
  NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// Grow-only scratch: allocated on first use at the largest size seen, then reused. Growth is stream-ordered
// (cudaFreeAsync/cudaMallocAsync on stream_), so it needs no host synchronisation; in steady state it never happens.
template <class P>
void* CudaBackendT<P>::scratch(Slot slot, size_t bytes) {
  if (bytes <= scratch_bytes_[slot]) return scratch_[slot];
  if (scratch_[slot]) NOPAD_CUDA_CHECK(cudaFreeAsync(scratch_[slot], stream_));
  scratch_[slot] = nullptr;
  scratch_bytes_[slot] = 0;
  const size_t rounded = (bytes + 255) / 256 * 256;
  const cudaError_t err = cudaMallocAsync(&scratch_[slot], rounded, stream_);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    throw OutOfMemory(str_cat("out of GPU memory growing scratch buffer ", static_cast<int>(slot), " to ", rounded,
                              " bytes: ", static_cast<double>(free_b) / (1 << 30), " GiB free of ",
                              static_cast<double>(total_b) / (1 << 30), " GiB; use a smaller micro-batch"));
  }
  NOPAD_CUDA_CHECK(err);
  scratch_bytes_[slot] = rounded;
  return scratch_[slot];
}

// ------------------------------------------------------------------------------------------------ embeddings

template <class P>
void CudaBackendT<P>::embed_layernorm_dropout_forward(const int32_t* tokens, const int32_t* positions,
                                                  const int32_t* segments, const ops::SeqView& seqs,
                                                  const ops::EmbeddingWeights<W>& w, const ops::Dropout& drop, A* out,
                                                  St* ln_mean, St* ln_rstd) {
  OpScope timed(*this, "embed_fwd");
  require_whole_sequences(seqs, "embed_layernorm_dropout_forward");
  LnArgs<device_t<A>> a;
  a.drop = dropout_args(drop);
  check_seqs(seqs, a.drop.p > 0.0f);
  a.rows = seqs.num_tokens;
  a.H = w.hidden;
  a.eps = static_cast<float>(w.ln_eps);
  a.gamma = dev(w.ln_gamma);
  a.beta = dev(w.ln_beta);
  a.tokens = tokens;
  a.positions = positions;
  a.segments = segments;
  a.word = dev(w.word);
  a.position = dev(w.position);
  a.token_type = dev(w.token_type);
  a.cu_seqlens = seqs.cu_seqlens;
  a.sample_ids = seqs.sample_ids;
  a.num_seqs = seqs.num_seqs;
  a.out = dev(out);
  a.mean_out = ln_mean;
  a.rstd_out = ln_rstd;
  launch_ln_forward(LnKind::kEmbed, a, kernel_variants().ln_forward, sm_count_, stream_);
}

template <class P>
void CudaBackendT<P>::embed_layernorm_dropout_backward(const A* d_out, const int32_t* tokens, const int32_t* positions,
                                                   const int32_t* segments, const ops::SeqView& seqs,
                                                   const ops::EmbeddingWeights<W>& w, const ops::Dropout& drop,
                                                   const St* ln_mean, const St* ln_rstd,
                                                   const ops::EmbeddingGrads<G>& g) {
  OpScope timed(*this, "embed_bwd");
  require_whole_sequences(seqs, "embed_layernorm_dropout_backward");
  LnArgs<device_t<A>> a;
  a.drop = dropout_args(drop);
  check_seqs(seqs, a.drop.p > 0.0f);
  if (seqs.num_tokens == 0) return;
  NOPAD_CHECK(g.d_word && g.d_position && g.d_token_type, "embedding backward needs all three table gradients");
  a.rows = seqs.num_tokens;
  a.H = w.hidden;
  a.gamma = dev(w.ln_gamma);
  a.tokens = tokens;
  a.positions = positions;
  a.segments = segments;
  a.word = dev(w.word);
  a.position = dev(w.position);
  a.token_type = dev(w.token_type);
  a.cu_seqlens = seqs.cu_seqlens;
  a.sample_ids = seqs.sample_ids;
  a.num_seqs = seqs.num_seqs;
  a.d_out = dev(d_out);
  a.mean = ln_mean;
  a.rstd = ln_rstd;
  a.d_word = g.d_word;
  a.d_position = g.d_position;
  a.d_token_type = g.d_token_type;
  const LnVariant& v = kernel_variants().ln_backward;
  const int blocks = ln_backward_blocks<device_t<A>>(LnKind::kEmbed, a.H, a.rows, v, sm_count_);
  a.partial = static_cast<float*>(scratch(kLnPartials, sizeof(float) * blocks * 2 * static_cast<size_t>(a.H)));
  launch_ln_backward(LnKind::kEmbed, a, v, blocks, stream_);
  launch_column_finish(a.partial, blocks, a.H, 2, g.d_ln_gamma, g.d_ln_beta, nullptr, stream_);
}

// ------------------------------------------------------------------------------------------------ dense

template <class P>
void CudaBackendT<P>::dense_forward_ld(const A* x, const W* weight, const W* bias, int64_t rows, int32_t k,
                                       int32_t n, ops::Activation act, A* y, A* act_grad, int64_t ld_y) {
  OpScope timed(*this, "dense_fwd", k, n);
  const bool gelu = act != ops::Activation::kNone, tanh = act == ops::Activation::kGeluTanh;
  NOPAD_CHECK(ld_y == n || (ld_y > n && !gelu), "dense_forward: output stride ", ld_y, " with n ", n,
              gelu ? " and an activation" : "");
  A* target = gelu ? act_grad : y;  // the cuBLASLt path's pre-activation goes where its derivative will be
  NOPAD_CHECK(target != nullptr && y != nullptr, "dense_forward with GELU needs act_grad");
  if (rows == 0) return;
  // nopad's GEMM: y = gelu(pre) and act_grad = gelu'(pre), pre = x W^T + bias, from the accumulators (gemm_sm90.h).
  if (gelu && kernel_variants().gelu_gemm && gemm_sm90_supported(rows, n, k, x, weight, act_grad, y, nullptr, bias)) {
    launch_gemm_sm90<device_t<A>>(GemmEpilogue::kGelu, dev(x), dev(weight), rows, n, k, dev(bias), dev(act_grad),
                                  dev(y), nullptr, nullptr, tanh, sm_count_, stream_);
    last_gelu_path() = GeluPath::kGemmSm90;
    return;
  }
  GemmProblem p;  // y^T[n, rows] = op_T(W^T[k, n]) x^T[k, rows] (+ bias per row of y^T): dense.h
  p.type = gemm_type<A>();
  p.trans_a = true;
  p.trans_b = false;
  p.m = n;
  p.n = rows;
  p.k = k;
  p.a = weight;
  p.lda = k;
  p.b = x;
  p.ldb = k;
  p.d = target;
  p.ldd = ld_y;
  p.bias = bias;
  gemm_->run(p, stream_);
  if (gelu) {  // pre -> gelu'(pre) in place, y = gelu(pre)
    launch_gelu_forward(dev(act_grad), dev(y), rows * n, kernel_variants().gelu_forward_wide, tanh, stream_);
    last_gelu_path() = GeluPath::kKernel;
  }
}

template <class P>
void CudaBackendT<P>::grad_pass(const A* dy, const A* scale, A* dpre, int64_t rows, int32_t n, G* d_bias) {
  const int chunks = dense_grad_chunks(rows);
  float* partial =
      d_bias ? static_cast<float*>(scratch(kColPartials, sizeof(float) * chunks * static_cast<size_t>(n))) : nullptr;
  launch_dense_grad_pass<device_t<A>>(dev(dy), dev(scale), dev(dpre), rows, n, partial, stream_);
  if (d_bias) launch_column_finish(partial, chunks, n, 1, d_bias, nullptr, nullptr, stream_);
}

template <class P>
void CudaBackendT<P>::column_sums_accumulate(const A* m, int64_t rows, int32_t n, G* out, int64_t ld) {
  if (rows == 0 || n == 0) return;
  const int chunks = column_sum_chunks(rows);
  float* partial = static_cast<float*>(scratch(kColPartials, sizeof(float) * chunks * static_cast<size_t>(n)));
  launch_column_sum_partial(dev(m), rows, n, ld > 0 ? ld : n, chunks, partial, stream_);
  launch_column_finish(partial, chunks, n, 1, out, nullptr, nullptr, stream_);
}

namespace {
// The two backward products of a dense layer in dense.h's column-major mapping, dy [rows, n] with row stride ld_dy:
//   dx^T[k, rows] (+)= W^T[k, n] dy^T[n, rows]           (16-bit dx, beta 1 when accumulating)
//   dW^T[k, n] += x^T[k, rows] op_T(dy^T[n, rows])        (fp32 dW, beta 1)
GemmProblem dx_product(cudaDataType_t type, const void* weight, const void* dy, int64_t ld_dy, int64_t rows, int32_t k,
                       int32_t n, void* dx, bool accumulate) {
  GemmProblem p;
  p.type = type;
  p.m = k;
  p.n = rows;
  p.k = n;
  p.a = weight;
  p.lda = k;
  p.b = dy;
  p.ldb = ld_dy;
  p.d = dx;
  p.ldd = k;
  p.beta = accumulate ? 1.0f : 0.0f;
  return p;
}
GemmProblem dw_product(cudaDataType_t type, const void* x, const void* dy, int64_t ld_dy, int64_t rows, int32_t k,
                       int32_t n, float* d_weight) {
  GemmProblem p;
  p.type = type;
  p.trans_b = true;
  p.m = k;
  p.n = n;
  p.k = rows;
  p.a = x;
  p.lda = k;
  p.b = dy;
  p.ldb = ld_dy;
  p.d = d_weight;
  p.ldd = k;
  p.d_fp32 = true;
  p.beta = 1.0f;
  return p;
}
}  // namespace

// d_bias (and dpre for GELU) along KernelVariants::dense_bias_grad (dense.h):
//  kSeparate: scale pass (dpre = dy * act_grad), products, column-sum pass over dpre;
//  kOnePass:  one pass writes dpre and its column partials (without GELU: the column-sum pass reads dy), then the
//             products;
//  kEpilogue: scale pass (one-pass kernel without column sums), dx product, dW product with the BGRADB epilogue
//             writing the column sums of dpre into fp32 scratch, added into d_bias by a one-block finish. Where
//             cuBLASLt has no algorithm for that product, it runs without the epilogue and d_bias takes the
//             one-pass column sums (or the separate pass where n % 8 != 0, as the MLM decoder's V = 30522).
template <class P>
void CudaBackendT<P>::dense_backward_ld(const A* dy, const A* x, const W* weight, const A* act_grad, int64_t rows,
                                        int32_t k, int32_t n, ops::Activation act, A* dx, bool accumulate_dx,
                                        G* d_weight, G* d_bias, int64_t ld_dy) {
  OpScope timed(*this, "dense_bwd", k, n);
  if (rows == 0) return;  // dx has no rows; the parameter gradients receive += 0
  const bool gelu = act != ops::Activation::kNone;
  NOPAD_CHECK(!gelu || act_grad != nullptr, "dense_backward with GELU needs act_grad");
  NOPAD_CHECK(ld_dy == n || (ld_dy > n && !gelu), "dense_backward: dy stride ", ld_dy, " with n ", n,
              gelu ? " and an activation" : "");
  const int64_t ld_dpre = gelu ? n : ld_dy;  // the GELU paths write a contiguous dpre
  A* buf = gelu ? static_cast<A*>(scratch(kDpre, sizeof(A) * static_cast<size_t>(rows) * n)) : nullptr;
  const A* dpre = gelu ? buf : dy;
  // The one-pass kernel needs n % 8 == 0 and 16-byte aligned, contiguous rows.
  const bool one_pass_ok = ld_dy == n && dense_grad_pass_supported(n, dy, act_grad, buf);
  BiasGradPath path = kernel_variants().dense_bias_grad;
  if (path == BiasGradPath::kEpilogue && d_weight == nullptr) path = BiasGradPath::kOnePass;
  if (path == BiasGradPath::kOnePass && !one_pass_ok) path = BiasGradPath::kSeparate;
  bool bias_done = d_bias == nullptr;

  if (gelu) {
    if (path == BiasGradPath::kOnePass && d_bias) {
      grad_pass(dy, act_grad, buf, rows, n, d_bias);
      bias_done = true;
    } else if (path != BiasGradPath::kSeparate && one_pass_ok) {  // dpre alone
      grad_pass(dy, act_grad, buf, rows, n, nullptr);
    } else {
      launch_scale(dev(dy), dev(act_grad), dev(buf), rows * n, stream_);
    }
  }
  if (dx) gemm_->run(dx_product(gemm_type<A>(), weight, dpre, ld_dpre, rows, k, n, dx, accumulate_dx), stream_);
  if (d_weight) {
    GemmProblem p = dw_product(gemm_type<A>(), x, dpre, ld_dpre, rows, k, n, d_weight);
    bool ran = false;
    if (path == BiasGradPath::kEpilogue && !bias_done) {
      p.bias_grad = static_cast<float*>(scratch(kBiasGrad, sizeof(float) * static_cast<size_t>(n)));
      ran = gemm_->try_run(p, stream_);
      if (ran) {
        launch_column_finish(p.bias_grad, 1, n, 1, d_bias, nullptr, nullptr, stream_);  // d_bias += column sums
        bias_done = true;
      } else {
        path = ld_dpre == n && dense_grad_pass_supported(n, dpre, nullptr, nullptr) ? BiasGradPath::kOnePass
                                                                                    : BiasGradPath::kSeparate;
      }
      p.bias_grad = nullptr;
    }
    if (!ran) gemm_->run(p, stream_);
  }
  if (!bias_done) {
    if (path == BiasGradPath::kOnePass) {  // column sums of dpre (or dy) alone
      grad_pass(dpre, nullptr, nullptr, rows, n, d_bias);
    } else {
      column_sums_accumulate(dpre, rows, n, d_bias, ld_dpre);
      path = BiasGradPath::kSeparate;
    }
  }
  if (d_bias) last_bias_grad_path() = path;
}

// dx_pre = (dy W) * x_act_grad, d_x_bias += its column sums, d_weight += dy^T x. KernelVariants::dgelu_gemm: nopad's
// sm_90a GEMM with the scale and the column partials in its epilogue; else the plain product into scratch and the
// one-pass scale + column-sum kernel (the traffic of dense_backward's GELU path).
template <class P>
void CudaBackendT<P>::dense_backward_through_act(const A* dy, const A* x, const A* x_act_grad, const W* weight,
                                                 int64_t rows, int32_t k, int32_t n, ops::Activation x_act,
                                                 A* dx_pre, G* d_weight, G* d_x_bias) {
  OpScope timed(*this, "dense_bwd_act", k, n);
  NOPAD_CHECK(x_act != ops::Activation::kNone, "dense_backward_through_act needs an activation");
  NOPAD_CHECK(x_act_grad != nullptr && dx_pre != nullptr, "dense_backward_through_act needs x_act_grad and dx_pre");
  if (rows == 0) return;
  if (kernel_variants().dgelu_gemm &&
      gemm_sm90_supported(rows, k, n, dy, weight, dx_pre, nullptr, x_act_grad, nullptr)) {
    // nopad's GEMM: dx_pre = (dy W) * x_act_grad and the column partials of d_x_bias from the accumulators. Its B
    // operand is K-major: W [n, k] transposed into scratch first (k x n 16-bit, a few microseconds).
    A* w_t = static_cast<A*>(scratch(kWeightT, sizeof(A) * static_cast<size_t>(k) * n));
    launch_transpose16(dev(weight), n, k, dev(w_t), stream_);
    float* partial = nullptr;
    const int chunks = gemm_sm90_row_chunks(rows);
    if (d_x_bias)
      partial = static_cast<float*>(scratch(kColPartials, sizeof(float) * chunks * static_cast<size_t>(k)));
    launch_gemm_sm90<device_t<A>>(GemmEpilogue::kScale, dev(dy), dev(w_t), rows, k, n, nullptr, dev(dx_pre), nullptr,
                                  dev(x_act_grad), partial, false, sm_count_, stream_);
    if (d_x_bias) launch_column_finish(partial, chunks, k, 1, d_x_bias, nullptr, nullptr, stream_);
    last_gelu_path() = GeluPath::kGemmSm90;
  } else {  // dy W into scratch, then the scale (+ column sums) into dx_pre
    A* buf = static_cast<A*>(scratch(kDpre, sizeof(A) * static_cast<size_t>(rows) * k));
    gemm_->run(dx_product(gemm_type<A>(), weight, dy, n, rows, k, n, buf, false), stream_);
    if (dense_grad_pass_supported(k, buf, x_act_grad, dx_pre)) {
      grad_pass(buf, x_act_grad, dx_pre, rows, k, d_x_bias);
    } else {
      launch_scale(dev(buf), dev(x_act_grad), dev(dx_pre), rows * int64_t{k}, stream_);
      if (d_x_bias) column_sums_accumulate(dx_pre, rows, k, d_x_bias);
    }
    last_gelu_path() = GeluPath::kKernel;
  }
  if (d_weight) gemm_->run(dw_product(gemm_type<A>(), x, dy, n, rows, k, n, d_weight), stream_);
}

// ------------------------------------------------------------------------------------------------ attention

namespace {
FmhaParams fmha_params(const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim, const ops::Dropout& drop,
                       bool fp16) {
  NOPAD_CHECK(drop.p >= 0.0f && drop.p < 1.0f, "dropout probability must be in [0, 1), got ", drop.p);
  NOPAD_CHECK(num_heads > 0 && head_dim > 0, "attention needs num_heads > 0 and head_dim > 0");
  FmhaParams p;
  p.cu_seqlens = seqs.cu_seqlens;
  p.sample_ids = seqs.sample_ids;
  p.seq_index = nullptr;
  p.num_seqs = seqs.num_seqs;
  p.num_launch_seqs = seqs.num_seqs;
  p.num_tokens = seqs.num_tokens;
  p.max_seqlen = seqs.max_seqlen;
  p.num_heads = num_heads;
  p.head_dim = head_dim;
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.dropout_p = drop.p;
  p.seed = drop.seed;
  p.step = drop.step;
  p.op_id = drop.op_id;
  p.fp16 = fp16;
  return p;
}
}  // namespace

template <class P>
void CudaBackendT<P>::attention_forward(const A* qkv, const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                    const ops::Dropout& drop, A* ctx, St* lse) {
  OpScope timed(*this, "attention_fwd");
  require_whole_sequences(seqs, "attention_forward");
  check_seqs(seqs, drop.p > 0.0f);
  if (seqs.num_tokens == 0) return;
  FmhaParams p = fmha_params(seqs, num_heads, head_dim, drop, std::is_same_v<A, nopad::f16>);
  p.qkv = qkv;
  p.ctx = ctx;
  p.lse = lse;
  if (plan_attention_launches(seqs)) {
    fmha_forward_planned(p, seqs.by_length, attn_plan_, *attn_streams_, stream_);
  } else {
    fmha_forward(p, stream_);
  }
}

// Query rows (attention_*_rows): one plain launch (no grouping) with FmhaParams' query fields. The host knows the
// most queries of a sequence only through the view's max_seqlen (the model sets it); the kernels read the rest.
// fmha_forward / fmha_backward validate the fields (validate_common); only the sequence count is the view's own.
namespace {
void set_query_rows(FmhaParams& p, const void* q_qkv, const ops::SeqView& q_seqs, const ops::SeqView& seqs,
                    const char* op) {
  ops::require_query_rows(seqs, q_seqs, op);
  p.q_qkv = q_qkv;
  p.q_cu_seqlens = q_seqs.cu_seqlens;
  p.q_positions = q_seqs.row_positions;
  p.num_q_tokens = q_seqs.num_tokens;
  p.max_q_seqlen = q_seqs.max_seqlen;
}
}  // namespace

template <class P>
void CudaBackendT<P>::attention_forward_rows(const A* qkv, const ops::SeqView& seqs, const A* q_qkv,
                                             const ops::SeqView& q_seqs, int32_t num_heads, int32_t head_dim,
                                             const ops::Dropout& drop, A* ctx, St* lse) {
  OpScope timed(*this, "attention_fwd");
  require_whole_sequences(seqs, "attention_forward_rows");
  check_seqs(seqs, drop.p > 0.0f);
  if (seqs.num_tokens == 0 || q_seqs.num_tokens == 0) return;
  FmhaParams p = fmha_params(seqs, num_heads, head_dim, drop, std::is_same_v<A, nopad::f16>);
  p.qkv = qkv;
  p.ctx = ctx;
  p.lse = lse;
  set_query_rows(p, q_qkv, q_seqs, seqs, "attention_forward_rows");
  fmha_forward(p, stream_);
}

template <class P>
void CudaBackendT<P>::attention_backward(const A* d_ctx, const A* qkv, const A* ctx, const St* lse,
                                     const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                     const ops::Dropout& drop, A* d_qkv, G* d_qkv_bias) {
  OpScope timed(*this, "attention_bwd");
  require_whole_sequences(seqs, "attention_backward");
  attention_backward_impl(d_ctx, qkv, seqs, nullptr, nullptr, ctx, lse, num_heads, head_dim, drop, d_qkv, d_qkv_bias);
}

template <class P>
void CudaBackendT<P>::attention_output_backward(const A* dy, const W* w_out, const A* qkv, const A* ctx, const St* lse,
                                                const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                                const ops::Dropout& drop, A* d_ctx, G* d_w_out, A* d_qkv,
                                                G* d_qkv_bias) {
  static_assert(std::is_same_v<St, float>, "the FMHA workspace is fp32");
  const int32_t H = num_heads * head_dim, T = seqs.num_tokens;
  // One box of the GEMM's tile (64 columns) is one head's columns.
  const bool fuse = std::is_same_v<A, W> && kernel_variants().attention_prep_gemm && head_dim == 64 && T > 0 &&
                    gemm_sm90_supported(T, H, H, dy, w_out, d_ctx, nullptr, ctx, nullptr);
  last_attention_output_fused() = fuse;
  if (!fuse) {
    ops::Backend<P>::attention_output_backward(dy, w_out, qkv, ctx, lse, seqs, num_heads, head_dim, drop, d_ctx,
                                               d_w_out, d_qkv, d_qkv_bias);
    return;
  }
  require_whole_sequences(seqs, "attention_output_backward");
  check_seqs(seqs, drop.p > 0.0f);
  // d_w_out += dy^T ctx (cuBLASLt), alone.
  dense_backward(dy, ctx, w_out, nullptr, T, H, H, ops::Activation::kNone, nullptr, false, d_w_out, nullptr);
  {
    OpScope timed(*this, "dense_bwd_rowdot", H, H);
    // The workspace as attention_backward_impl takes it (grow-only, so the same buffer).
    const FmhaWorkspaceLayout ws = fmha_backward_workspace_layout(T, num_heads, head_dim);
    char* base = static_cast<char*>(scratch(kFmhaWorkspace, ws.total_bytes));
    // The B operand is K-major: w_out [H, H] transposed into scratch (as dense_backward_through_act).
    A* w_t = static_cast<A*>(scratch(kWeightT, sizeof(A) * static_cast<size_t>(H) * H));
    launch_transpose16(dev(w_out), H, H, dev(w_t), stream_);
    // The zeroing costs about as much wherever it runs (measured: a memset, these idle warps, or those of the FFN-out
    // dx product before this op; docs/performance.md): here it needs no state across ops.
    GemmSideJobs jobs;
    jobs.zero = base;
    jobs.zero_bytes = ws.zero_bytes;
    jobs.mul_src = lse;
    jobs.mul_dst = reinterpret_cast<float*>(base + ws.lse2_offset);
    jobs.mul_count = int64_t{num_heads} * T;
    jobs.mul_by = kFmhaLog2e;
    launch_gemm_sm90_rowdot<device_t<A>>(dev(dy), dev(w_t), T, H, H, dev(d_ctx), dev(ctx),
                                         reinterpret_cast<float*>(base + ws.d_offset), T,
                                         fmha_backward_d_scale(drop.p), jobs, sm_count_, stream_);
  }
  OpScope timed(*this, "attention_bwd");
  attention_backward_impl(d_ctx, qkv, seqs, nullptr, nullptr, ctx, lse, num_heads, head_dim, drop, d_qkv, d_qkv_bias,
                          /*prepared=*/true);
}

template <class P>
void CudaBackendT<P>::attention_backward_rows(const A* d_ctx, const A* qkv, const ops::SeqView& seqs, const A* q_qkv,
                                              const ops::SeqView& q_seqs, const A* ctx, const St* lse,
                                              int32_t num_heads, int32_t head_dim, const ops::Dropout& drop,
                                              A* d_qkv, G* d_qkv_bias) {
  OpScope timed(*this, "attention_bwd");
  require_whole_sequences(seqs, "attention_backward_rows");
  attention_backward_impl(d_ctx, qkv, seqs, q_qkv, &q_seqs, ctx, lse, num_heads, head_dim, drop, d_qkv, d_qkv_bias);
}

// Both backward ops: every row a query (q_seqs null; grouped launches where the schedule says so) or the query rows
// of q_seqs (one launch).
template <class P>
void CudaBackendT<P>::attention_backward_impl(const A* d_ctx, const A* qkv, const ops::SeqView& seqs, const A* q_qkv,
                                              const ops::SeqView* q_seqs, const A* ctx, const St* lse,
                                              int32_t num_heads, int32_t head_dim, const ops::Dropout& drop,
                                              A* d_qkv, G* d_qkv_bias, bool prepared) {
  static_assert(std::is_same_v<G, float>, "FmhaParams::d_qkv_bias is fp32");
  check_seqs(seqs, drop.p > 0.0f);
  if (seqs.num_tokens == 0) return;
  FmhaParams p = fmha_params(seqs, num_heads, head_dim, drop, std::is_same_v<A, nopad::f16>);
  p.qkv = qkv;
  p.ctx = const_cast<A*>(ctx);    // FmhaParams::ctx is the forward's output; backward only reads it
  p.lse = const_cast<St*>(lse);   // likewise
  p.d_ctx = d_ctx;
  p.d_qkv = d_qkv;
  p.prepared = prepared;
  if (q_seqs != nullptr) set_query_rows(p, q_qkv, *q_seqs, seqs, "attention_backward_rows");
  // The bias gradient from the kernels' registers where they take it, else by the column-sum pass after.
  const bool bias_in_kernels =
      kernel_variants().qkv_bias_in_attention && fmha_backward_bias_supported(num_heads, head_dim);
  p.d_qkv_bias = bias_in_kernels ? d_qkv_bias : nullptr;
  // The workspace is ours, grown once to the largest size seen. fmha_backward initialises the part of it that its
  // launch uses (fmha.h), so it needs no memset here.
  p.workspace_bytes =
      fmha_backward_workspace_bytes(q_seqs != nullptr ? q_seqs->num_tokens : seqs.num_tokens, num_heads, head_dim);
  if (p.workspace_bytes > 0) p.workspace = scratch(kFmhaWorkspace, p.workspace_bytes);
  if (q_seqs == nullptr && plan_attention_launches(seqs)) {
    fmha_backward_planned(p, seqs.by_length, attn_plan_, *attn_streams_, stream_);
  } else {
    fmha_backward(p, stream_);
  }
  if (d_qkv_bias && !bias_in_kernels) {  // the q and v blocks; the k bias has no gradient (ops.h)
    const int32_t H = num_heads * head_dim;
    column_sums_accumulate(d_qkv, seqs.num_tokens, H, d_qkv_bias, 3 * int64_t{H});
    column_sums_accumulate(d_qkv + 2 * H, seqs.num_tokens, H, d_qkv_bias + 2 * H, 3 * int64_t{H});
  }
}

// Cuts the grouped launches of one attention call from the batch's host-side length order (ops/attention_groups.h);
// false: one plain launch (kSingle, or the caller gave no order).
template <class P>
bool CudaBackendT<P>::plan_attention_launches(const ops::SeqView& seqs) {
  if (attn_schedule_.mode == ops::AttentionMode::kSingle || seqs.by_length == nullptr ||
      seqs.host_by_length == nullptr || seqs.host_cu_seqlens == nullptr)
    return false;
  ops::plan_attention(seqs.host_cu_seqlens, seqs.host_by_length, seqs.num_seqs, attn_schedule_, attn_plan_);
  return true;
}

// ------------------------------------------------------------------------------------------------ residual + LN

template <class P>
void CudaBackendT<P>::bias_dropout_residual_layernorm_forward(const A* x, const W* bias, const A* residual,
                                                          const W* ln_gamma, const W* ln_beta,
                                                          const ops::SeqView& seqs, int32_t hidden, double ln_eps,
                                                          const ops::Dropout& drop, A* out, St* ln_mean,
                                                          St* ln_rstd) {
  OpScope timed(*this, "bdrln_fwd");
  LnArgs<device_t<A>> a;
  a.drop = dropout_args(drop);
  check_seqs(seqs, a.drop.p > 0.0f);
  NOPAD_CHECK(bias != nullptr, "bias_dropout_residual_layernorm needs a bias");
  a.rows = seqs.num_tokens;
  a.H = hidden;
  a.eps = static_cast<float>(ln_eps);
  a.gamma = dev(ln_gamma);
  a.beta = dev(ln_beta);
  a.x = dev(x);
  a.bias = dev(bias);
  a.residual = dev(residual);
  a.cu_seqlens = seqs.cu_seqlens;
  a.sample_ids = seqs.sample_ids;
  a.row_pos = seqs.row_positions;
  a.num_seqs = seqs.num_seqs;
  a.out = dev(out);
  a.mean_out = ln_mean;
  a.rstd_out = ln_rstd;
  launch_ln_forward(LnKind::kResidual, a, kernel_variants().ln_forward, sm_count_, stream_);
}

template <class P>
void CudaBackendT<P>::bias_dropout_residual_layernorm_backward(const A* d_out, const A* x, const W* bias,
                                                           const A* residual, const W* ln_gamma, const St* ln_mean,
                                                           const St* ln_rstd, const ops::SeqView& seqs,
                                                           int32_t hidden, const ops::Dropout& drop, A* d_x,
                                                           A* d_residual, G* d_bias, G* d_ln_gamma, G* d_ln_beta) {
  OpScope timed(*this, "bdrln_bwd");
  NOPAD_CHECK(d_residual != d_out, "bias_dropout_residual_layernorm_backward: d_residual must not alias d_out");
  LnArgs<device_t<A>> a;
  a.drop = dropout_args(drop);
  check_seqs(seqs, a.drop.p > 0.0f);
  if (seqs.num_tokens == 0) return;
  a.rows = seqs.num_tokens;
  a.H = hidden;
  a.gamma = dev(ln_gamma);
  a.x = dev(x);
  a.bias = dev(bias);
  a.residual = dev(residual);
  a.cu_seqlens = seqs.cu_seqlens;
  a.sample_ids = seqs.sample_ids;
  a.row_pos = seqs.row_positions;
  a.num_seqs = seqs.num_seqs;
  a.d_out = dev(d_out);
  a.mean = ln_mean;
  a.rstd = ln_rstd;
  a.dz = dev(d_residual);
  a.d_x = dev(d_x);
  const LnVariant& v = kernel_variants().ln_backward;
  const int blocks = ln_backward_blocks<device_t<A>>(LnKind::kResidual, hidden, a.rows, v, sm_count_);
  a.partial = static_cast<float*>(scratch(kLnPartials, sizeof(float) * blocks * 3 * static_cast<size_t>(hidden)));
  launch_ln_backward(LnKind::kResidual, a, v, blocks, stream_);
  launch_column_finish(a.partial, blocks, hidden, 3, d_ln_gamma, d_ln_beta, d_bias, stream_);
}

template <class P>
void CudaBackendT<P>::layernorm_plain_forward(const A* x, const W* gamma, const W* beta, int64_t rows, int32_t H,
                                          double eps, A* out, St* mean, St* rstd) {
  LnArgs<device_t<A>> a;
  a.rows = rows;
  a.H = H;
  a.eps = static_cast<float>(eps);
  a.gamma = dev(gamma);
  a.beta = dev(beta);
  a.x = dev(x);
  a.out = dev(out);
  a.mean_out = mean;
  a.rstd_out = rstd;
  launch_ln_forward(LnKind::kPlain, a, kernel_variants().ln_forward, sm_count_, stream_);
}

template <class P>
void CudaBackendT<P>::layernorm_plain_backward(const A* dy, const A* x, const St* mean, const St* rstd, const W* gamma,
                                           int64_t rows, int32_t H, A* dz, G* d_gamma, G* d_beta) {
  if (rows == 0) return;
  LnArgs<device_t<A>> a;
  a.rows = rows;
  a.H = H;
  a.gamma = dev(gamma);
  a.x = dev(x);
  a.d_out = dev(dy);
  a.mean = mean;
  a.rstd = rstd;
  a.dz = dev(dz);
  const LnVariant& v = kernel_variants().ln_backward;
  const int blocks = ln_backward_blocks<device_t<A>>(LnKind::kPlain, H, rows, v, sm_count_);
  a.partial = static_cast<float*>(scratch(kLnPartials, sizeof(float) * blocks * 2 * static_cast<size_t>(H)));
  launch_ln_backward(LnKind::kPlain, a, v, blocks, stream_);
  launch_column_finish(a.partial, blocks, H, 2, d_gamma, d_beta, nullptr, stream_);
}

// ------------------------------------------------------------------------------------------------ row gather / scatter

template <class P>
void CudaBackendT<P>::gather_rows(const A* src, int64_t /*src_rows: rows are device data, not checked here*/,
                                  const int32_t* rows, int32_t n, int32_t width, A* dst) {
  OpScope timed(*this, "gather_rows");
  NOPAD_CHECK(n >= 0, "gather_rows: negative row count");
  launch_gather_rows(dev(src), rows, n, width, dev(dst), stream_);
}

template <class P>
void CudaBackendT<P>::scatter_rows(const A* src, const int32_t* rows, int32_t n, int32_t width, A* dst,
                                   int64_t /*dst_rows*/, bool accumulate) {
  OpScope timed(*this, "scatter_rows");
  NOPAD_CHECK(n >= 0, "scatter_rows: negative row count");
  launch_scatter_rows(dev(src), rows, n, width, dev(dst), accumulate, stream_);
}

// ------------------------------------------------------------------------------------------------ MLM head

template <class P>
void CudaBackendT<P>::mlm_head_loss_forward(const A* hidden, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                        int32_t num_masked, const ops::MlmHeadWeights<W>& w,
                                        const ops::MlmHeadSaved<A, St>& saved, St* loss_sum, int32_t* num_correct) {
  OpScope timed(*this, "mlm_head_fwd");
  const int32_t H = w.hidden, V = w.vocab_size, M = num_masked;
  NOPAD_CUDA_CHECK(cudaMemsetAsync(loss_sum, 0, sizeof(St), stream_));
  NOPAD_CUDA_CHECK(cudaMemsetAsync(num_correct, 0, sizeof(int32_t), stream_));
  if (M == 0) return;
  launch_gather_rows(dev(hidden), mlm_positions, M, H, dev(saved.gathered), stream_);
  dense_forward(saved.gathered, w.transform_weight, w.transform_bias, M, H, H, w.act,
                saved.transform_act, saved.transform_act_grad);
  layernorm_plain_forward(saved.transform_act, w.ln_gamma, w.ln_beta, M, H, w.ln_eps, saved.ln_out, saved.ln_mean,
                          saved.ln_rstd);
  // Decoder with the tied word embeddings: logits [M, V] land in saved.probs and become probabilities in place.
  // Rows of the logits are probs_ld apart (mlm_logits_row_stride: V padded to 16 bytes). With the weights' zero
  // padding rows (w.padded_vocab) the decoder's products run over all padded columns, whose logits come out 0 and
  // are never read: cuBLASLt picks its aligned Hopper kernels only when that dimension is a multiple of 8 too.
  const int64_t ld = saved.probs_ld > 0 ? saved.probs_ld : V;
  const int32_t Vg = decoder_columns(w, ld);
  dense_forward_ld(saved.ln_out, w.word_embeddings, w.output_bias, M, H, Vg, ops::Activation::kNone, saved.probs,
                   nullptr, ld);
  launch_softmax_ce_forward(dev(saved.probs), mlm_labels, M, V, ld, loss_sum, num_correct,
                            kernel_variants().softmax_ce_registers, stream_);
}

template <class P>
void CudaBackendT<P>::mlm_head_loss_backward(double loss_scale, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                         int32_t num_masked, const ops::MlmHeadWeights<W>& w,
                                         const ops::MlmHeadSaved<A, St>& saved, const ops::MlmHeadGrads<G>& g,
                                         A* d_hidden) {
  OpScope timed(*this, "mlm_head_bwd");
  const int32_t H = w.hidden, V = w.vocab_size, M = num_masked;
  if (M == 0) return;
  const int64_t ld = saved.probs_ld > 0 ? saved.probs_ld : V;
  launch_ce_backward(dev(saved.probs), mlm_labels, M, V, ld, static_cast<float>(loss_scale),
                     kernel_variants().ce_backward_rows, stream_);
  A* d_ln_out = static_cast<A*>(scratch(kHeadA, sizeof(A) * static_cast<size_t>(M) * H));
  // d_ln_out = d_logits W_emb; d_word_embeddings += d_logits^T ln_out; d_output_bias += column sums of d_logits.
  // Over the padded columns too (decoder_columns): their d_logits are the forward's zeros, untouched by the CE
  // gradient, so the padding rows of d_word_embeddings and d_output_bias receive += 0.
  dense_backward_ld(saved.probs, saved.ln_out, w.word_embeddings, nullptr, M, H, decoder_columns(w, ld),
                    ops::Activation::kNone, d_ln_out, false, g.d_word_embeddings, g.d_output_bias, ld);
  A* d_act = static_cast<A*>(scratch(kHeadB, sizeof(A) * static_cast<size_t>(M) * H));
  layernorm_plain_backward(d_ln_out, saved.transform_act, saved.ln_mean, saved.ln_rstd, w.ln_gamma, M, H, d_act,
                           g.d_ln_gamma, g.d_ln_beta);
  A* d_gathered = d_ln_out;  // free again: reuse
  dense_backward(d_act, saved.gathered, w.transform_weight, saved.transform_act_grad, M, H, H, w.act,
                 d_gathered, false, g.d_transform_weight, g.d_transform_bias);
  // Each masked position appears once per batch (the loader's contract), so rows are added without atomics.
  launch_scatter_rows(dev(d_gathered), mlm_positions, M, H, dev(d_hidden), /*accumulate=*/true, stream_);
}

// ------------------------------------------------------------------------------------------------ NSP head

template <class P>
void CudaBackendT<P>::nsp_head_loss_forward(const A* hidden, const ops::SeqView& seqs, const int32_t* nsp_labels,
                                        const ops::NspHeadWeights<W>& w, const ops::NspHeadSaved<A>& saved,
                                        St* loss_sum, int32_t* num_correct) {
  OpScope timed(*this, "nsp_head_fwd");
  const int32_t H = w.hidden, B = seqs.num_seqs;
  NOPAD_CUDA_CHECK(cudaMemsetAsync(loss_sum, 0, sizeof(St), stream_));
  NOPAD_CUDA_CHECK(cudaMemsetAsync(num_correct, 0, sizeof(int32_t), stream_));
  if (B == 0) return;
  launch_gather_rows(dev(hidden), seqs.cu_seqlens, B, H, dev(saved.cls), stream_);  // row cu_seqlens[b] = CLS
  dense_forward(saved.cls, w.pooler_weight, w.pooler_bias, B, H, H, ops::Activation::kNone, saved.pooled, nullptr);
  launch_tanh_forward(dev(saved.pooled), int64_t{B} * H, stream_);
  dense_forward(saved.pooled, w.classifier_weight, w.classifier_bias, B, H, 2, ops::Activation::kNone, saved.probs,
                nullptr);
  launch_softmax_ce_forward(dev(saved.probs), nsp_labels, B, 2, 2, loss_sum, num_correct,
                            kernel_variants().softmax_ce_registers, stream_);
}

template <class P>
void CudaBackendT<P>::nsp_head_loss_backward(double loss_scale, const ops::SeqView& seqs, const int32_t* nsp_labels,
                                         const ops::NspHeadWeights<W>& w, const ops::NspHeadSaved<A>& saved,
                                         const ops::NspHeadGrads<G>& g, A* d_hidden) {
  OpScope timed(*this, "nsp_head_bwd");
  const int32_t H = w.hidden, B = seqs.num_seqs;
  if (B == 0) return;
  launch_ce_backward(dev(saved.probs), nsp_labels, B, 2, 2, static_cast<float>(loss_scale),
                     kernel_variants().ce_backward_rows, stream_);
  A* d_pooled = static_cast<A*>(scratch(kHeadA, sizeof(A) * static_cast<size_t>(B) * H));
  dense_backward(saved.probs, saved.pooled, w.classifier_weight, nullptr, B, H, 2, ops::Activation::kNone, d_pooled,
                 false, g.d_classifier_weight, g.d_classifier_bias);
  launch_tanh_backward(dev(d_pooled), dev(saved.pooled), int64_t{B} * H, stream_);
  A* d_cls = static_cast<A*>(scratch(kHeadB, sizeof(A) * static_cast<size_t>(B) * H));
  dense_backward(d_pooled, saved.cls, w.pooler_weight, nullptr, B, H, H, ops::Activation::kNone, d_cls, false,
                 g.d_pooler_weight, g.d_pooler_bias);
  launch_scatter_rows(dev(d_cls), seqs.cu_seqlens, B, H, dev(d_hidden), /*accumulate=*/true, stream_);
}

template class CudaBackendT<ops::GpuBf16>;
template class CudaBackendT<ops::GpuF16>;

}  // namespace nopad::cuda
