// The CUDA backend: ops::Backend<P> on one GPU for the two 16-bit policies, CudaBackend (ops::GpuBf16) and
// CudaBackendF16 (ops::GpuF16). Activations and weight copies are bf16 or fp16, parameter gradients and statistics
// fp32; all arithmetic inside the kernels is fp32 and the GEMMs accumulate in fp32. Contracts are those of
// ops/ops.h, and each op computes what its CPU twin (ops/cpu/cpu_backend.cpp, CpuBackend<CpuF32>) computes, dropout
// masks included bit for bit (core/philox.h); tests/cuda/test_cuda_ops.cpp checks every op of both against the twin.
// fp16 overflows to +-inf beyond 65504: a loss-scaled backward that overflows leaves non-finite gradients, which the
// optimiser detects (FusedLamb skips the step); the backend itself never checks values.
//
// Execution model: every op enqueues work on the backend's own stream (stream()) and returns without waiting; only
// download_bytes and synchronize wait. Nothing is allocated per call in steady state: the stream, the cuBLASLt
// handle and its 32 MiB workspace are made in the constructor, and scratch buffers grow on first use to the largest
// size seen and are then reused (stream-ordered cudaMallocAsync/cudaFreeAsync on growth only).
// The constructor makes `device` current for the calling thread; the ops assume it stays current.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/attention_groups.h"
#include "ops/ops.h"

namespace nopad::cuda {

class LtGemm;       // dense.h
class FmhaStreams;  // fmha.h

// P: ops::GpuBf16 or ops::GpuF16 (explicitly instantiated in cuda_backend.cu; the aliases below).
template <class P>
class CudaBackendT final : public ops::Backend<P> {
 public:
  using A = typename P::Act;
  using W = typename P::Weight;
  using G = typename P::Grad;
  using St = typename P::Stat;
  static_assert(std::is_same_v<A, W> && (std::is_same_v<A, bf16> || std::is_same_v<A, f16>),
                "the CUDA backend runs activations and weights of one 16-bit type");
  static_assert(std::is_same_v<G, float> && std::is_same_v<St, float>, "gradients and statistics are fp32");

  // Throws nopad::Error ("no CUDA device: ... use --device cpu") when no usable device exists.
  explicit CudaBackendT(int device = 0);
  ~CudaBackendT() override;
  CudaBackendT(const CudaBackendT&) = delete;
  CudaBackendT& operator=(const CudaBackendT&) = delete;

