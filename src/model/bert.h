// BertForPreTraining forward and backward, written once against the ops interface (ops/ops.h); the model never sees
// which backend runs it. Post-LN encoder layers as Hugging Face's BertLayer:
//   qkv = h Wqkv^T + bqkv;  ctx = attention(qkv);  a = LN1(dropout(ctx Wo^T + bo) + h)
//   f = GELU(a Wi^T + bi);  h' = LN2(dropout(f Wf^T + bf) + a)     (GELU: erf or tanh, config hidden_act)
// then the MLM head on the M masked rows only and the NSP head on the B CLS rows only.
//
// Sparse last layer (default; set_sparse_last_layer(false) or NOPAD_SPARSE_LAST_LAYER=0 turns it off): the heads read
// only the last layer's output rows at the masked positions and the [CLS] rows, so after its attention (which needs
// every row as a key and value) the last layer runs on those rows alone: the attention output dense layer, both
// residual LayerNorms and the FFN see N = |CLS rows U masked rows| rows instead of T (~16% at MLPerf's masking).
// Same function and gradients: the rows left out feed nothing, and their dropout keys are the rows' positions in
// their sequences either way (ops::SeqView::row_positions), so the masks of the rows kept are the same too. The
// attention itself takes the N rows as its only queries (every row stays a key and value: attention_forward_rows),
// unless set_sparse_last_attention(false).
// loss = sum(MLM cross-entropy) / mlm_denominator + sum(NSP cross-entropy) / nsp_denominator, by default the batch's
// M and B (mean MLM + mean NSP, as BERT's reference). Pass global denominators when a global batch is split across
// micro-batches or ranks, so the summed gradients equal the full batch's.
//
// Precision: BertModel<P> takes an ops::Precision policy (ops/ops.h). Parameters are P::Weight (params()),
// parameter gradients P::Grad (grads()), activations and their gradients P::Act, LayerNorm mean/rstd, attention
// log-sum-exp and loss sums P::Stat. On the CPU (CpuF32, CpuF64) all four are one type. On the GPU (GpuBf16,
// GpuF16) the ops read bf16 or fp16 weights and activations for tensor-core GEMMs, gradients accumulate in fp32 across
// micro-batches so small updates are not lost, and statistics stay fp32; params() is then the 16-bit copy the ops
// read, and the optimiser owns the fp32 master weights and refreshes that copy after each step. With fp16, backward
// is run with a loss scale (backward(loss_scale)) so that activation gradients stay inside fp16's range.
//
// Host arrays (set_params, get_params, get_grads, init_params' values) are HostScalar: float where the policy's
// weights are 16-bit (converted on upload/download), the policy's own Weight type otherwise.
//
// Memory: parameters and gradients (separate allocations of their own types, both in ParamLayout order) and all
// activations for the largest batch (max_tokens, max_seqs, max_masked) are allocated once, in backend memory, by the
// constructor; a step allocates nothing. backward() ACCUMULATES into grads() (call zero_grad() to start a new
// accumulation).
//
// Overlap with the device: the batch arrays are double-buffered, so the upload of the next micro-batch (the
// backend's copy queue, ops.h) runs while the current one computes; a buffer is rewritten only after the compute
// work that read it (a backend fence). Each forward's loss sums are sent back with an asynchronous download and
// identified by a ticket: read_result(ticket) waits for that forward only, never for work enqueued after it.
#pragma once
#include <cstdint>
#include <functional>
#include <utility>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"

#include "data/batch.h"
#include "model/config.h"
#include "model/params.h"
#include "ops/ops.h"

