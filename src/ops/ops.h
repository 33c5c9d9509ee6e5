// The fused-op interface the BERT model is written against (docs/ops.md). One abstract Backend per precision
// policy (below): the CPU reference (ops/cpu: CpuF32 for training, CpuF64 for gradient checks) and the CUDA backend
// (ops/cuda: GpuBf16 and GpuF16, bf16 or fp16 activations and weight copies with fp32 gradients and statistics)
// implement it.
//
// Contracts common to every op:
//  - All pointers are backend memory (host memory on the CPU, device memory on the GPU); shapes and element counts
//    are passed explicitly, row-major, leading dimension = last extent unless stated. No op allocates per call in
//    steady state (scratch grows to the largest size seen and is then reused).
//  - Forward ops WRITE (=) their outputs and the saved statistics that their backward needs.
//  - Backward ops WRITE (=) activation gradients and ACCUMULATE (+=) into parameter gradients, so gradient
//    accumulation over micro-batches is just "call backward again". Exceptions are named in the op's comment
//    (dense_backward's accumulate_dx, the heads' scatter-add into d_hidden).
//  - Dropout is keyed by (seed, step, op_id, sample_id, element) through core/philox.h, with element built from the
//    position within the sequence and feature/head indices, so masks do not depend on how samples are batched.
//    Backward regenerates the mask; nothing is stored. p = 0 (evaluation) disables dropout exactly.
//  - Layouts: hidden states [T, H]; fused qkv [T, 3H] = [q | k | v], each block head-major (head h owns columns
//    h*hd .. h*hd+hd-1); linear weights [N, K] as Hugging Face nn.Linear (y = x W^T + b).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace nopad::ops {

// The element types of one backend:
//   Act    activations, saved activations and activation gradients
//   Weight the weights the ops read (on the GPU a bf16 or fp16 copy of the fp32 master weights the optimiser owns)
//   Grad   parameter gradients (accumulated across micro-batches)
//   Stat   LayerNorm mean/rstd, attention log-sum-exp, loss sums
template <class A, class W, class G, class St>
struct Precision {
  using Act = A;
  using Weight = W;
  using Grad = G;
  using Stat = St;
};
using CpuF32 = Precision<float, float, float, float>;
using CpuF64 = Precision<double, double, double, double>;
using GpuBf16 = Precision<bf16, bf16, float, float>;
// fp16 activations and weight copies: 3 more mantissa bits than bf16 but a range of +-65504, so training scales the
// loss (train.loss_scale) to keep small gradients out of the subnormals and skips the steps whose gradients overflow.
using GpuF16 = Precision<f16, f16, float, float>;

// Which rows belong to which sequence. Sequence b is rows [cu_seqlens[b], cu_seqlens[b+1]).
struct SeqView {
  int32_t num_tokens = 0;                // T
  int32_t num_seqs = 0;                  // B
  int32_t max_seqlen = 0;                // longest sequence (host value)
  const int32_t* cu_seqlens = nullptr;   // [B+1], backend memory
  const uint64_t* sample_ids = nullptr;  // [B], backend memory: dropout keys (see core/philox.h)
  // Optional scheduling hints (null: not given; the ops compute the same either way): the sequences longest first
  // (ops/attention_groups.h order_by_length) in backend memory and on the host, and cu_seqlens on the host. A device
  // backend cuts its grouped attention launches from them without reading device memory.
  const int32_t* by_length = nullptr;        // [B], backend memory
  const int32_t* host_by_length = nullptr;   // [B], host
  const int32_t* host_cu_seqlens = nullptr;  // [B+1], host
  // Optional (null: row - cu_seqlens[b]): each row's position within its sequence, [T] in backend memory, for views
  // whose rows are a subset of each sequence's tokens (the sparse last encoder layer, model/bert.h: a sequence's
  // [CLS] row and masked rows). The residual LayerNorm ops key their dropout by it, so the subset draws the masks the
  // full sequence would; the attention and embedding ops need whole sequences and reject such a view (the attention
  // takes one as its query side only: attention_forward_rows / attention_backward_rows).
  const int32_t* row_positions = nullptr;
};

// Dropout of one op call: drop probability p (0 = off). Draws are 16 bits per element (core/philox.h): an element is
// dropped with probability threshold / 65536, threshold = ceil(p * 65536), and kept values are scaled by
// 65536 / (65536 - threshold) ~ 1/(1-p), so the expectation is unchanged.
struct Dropout {
  float p = 0.0f;
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t op_id = 0;  // distinct per op instance in the model (see model/bert.h)
};