  const char* name() const override { return "cuda"; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  int multiprocessors() const { return sm_count_; }

  void* allocate_bytes(size_t bytes) override;  // cudaMalloc: setup time only; throws OutOfMemory when full
  size_t allocated_bytes() const { return allocated_bytes_; }  // through allocate_bytes, not freed ones subtracted
  void free_bytes(void* ptr) override;
  void upload_bytes(void* dst, const void* host_src, size_t bytes) override;      // ordered on stream(), no wait
  void download_bytes(void* host_dst, const void* src, size_t bytes) override;    // waits for stream()
  void zero_bytes(void* x, size_t bytes) override;                                // cudaMemsetAsync on stream()
  void synchronize() override;                                                    // waits for both streams

  // Copies beside compute (ops.h): async uploads run on copy_stream(), ordered against stream() with events; async
  // downloads go through a pinned ring on stream() and are completed by wait_download (an event wait).
  void upload_bytes_async(void* dst, const void* host_src, size_t bytes) override;
  void compute_waits_for_uploads() override;
  uint64_t fence_compute() override;
  void uploads_wait(uint64_t fence) override;
  uint64_t download_bytes_async(void* host_dst, const void* src, size_t bytes) override;
  void wait_download(uint64_t ticket) override;
  cudaStream_t copy_stream() const { return copy_stream_; }
  // While stream() is being captured into a CUDA graph: async uploads complete on the host at capture time (the
  // graph reuses the uploaded batch), fences and async downloads are skipped (no cross-stream nodes, no pinned
  // slots baked into the graph). For the benchmark's launch-overhead measurement only.
  void set_capture_mode(bool on) { capture_mode_ = on; }

  // How attention calls are launched (ops/attention_groups.h: single, sorted or grouped over streams; the default
  // from attention_schedule_from_env()). Setup time only: not while work of a step is being enqueued.
  void set_attention_schedule(const ops::AttentionSchedule& s);
  const ops::AttentionSchedule& attention_schedule() const { return attn_schedule_; }

  // Per-op GPU timing (the benchmark's breakdown). When on, each public op is bracketed by two events on stream()
  // from a grow-only pool; an op called from inside another counts towards the outer one. When off: one branch.
  void set_op_timing(bool on) { op_timing_ = on; }
  bool op_timing() const { return op_timing_; }
  // Synchronises, folds the recorded events into per-name totals and returns them: ms since reset_op_times().
  // Dense ops are named by shape ("dense_fwd k=1024 n=3072").
  std::vector<std::pair<std::string, double>> op_times_ms();
  void reset_op_times();  // synchronises and clears the totals

  void embed_layernorm_dropout_forward(const int32_t* tokens, const int32_t* positions, const int32_t* segments,
                                       const ops::SeqView& seqs, const ops::EmbeddingWeights<W>& w,
                                       const ops::Dropout& drop, A* out, St* ln_mean, St* ln_rstd) override;
  void embed_layernorm_dropout_backward(const A* d_out, const int32_t* tokens, const int32_t* positions,
                                        const int32_t* segments, const ops::SeqView& seqs,
                                        const ops::EmbeddingWeights<W>& w, const ops::Dropout& drop,
                                        const St* ln_mean, const St* ln_rstd,
                                        const ops::EmbeddingGrads<G>& g) override;
  void dense_forward(const A* x, const W* weight, const W* bias, int64_t rows, int32_t k, int32_t n,
                     ops::Activation act, A* y, A* act_grad) override {
    dense_forward_ld(x, weight, bias, rows, k, n, act, y, act_grad, n);
  }
  void dense_backward(const A* dy, const A* x, const W* weight, const A* act_grad, int64_t rows, int32_t k, int32_t n,
                      ops::Activation act, A* dx, bool accumulate_dx, G* d_weight, G* d_bias) override {
    dense_backward_ld(dy, x, weight, act_grad, rows, k, n, act, dx, accumulate_dx, d_weight, d_bias, n);
  }
  int64_t mlm_logits_row_stride(int32_t V) const override { return (int64_t{V} + 7) / 8 * 8; }
  // Columns the MLM decoder's products run over: the weights' padded vocabulary when the logits rows have room.
  static int32_t decoder_columns(const ops::MlmHeadWeights<W>& w, int64_t ld) {
    return w.padded_vocab > w.vocab_size && w.padded_vocab <= ld ? w.padded_vocab : w.vocab_size;
  }
  void dense_backward_through_act(const A* dy, const A* x, const A* x_act_grad, const W* weight, int64_t rows,
                                  int32_t k, int32_t n, ops::Activation x_act, A* dx_pre, G* d_weight,
                                  G* d_x_bias) override;
  void attention_forward(const A* qkv, const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim,
                         const ops::Dropout& drop, A* ctx, St* lse) override;
  void attention_backward(const A* d_ctx, const A* qkv, const A* ctx, const St* lse, const ops::SeqView& seqs,
                          int32_t num_heads, int32_t head_dim, const ops::Dropout& drop, A* d_qkv,
                          G* d_qkv_bias) override;
  // Fused where nopad's sm_90a GEMM runs (head_dim 64, H % 256 == 0; KernelVariants::attention_prep_gemm): d_ctx
  // by launch_gemm_sm90_rowdot, whose epilogue writes the FMHA backward's D and whose idle warps write lse2 and zero
  // the dQ accumulator, so the backward skips its first pass (FmhaParams::prepared). Elsewhere the two ops.
  void attention_output_backward(const A* dy, const W* w_out, const A* qkv, const A* ctx, const St* lse,
                                 const ops::SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                 const ops::Dropout& drop, A* d_ctx, G* d_w_out, A* d_qkv, G* d_qkv_bias) override;
  void attention_forward_rows(const A* qkv, const ops::SeqView& seqs, const A* q_qkv, const ops::SeqView& q_seqs,
                              int32_t num_heads, int32_t head_dim, const ops::Dropout& drop, A* ctx,
                              St* lse) override;
  void attention_backward_rows(const A* d_ctx, const A* qkv, const ops::SeqView& seqs, const A* q_qkv,
                               const ops::SeqView& q_seqs, const A* ctx, const St* lse, int32_t num_heads,
                               int32_t head_dim, const ops::Dropout& drop, A* d_qkv, G* d_qkv_bias) override;
  void bias_dropout_residual_layernorm_forward(const A* x, const W* bias, const A* residual, const W* ln_gamma,
                                               const W* ln_beta, const ops::SeqView& seqs, int32_t hidden,
                                               double ln_eps, const ops::Dropout& drop, A* out, St* ln_mean,
                                               St* ln_rstd) override;
  void bias_dropout_residual_layernorm_backward(const A* d_out, const A* x, const W* bias, const A* residual,
                                                const W* ln_gamma, const St* ln_mean, const St* ln_rstd,
                                                const ops::SeqView& seqs, int32_t hidden, const ops::Dropout& drop,
                                                A* d_x, A* d_residual, G* d_bias, G* d_ln_gamma,
                                                G* d_ln_beta) override;
  void gather_rows(const A* src, int64_t src_rows, const int32_t* rows, int32_t n, int32_t width, A* dst) override;
  void scatter_rows(const A* src, const int32_t* rows, int32_t n, int32_t width, A* dst, int64_t dst_rows,
                    bool accumulate) override;
  void mlm_head_loss_forward(const A* hidden, const int32_t* mlm_positions, const int32_t* mlm_labels,
                             int32_t num_masked, const ops::MlmHeadWeights<W>& w,
                             const ops::MlmHeadSaved<A, St>& saved, St* loss_sum, int32_t* num_correct) override;
  void mlm_head_loss_backward(double loss_scale, const int32_t* mlm_positions, const int32_t* mlm_labels,
                              int32_t num_masked, const ops::MlmHeadWeights<W>& w,
                              const ops::MlmHeadSaved<A, St>& saved, const ops::MlmHeadGrads<G>& g,
                              A* d_hidden) override;
  void nsp_head_loss_forward(const A* hidden, const ops::SeqView& seqs, const int32_t* nsp_labels,
                             const ops::NspHeadWeights<W>& w, const ops::NspHeadSaved<A>& saved, St* loss_sum,
                             int32_t* num_correct) override;
  void nsp_head_loss_backward(double loss_scale, const ops::SeqView& seqs, const int32_t* nsp_labels,
                              const ops::NspHeadWeights<W>& w, const ops::NspHeadSaved<A>& saved,
                              const ops::NspHeadGrads<G>& g, A* d_hidden) override;

 private:
  // One grow-only buffer per purpose, so an op holding one can call a helper (dense_backward, LN backward) that
  // holds another.
  // kBiasGrad: the fp32 [n] column sums the BGRADB epilogue writes (dense_backward).
  enum Slot { kDpre, kColPartials, kLnPartials, kHeadA, kHeadB, kFmhaWorkspace, kBiasGrad, kWeightT, kNumSlots };
  void* scratch(Slot slot, size_t bytes);
  // LayerNorm over rows of x [rows, H] (no residual, no dropout), and its backward (dz written; d_gamma/d_beta +=).
  void layernorm_plain_forward(const A* x, const W* gamma, const W* beta, int64_t rows, int32_t H, double eps, A* out,
                               St* mean, St* rstd);
  void layernorm_plain_backward(const A* dy, const A* x, const St* mean, const St* rstd, const W* gamma, int64_t rows,
                                int32_t H, A* dz, G* d_gamma, G* d_beta);
  void column_sums_accumulate(const A* m, int64_t rows, int32_t n, G* out, int64_t ld = 0);  // ld 0: n
  // The one-pass kernel over dy [rows, n] (contiguous; dense_grad_pass_supported): dpre = dy * scale when scale is
  // set, and d_bias += the column sums of dpre (of dy without scale) when d_bias is set.
  void grad_pass(const A* dy, const A* scale, A* dpre, int64_t rows, int32_t n, G* d_bias);
  // dense_forward / dense_backward with y / dy rows ld apart (ld >= n, no activation): the MLM decoder's padded logits.
  void dense_forward_ld(const A* x, const W* weight, const W* bias, int64_t rows, int32_t k, int32_t n,
                        ops::Activation act, A* y, A* act_grad, int64_t ld_y);
  void dense_backward_ld(const A* dy, const A* x, const W* weight, const A* act_grad, int64_t rows, int32_t k,
                         int32_t n, ops::Activation act, A* dx, bool accumulate_dx, G* d_weight, G* d_bias,
                         int64_t ld_dy);
  bool plan_attention_launches(const ops::SeqView& seqs);
  void attention_backward_impl(const A* d_ctx, const A* qkv, const ops::SeqView& seqs, const A* q_qkv,
                               const ops::SeqView* q_seqs, const A* ctx, const St* lse, int32_t num_heads,
                               int32_t head_dim, const ops::Dropout& drop, A* d_qkv, G* d_qkv_bias,
                               bool prepared = false);

  int device_ = 0;
  int sm_count_ = 0;
  size_t allocated_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<LtGemm> gemm_;
  // Grouped attention: the schedule, side streams made once (the most a schedule may ask for), the plan of the
  // current call (a member so that planning allocates nothing).
  ops::AttentionSchedule attn_schedule_;
  std::unique_ptr<FmhaStreams> attn_streams_;
  ops::AttentionPlan attn_plan_;

  class OpScope;  // .cu: brackets one public op with events when timing is on
  struct OpKey {
    const char* name;
    int32_t k, n;  // dense shape, -1 for other ops
  };
  struct OpRecord {
    size_t key;
    size_t first_event;  // start event; the end event follows it
  };
  void op_start(const char* name, int32_t k, int32_t n);
  void op_stop() noexcept;
  bool op_timing_ = false;
  int op_depth_ = 0;
  cudaError_t op_timing_error_ = cudaSuccess;  // from op_stop, reported by op_times_ms
  std::vector<cudaEvent_t> op_events_;
  std::vector<OpRecord> op_records_;  // recorded, not yet read
  std::vector<OpKey> op_keys_;
  std::vector<double> op_totals_ms_;  // per key
  void* scratch_[kNumSlots] = {};
  size_t scratch_bytes_[kNumSlots] = {};

  // Pinned staging for upload_bytes: a copy from pageable memory may wait for the stream, so each upload is first
  // copied (on the host) into one slot of a ring of pinned buffers and sent from there asynchronously. A slot is
  // reused only after its previous copy finished (its event); with kStagingSlots slots the host may run that many
  // uploads ahead of the GPU before it waits. Buffers grow to the largest upload seen.
  static constexpr size_t kStagingSlots = 64;
  struct StagingSlot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t copied = nullptr;
  };
  StagingSlot staging_[kStagingSlots];
  size_t staging_next_ = 0;
  StagingSlot& next_staging_slot(const void* host_src, size_t bytes);  // waits only if the ring is that far behind