namespace nopad {

// Dropout op ids (part of the dropout key, see core/philox.h): fixed by position in the network.
constexpr uint32_t kOpIdEmbeddingDropout = 0;
constexpr uint32_t op_id_attention_probs(int32_t layer) { return 1 + 3 * static_cast<uint32_t>(layer); }
constexpr uint32_t op_id_attention_output(int32_t layer) { return 2 + 3 * static_cast<uint32_t>(layer); }
constexpr uint32_t op_id_ffn_output(int32_t layer) { return 3 + 3 * static_cast<uint32_t>(layer); }

struct StepResult {
  double loss = 0;      // mlm_loss + nsp_loss
  double mlm_loss = 0;  // sum of MLM cross-entropies / mlm denominator
  double nsp_loss = 0;  // sum of NSP cross-entropies / nsp denominator
  int64_t mlm_correct = 0, mlm_count = 0;
  int64_t nsp_correct = 0, nsp_count = 0;
};

struct LossDenominators {
  double mlm = 0;  // <= 0: this batch's number of masked rows
  double nsp = 0;  // <= 0: this batch's number of sequences
};

template <class P>
class BertModel {
 public:
  using A = typename P::Act;
  using W = typename P::Weight;
  using G = typename P::Grad;
  using St = typename P::Stat;
  using HostScalar = std::conditional_t<std::is_same_v<W, bf16> || std::is_same_v<W, f16>, float, W>;

  BertModel(const BertConfig& config, ops::Backend<P>& backend, int32_t max_tokens, int32_t max_seqs,
            int32_t max_masked);
  ~BertModel();
  // The bytes of backend memory the constructor takes for this capacity (parameters, gradients, activations, batch
  // copies), without allocating: what a caller sizes a batch to memory with. probs_ld is the backend's
  // mlm_logits_row_stride(vocab_size). Equal to allocated_bytes() of a model built so (a test holds them together).
  static uint64_t planned_bytes(const BertConfig& config, int64_t max_tokens, int64_t max_seqs, int64_t max_masked,
                                int64_t probs_ld);
  uint64_t allocated_bytes() const { return allocated_bytes_; }  // requested from the backend by the constructor
  BertModel(const BertModel&) = delete;
  BertModel& operator=(const BertModel&) = delete;

  const BertConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  size_t num_params() const { return layout_.total_numel(); }
  W* params() { return params_; }  // backend memory [num_params()]
  G* grads() { return grads_; }    // backend memory [num_params()], same layout

  void init_params(uint64_t seed);                  // BERT initialisation (params.h), uploaded
  void set_params(const HostScalar* host_params);   // copy [num_params()] host values in
  void get_params(HostScalar* host_params) const;   // copy out
  void get_grads(HostScalar* host_grads) const;
  void zero_grad();

  // Runs the whole network on one batch. train = false turns dropout off (p = 0). Keeps what backward needs.
  StepResult forward(const HostBatch& batch, bool train, uint64_t seed, uint64_t step, LossDenominators denoms = {});
  // The same, split so that a device backend is never waited for inside a step: forward_async only enqueues the
  // work (it returns once the batch has been handed to the backend) and returns a ticket for its result;
  // read_result(ticket) waits for that forward's loss sums and counts (at most result_capacity() tickets may be
  // outstanding: older ones are completed, not lost, when their slot is reused). read_result() reads the last
  // forward's. forward() = forward_async() + read_result().
  uint64_t forward_async(const HostBatch& batch, bool train, uint64_t seed, uint64_t step,
                         LossDenominators denoms = {});
  StepResult read_result(uint64_t ticket);
  StepResult read_result();
  // The sparse last layer (above). Takes effect at the next forward; backward follows the forward's choice.
  void set_sparse_last_layer(bool on) { sparse_last_layer_ = on; }
  bool sparse_last_layer() const { return sparse_last_layer_; }
  // Within it, the attention on the N rows as queries only (default; off: all T rows are queries and the N rows of
  // its output are gathered after). Same function; NOPAD_SPARSE_LAST_ATTENTION=0 turns it off.
  void set_sparse_last_attention(bool on) { sparse_last_attention_ = on; }
  bool sparse_last_attention() const { return sparse_last_attention_; }
  // Results that may be outstanding at once (default 8; set it before the first forward, e.g. to 2 x micro-batches
  // per step + 2 when steps are read one step late).
  void set_result_capacity(size_t n);
  size_t result_capacity() const { return results_.size(); }
  // The MLM head's probabilities over the vocabulary at each masked row of the last forward, [M, vocab_size]
  // row-major, in mlm_positions order (fill-mask). Valid until the next forward or backward; waits for the device.
  void get_mlm_probabilities(std::vector<float>& out) const;
  // grads += loss_scale * d(loss)/d(params) for the last forward (once per forward).
  void backward(double loss_scale = 1.0);