// kGelu: the exact erf GELU, 0.5 x (1 + erf(x / sqrt 2)) (Hugging Face "gelu").
// kGeluTanh: the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hugging Face "gelu_new" /
// "gelu_pytorch_tanh"; Google's BERT code and NVIDIA's MLPerf BERT use it). The CUDA backend fuses it into the GEMMs
// (cuBLASLt's GELU epilogues compute this approximation); the erf GELU costs a separate pass each way.
enum class Activation { kNone, kGelu, kGeluTanh };

template <class W>
struct EmbeddingWeights {
  const W* word = nullptr;        // [vocab_size, H]
  const W* position = nullptr;    // [max_positions, H]
  const W* token_type = nullptr;  // [type_vocab_size, H]
  const W* ln_gamma = nullptr;    // [H]
  const W* ln_beta = nullptr;     // [H]
  int32_t vocab_size = 0, max_positions = 0, type_vocab_size = 0, hidden = 0;
  double ln_eps = 1e-12;
};
template <class G>
struct EmbeddingGrads {  // all accumulated (+=)
  G* d_word = nullptr;
  G* d_position = nullptr;
  G* d_token_type = nullptr;
  G* d_ln_gamma = nullptr;
  G* d_ln_beta = nullptr;
};

// MLM head: gather masked rows -> dense H->H + GELU -> LayerNorm -> decoder (tied word embeddings) + bias.
template <class W>
struct MlmHeadWeights {
  const W* transform_weight = nullptr;  // [H, H]
  const W* transform_bias = nullptr;    // [H]
  const W* ln_gamma = nullptr;          // [H]
  const W* ln_beta = nullptr;           // [H]
  const W* word_embeddings = nullptr;   // [V, H], the tied decoder weight
  const W* output_bias = nullptr;       // [V]
  int32_t hidden = 0, vocab_size = 0;
  double ln_eps = 1e-12;
  Activation act = Activation::kGelu;  // of the transform (the model's hidden_act)
  // > vocab_size: word_embeddings has padded_vocab rows and output_bias padded_vocab entries, those past vocab_size
  // zero, and the gradients' rows / entries there may receive += 0 (the parameter layout's vocabulary padding,
  // model/params.h). A backend may then run the decoder over padded_vocab columns (the GPU: cuBLASLt's aligned
  // kernels need a 16-byte multiple); 0: exactly vocab_size rows.
  int32_t padded_vocab = 0;
};
template <class G>
struct MlmHeadGrads {  // all accumulated (+=)
  G* d_transform_weight = nullptr;
  G* d_transform_bias = nullptr;
  G* d_ln_gamma = nullptr;
  G* d_ln_beta = nullptr;
  G* d_word_embeddings = nullptr;
  G* d_output_bias = nullptr;
};
// What mlm_head_loss_forward saves for its backward; the caller owns the memory (sizes for M masked rows).
template <class A, class St>
struct MlmHeadSaved {
  A* gathered = nullptr;       // [M, H] hidden rows at mlm_positions
  A* transform_act_grad = nullptr;  // [M, H] the transform's GELU derivative at its pre-activation
  A* transform_act = nullptr;  // [M, H] after GELU
  St* ln_mean = nullptr;       // [M]
  St* ln_rstd = nullptr;       // [M]
  A* ln_out = nullptr;         // [M, H] decoder input
  A* probs = nullptr;          // [M, V] softmax, rows probs_ld apart; backward overwrites it with d_logits
  int64_t probs_ld = 0;        // row stride of probs in elements (0: V); Backend::mlm_logits_row_stride(V) is the
                               // stride the backend runs fastest with (its columns V .. probs_ld-1 are never touched)
};

// NSP head: CLS rows -> pooler dense H->H + tanh -> classifier H->2.
template <class W>
struct NspHeadWeights {
  const W* pooler_weight = nullptr;      // [H, H]
  const W* pooler_bias = nullptr;        // [H]
  const W* classifier_weight = nullptr;  // [2, H]
  const W* classifier_bias = nullptr;    // [2]
  int32_t hidden = 0;
};
template <class G>
struct NspHeadGrads {  // all accumulated (+=)
  G* d_pooler_weight = nullptr;
  G* d_pooler_bias = nullptr;
  G* d_classifier_weight = nullptr;
  G* d_classifier_bias = nullptr;
};
template <class A>
struct NspHeadSaved {
  A* cls = nullptr;     // [B, H] hidden rows at cu_seqlens[b]
  A* pooled = nullptr;  // [B, H] tanh output
  A* probs = nullptr;   // [B, 2] softmax; backward overwrites it with d_logits
};