  cudaStream_t copy_stream_ = nullptr;  // async uploads
  bool capture_mode_ = false;
  static constexpr size_t kFences = 16;
  cudaEvent_t fences_[kFences] = {};  // fence_compute() markers, reused round-robin
  uint64_t fences_made_ = 0;
  cudaEvent_t uploads_done_ = nullptr;  // the copy stream's end, for compute_waits_for_uploads
  bool uploads_since_wait_ = false;
  // Async downloads: the copy lands in a pinned slot on stream(); wait_download waits for the slot's event and
  // hands the bytes to the caller's buffer. A slot about to be reused is completed first, so no result is lost.
  static constexpr size_t kDownloadSlots = 32;
  struct DownloadSlot {
    void* pinned = nullptr;
    size_t capacity = 0;
    cudaEvent_t done = nullptr;
    void* host_dst = nullptr;
    size_t bytes = 0;
    uint64_t ticket = 0;
    bool pending = false;
  };
  DownloadSlot downloads_[kDownloadSlots];
  uint64_t downloads_made_ = 0;
  void complete_download(DownloadSlot& slot);
};

using CudaBackend = CudaBackendT<ops::GpuBf16>;
using CudaBackendF16 = CudaBackendT<ops::GpuF16>;
extern template class CudaBackendT<ops::GpuBf16>;
extern template class CudaBackendT<ops::GpuF16>;

}  // namespace nopad::cuda