  // Data parallelism: the gradient buffer as buckets that backward completes one after another (an encoder layer's
  // range as soon as that layer's backward is enqueued, from the last layer down; then the ranges of everything else:
  // embeddings, pooler, heads), each [offset, offset + count) of grads(). With a hook set and armed, backward calls
  // hook(offset, count) for every bucket in that order, right after enqueuing the work that finishes it (so the
  // caller can start the bucket's reduction while the rest of backward runs). Arm it for the last micro-batch of a
  // step only. Where the layout does not keep each layer contiguous, there is one bucket: the whole buffer.
  using GradReadyHook = std::function<void(size_t offset, size_t count)>;
  void set_grad_ready_hook(GradReadyHook hook) { grad_hook_ = std::move(hook); }
  void arm_grad_ready_hook(bool armed) { grad_hook_armed_ = armed; }
  const std::vector<std::pair<size_t, size_t>>& grad_buckets() const { return grad_buckets_; }

 private:
  ops::Activation activation() const {
    return config_.gelu_tanh() ? ops::Activation::kGeluTanh : ops::Activation::kGelu;
  }
  struct Layer {  // parameter pointers (backend memory) and saved activations of one encoder layer
    W *w_qkv, *b_qkv, *w_attn_out, *b_attn_out, *ln1_gamma, *ln1_beta;
    W *w_inter, *b_inter, *w_out, *b_out, *ln2_gamma, *ln2_beta;
    size_t off_w_qkv, off_b_qkv, off_w_attn_out, off_b_attn_out, off_ln1_gamma, off_ln1_beta;
    size_t off_w_inter, off_b_inter, off_w_out, off_b_out, off_ln2_gamma, off_ln2_beta;
    A *qkv, *ctx, *attn_dense, *out1, *inter_act, *ffn_dense, *out2;
    A* inter_grad;  // gelu'(intermediate pre-activation), saved by the forward for the FFN backward
    St *lse, *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;
  };
  template <class U>
  U* alloc(size_t count);
  // Host <-> backend copies of a [num_params()] array, converting element types where they differ.
  template <class T>
  void upload_converted(T* dst, const HostScalar* host) const;
  template <class T>
  void download_converted(HostScalar* host, const T* src) const;
  W* param(const std::string& name) { return params_ + layout_.offset(name); }
  G* grad(const std::string& name) { return grads_ + layout_.offset(name); }
  ops::Dropout dropout(float p, uint32_t op_id) const;
  void resolve_head_tensors();
  ops::EmbeddingWeights<W> emb_w_;
  ops::EmbeddingGrads<G> emb_g_;
  ops::MlmHeadWeights<W> mlm_w_;
  ops::MlmHeadGrads<G> mlm_g_;
  ops::NspHeadWeights<W> nsp_w_;
  ops::NspHeadGrads<G> nsp_g_;