template <class P>
class Backend {
 public:
  using A = typename P::Act;
  using W = typename P::Weight;
  using G = typename P::Grad;
  using St = typename P::Stat;
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // ---- memory (backend memory; upload/download copy from/to host memory) ----
  virtual void* allocate_bytes(size_t bytes) = 0;
  virtual void free_bytes(void* ptr) = 0;
  virtual void upload_bytes(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void download_bytes(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void zero_bytes(void* x, size_t bytes) = 0;
  virtual void synchronize() {}

  // ---- copies beside compute (optional: the defaults are the ordered, synchronous copies above) ----
  // A device backend may run host->device copies on a second queue beside the compute work, and device->host copies
  // without waiting for work enqueued after them. Nothing here makes the host wait, except wait_download.
  //  - upload_bytes_async: copies on the copy queue (host_src may be reused as soon as it returns). Ordered after the
  //    fences passed to uploads_wait so far; compute work sees it only after compute_waits_for_uploads().
  //  - fence_compute(): a marker of the compute work enqueued so far. uploads_wait(f) makes later async uploads wait
  //    for that work (a buffer it reads may be overwritten then). A fence stays valid for the next 15 fences.
  //  - download_bytes_async: a device->host copy ordered after the compute work enqueued so far; returns a ticket at
  //    once. The bytes are in host_dst once wait_download(ticket) returns (host_dst must stay valid until then).
  virtual void upload_bytes_async(void* dst, const void* host_src, size_t bytes) { upload_bytes(dst, host_src, bytes); }
  virtual void compute_waits_for_uploads() {}
  virtual uint64_t fence_compute() { return 0; }
  virtual void uploads_wait(uint64_t /*fence*/) {}
  virtual uint64_t download_bytes_async(void* host_dst, const void* src, size_t bytes) {
    download_bytes(host_dst, src, bytes);
    return 0;
  }
  virtual void wait_download(uint64_t /*ticket*/) {}

  // ---- embeddings ----
  // out[t] = dropout(LN(word[tokens[t]] + position[positions[t]] + token_type[segments[t]]) * gamma + beta).
  // Saves ln_mean[T], ln_rstd[T]. Dropout element key: (t - cu_seqlens[b], feature).
  virtual void embed_layernorm_dropout_forward(const int32_t* tokens, const int32_t* positions,
                                               const int32_t* segments, const SeqView& seqs,
                                               const EmbeddingWeights<W>& w, const Dropout& drop, A* out,
                                               St* ln_mean, St* ln_rstd) = 0;
  // Scatters (+=) into the three tables and accumulates d_gamma/d_beta.
  virtual void embed_layernorm_dropout_backward(const A* d_out, const int32_t* tokens, const int32_t* positions,
                                                const int32_t* segments, const SeqView& seqs,
                                                const EmbeddingWeights<W>& w, const Dropout& drop,
                                                const St* ln_mean, const St* ln_rstd, const EmbeddingGrads<G>& g) = 0;

  // ---- linear layer ----
  // y[rows, n] = act(pre), pre = x[rows, k] W[n, k]^T + bias[n]; bias may be null. With an activation,
  // act_grad[rows, n] receives act'(pre), the activation's derivative at the pre-activation: what backward needs
  // (saving it instead of pre makes the backward's activation step one multiply, which fits in a GEMM epilogue).
  // pre is rounded to A before both y and act_grad are computed from it, each then rounded to A. With kNone
  // act_grad is unused (may be null).
  virtual void dense_forward(const A* x, const W* weight, const W* bias, int64_t rows, int32_t k, int32_t n,
                             Activation act, A* y, A* act_grad) = 0;
  // dx[rows, k] = dpre W (written, or added when accumulate_dx: used where x also feeds a residual path);
  // d_weight[n, k] += dpre^T x; d_bias[n] += column sums of dpre, where dpre = dy * act_grad (dy itself with kNone).
  // dx, d_bias may be null (not needed).
  virtual void dense_backward(const A* dy, const A* x, const W* weight, const A* act_grad, int64_t rows, int32_t k,
                              int32_t n, Activation act, A* dx, bool accumulate_dx, G* d_weight, G* d_bias) = 0;
  // The backward of a dense layer whose input x = x_act(x_pre) is the output of an activation (BERT's FFN output
  // layer, x = GELU(intermediate pre-activation)), with x_act_grad = x_act'(x_pre) as dense_forward saved it:
  // d_weight[n, k] += dy^T x; dx_pre[rows, k] = (dy W) * x_act_grad (the product rounded to A first, then the
  // scaled value; written), and d_x_bias[k] += column sums of dx_pre before its rounding (the bias of the layer that
  // produced x_pre; may be null). So the activation's backward and its bias gradient fold into this layer's dx
  // product (on the GPU, nopad's GEMM epilogue). x_act must not be kNone.
  virtual void dense_backward_through_act(const A* dy, const A* x, const A* x_act_grad, const W* weight, int64_t rows,
                                          int32_t k, int32_t n, Activation x_act, A* dx_pre, G* d_weight,
                                          G* d_x_bias) = 0;

  // ---- attention ----
  // Variable-length multi-head self-attention: each sequence attends only to its own rows. scale = 1/sqrt(head_dim).
  // ctx[T, H] (head-major columns), lse[num_heads, T] = log-sum-exp of the scaled scores of each query row.
  // Dropout on the probabilities, element key (head, query pos, key pos) within the sequence.
  virtual void attention_forward(const A* qkv, const SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                 const Dropout& drop, A* ctx, St* lse) = 0;
  // Writes d_qkv[T, 3H] (every element). Uses ctx and lse from forward. With d_qkv_bias (may be null) it also
  // accumulates (+=) the column sums of d_qkv's q and v blocks as written into d_qkv_bias[0, H) and [2H, 3H): the
  // gradient of the bias of the projection that made qkv, so that the dense backward does not read d_qkv once more
  // for it. The k block's part [H, 2H) is left as it is: the k bias has no gradient (it adds q . b_k to every score of
  // a query's row, which the softmax cancels, dropout or not), and dK's column sums are zero up to rounding.
  virtual void attention_backward(const A* d_ctx, const A* qkv, const A* ctx, const St* lse, const SeqView& seqs,
                                  int32_t num_heads, int32_t head_dim, const Dropout& drop, A* d_qkv,
                                  G* d_qkv_bias) = 0;
  // The attention block's backward from the gradient dy [T, H] of the attention output projection's output (H =
  // num_heads * head_dim; w_out [H, H] the projection's weight, ctx its input): d_w_out += dy^T ctx, d_ctx = dy w_out
  // (written; the caller's [T, H] buffer), then attention_backward(d_ctx, ...). One op so that a backend can fuse the
  // two: the CUDA backend computes the attention backward's first pass (the per-head row dots of d_ctx with ctx) in the
  // d_ctx product's epilogue. The projection's bias gradient is not taken here (the residual LayerNorm's backward
  // takes it). This default runs the two ops.
  virtual void attention_output_backward(const A* dy, const W* w_out, const A* qkv, const A* ctx, const St* lse,
                                         const SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                         const Dropout& drop, A* d_ctx, G* d_w_out, A* d_qkv, G* d_qkv_bias) {
    const int32_t H = num_heads * head_dim;
    dense_backward(dy, ctx, w_out, nullptr, seqs.num_tokens, H, H, Activation::kNone, d_ctx, false, d_w_out, nullptr);
    attention_backward(d_ctx, qkv, ctx, lse, seqs, num_heads, head_dim, drop, d_qkv, d_qkv_bias);
  }

  // Attention for a subset of each sequence's query rows (the sparse last encoder layer, model/bert.h): keys and values
  // are every row of `seqs` in qkv [T, 3H]; the queries are the N rows of `q_seqs` (the same sequences and sample_ids
  // as `seqs`; its cu_seqlens over the N rows; row_positions required: each query's position in its sequence,
  // distinct within a sequence), whose q vectors are the q blocks of q_qkv [N, 3H] (qkv's rows, gathered). Each query
  // gets what attention_forward gives its row (same dropout keys): ctx [N, H], lse [num_heads, N].
  virtual void attention_forward_rows(const A* qkv, const SeqView& seqs, const A* q_qkv, const SeqView& q_seqs,
                                      int32_t num_heads, int32_t head_dim, const Dropout& drop, A* ctx, St* lse) = 0;
  // Its backward from d_ctx [N, H] (ctx, lse from attention_forward_rows): writes every element of d_qkv [T, 3H]: the
  // k and v blocks of every row, the q block of the query rows (row cu_seqlens[b] + position) and zeros in the q block
  // of the others, i.e. attention_backward's d_qkv for a d_ctx that is zero outside the query rows. d_qkv_bias as
  // there.
  virtual void attention_backward_rows(const A* d_ctx, const A* qkv, const SeqView& seqs, const A* q_qkv,
                                       const SeqView& q_seqs, const A* ctx, const St* lse, int32_t num_heads,
                                       int32_t head_dim, const Dropout& drop, A* d_qkv, G* d_qkv_bias) = 0;

  // ---- residual block ----
  // out[T, H] = LN(dropout(x + bias) + residual) * gamma + beta. Saves ln_mean[T], ln_rstd[T]; backward recomputes
  // the LayerNorm input from x, bias and residual (which the caller keeps alive). Dropout key (pos, feature).
  virtual void bias_dropout_residual_layernorm_forward(const A* x, const W* bias, const A* residual,
                                                       const W* ln_gamma, const W* ln_beta, const SeqView& seqs,
                                                       int32_t hidden, double ln_eps, const Dropout& drop, A* out,
                                                       St* ln_mean, St* ln_rstd) = 0;
  // Writes d_x[T, H] and d_residual[T, H] (d_residual is the gradient at the LayerNorm input; d_x = d_residual *
  // mask / (1-p)); accumulates d_bias, d_gamma, d_beta.
  virtual void bias_dropout_residual_layernorm_backward(const A* d_out, const A* x, const W* bias,
                                                        const A* residual, const W* ln_gamma, const St* ln_mean,
                                                        const St* ln_rstd, const SeqView& seqs, int32_t hidden,
                                                        const Dropout& drop, A* d_x, A* d_residual, G* d_bias,
                                                        G* d_ln_gamma, G* d_ln_beta) = 0;

  // ---- row gather / scatter (the sparse last encoder layer, model/bert.h) ----
  // dst[i, :] = src[rows[i], :] for i < n, with src [src_rows, width] and dst [n, width]; rows[i] in [0, src_rows).
  virtual void gather_rows(const A* src, int64_t src_rows, const int32_t* rows, int32_t n, int32_t width,
                           A* dst) = 0;
  // dst[rows[i], :] = src[i, :] for i < n, or += with accumulate (the sum rounded to A once), with src [n, width] and
  // dst [dst_rows, width]; the rows must be distinct and in [0, dst_rows). Other rows of dst are not touched.
  virtual void scatter_rows(const A* src, const int32_t* rows, int32_t n, int32_t width, A* dst, int64_t dst_rows,
                            bool accumulate) = 0;

  // ---- heads ----
  // The row stride (elements, >= V) of the MLM logits buffer (MlmHeadSaved::probs_ld) this backend wants: V on the
  // CPU; a GPU pads V to a multiple of 8 so that every row starts 16-byte aligned (what cuBLASLt's fast GEMM kernels
  // need: BERT's V = 30522 is not).
  virtual int64_t mlm_logits_row_stride(int32_t V) const { return V; }
  // Masked-LM loss over the M rows hidden[mlm_positions[i]] with labels mlm_labels[i] in [0, V).
  // Writes loss_sum[0] = sum of cross-entropies, num_correct[0] = number of rows whose argmax equals the label.
  virtual void mlm_head_loss_forward(const A* hidden, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                     int32_t num_masked, const MlmHeadWeights<W>& w,
                                     const MlmHeadSaved<A, St>& saved, St* loss_sum, int32_t* num_correct) = 0;
  // Gradient of loss_scale * loss_sum: ADDS (+=) into rows mlm_positions of d_hidden[T, H]; accumulates the head's
  // parameter gradients (d_word_embeddings receives the decoder's share of the tied weight).
  virtual void mlm_head_loss_backward(double loss_scale, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                      int32_t num_masked, const MlmHeadWeights<W>& w,
                                      const MlmHeadSaved<A, St>& saved, const MlmHeadGrads<G>& g, A* d_hidden) = 0;
  // Next-sentence loss over the CLS rows hidden[cu_seqlens[b]] with nsp_labels[b] in {0, 1}.
  virtual void nsp_head_loss_forward(const A* hidden, const SeqView& seqs, const int32_t* nsp_labels,
                                     const NspHeadWeights<W>& w, const NspHeadSaved<A>& saved, St* loss_sum,
                                     int32_t* num_correct) = 0;
  // Gradient of loss_scale * loss_sum: ADDS (+=) into the CLS rows of d_hidden; accumulates parameter gradients.
  virtual void nsp_head_loss_backward(double loss_scale, const SeqView& seqs, const int32_t* nsp_labels,
                                      const NspHeadWeights<W>& w, const NspHeadSaved<A>& saved,
                                      const NspHeadGrads<G>& g, A* d_hidden) = 0;
};

}  // namespace nopad::ops