  BertConfig config_;
  GradReadyHook grad_hook_;
  bool grad_hook_armed_ = false;
  std::vector<std::pair<size_t, size_t>> grad_buckets_;  // [offset, count]: one per layer (last first), then the rest
  bool layer_buckets_ = false;                            // grad_buckets_ starts with the layers' buckets
  ops::Backend<P>& backend_;
  ParamLayout layout_;
  int32_t max_tokens_, max_seqs_, max_masked_;
  std::vector<void*> allocations_;
  uint64_t allocated_bytes_ = 0;
  W* params_ = nullptr;
  G* grads_ = nullptr;
  std::vector<Layer> layers_;
  // batch copies in backend memory: two slots (the one computing, the one being filled); the pointers below are the
  // slot of the last forward
  struct BatchSlot {
    int32_t *tokens, *positions, *segments, *cu_seqlens, *mlm_positions, *mlm_labels, *nsp_labels;
    uint64_t* sample_ids;
    int32_t* by_length;  // [B] the sequences longest first (ops/attention_groups.h), for grouped attention
    std::vector<int32_t> host_by_length, host_cu_seqlens;  // their host copies (capacity fixed at construction)
    // The sparse last layer's rows (bert.cpp, last_layer_rows): [N] row of the batch, [N] position in its sequence,
    // [B+1] their cu_seqlens, [M] each masked row's index among the N.
    int32_t *last_rows, *last_positions, *last_cu_seqlens, *last_mlm_positions;
    std::vector<int32_t> host_last_rows, host_last_positions, host_last_cu_seqlens, host_last_mlm_positions;
    uint64_t free_fence = 0;  // backend fence after the last compute work that reads this slot
  };
  BatchSlot slots_[2]{};
  int cur_slot_ = 1;  // the first forward takes slot 0
  int32_t *tokens_, *positions_, *segments_, *cu_seqlens_, *mlm_positions_, *mlm_labels_, *nsp_labels_;
  uint64_t* sample_ids_;
  // host side of the asynchronous loss reads, a ring indexed by ticket
  struct PendingResult {
    uint64_t ticket = 0;
    St sums[2] = {St(0), St(0)};
    int32_t correct[2] = {0, 0};
    uint64_t dl_sums = 0, dl_correct = 0;  // backend download tickets
    int32_t num_masked = 0, num_seqs = 0;
    double mlm_denom = 1, nsp_denom = 1;
  };
  std::vector<PendingResult> results_;
  uint64_t results_made_ = 0;
  // The sparse last layer: its rows' view, the gathered attention context and layer input [N, H], the gradient of
  // that input, and the host scratch that marks the rows (capacity max_tokens from the constructor).
  bool sparse_last_layer_ = true;
  bool sparse_last_ = false;  // the last forward ran it
  bool sparse_last_attention_ = true;
  bool sparse_attn_ = false;  // the last forward's last-layer attention had the N rows as its queries
  int32_t num_last_rows_ = 0;
  ops::SeqView last_seqs_{};
  const int32_t *last_rows_ = nullptr, *last_mlm_positions_ = nullptr;
  A *last_ctx_ = nullptr, *last_h_ = nullptr, *d_last_h_ = nullptr;
  A* last_qkv_ = nullptr;  // [N, 3H]: the N rows of the last layer's qkv (their q blocks are the queries)
  std::vector<int32_t> host_row_mark_;
  void last_layer_rows(const HostBatch& batch, BatchSlot& slot);
  // embedding and head activations
  A* emb_out_;
  St *emb_mean_, *emb_rstd_;
  ops::MlmHeadSaved<A, St> mlm_saved_;
  ops::NspHeadSaved<A> nsp_saved_;
  St* loss_sums_;       // [2]: MLM, NSP
  int32_t* correct_;    // [2]
  // gradient work buffers
  A *d_hidden_, *d_hidden2_, *d_tmp_, *d_ctx_, *d_qkv_, *d_inter_;
  // state of the last forward
  ops::SeqView seqs_{};
  int32_t num_masked_ = 0;
  bool train_ = false, have_forward_ = false;
  uint64_t seed_ = 0, step_ = 0;
  double mlm_denom_ = 1, nsp_denom_ = 1;
};

extern template class BertModel<ops::CpuF32>;
extern template class BertModel<ops::CpuF64>;
extern template class BertModel<ops::GpuBf16>;
extern template class BertModel<ops::GpuF16>;

}  // namespace nopad
