// CPU reference implementations of the fused ops (contracts in ops/ops.h, docs/ops.md). Readability first: each op is
// a loop over rows or (sequence, head) pairs with the math written out; GEMMs go through cpu_gemm.h.
#include "ops/cpu/cpu_backend.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/host_memory.h"
#include "core/philox.h"
#include "core/threads.h"
#include "ops/cpu/cpu_gelu.h"
#include "ops/cpu/cpu_gemm.h"
#include "ops/seq_view.h"

namespace nopad::ops {
namespace {

using cpu::dot;
using cpu::gelu;
using cpu::gelu_grad;
using cpu::gelu_tanh;
using cpu::gelu_tanh_grad;
using cpu::gemm;

constexpr int64_t kRowsPerChunk = 32;  // rows per task in row-wise ops; fixed so reductions have a fixed order

// out[j] += sum over rows of m[r][j] ([rows, n], rows ld apart; ld 0: n); columns split in blocks of 256 across
// threads, rows summed in order.
template <class S>
void add_column_sums(const S* m, int64_t rows, int32_t n, S* out, int threads, int64_t ld = 0) {
  constexpr int32_t kCols = 256;
  if (ld == 0) ld = n;
  parallel_for(static_cast<size_t>((n + kCols - 1) / kCols), threads, [&](size_t c) {
    const int32_t j0 = static_cast<int32_t>(c) * kCols, j1 = std::min(n, j0 + kCols);
    for (int64_t r = 0; r < rows; ++r)
      for (int32_t j = j0; j < j1; ++j) out[j] += m[r * ld + j];
  });
}
template <class S>
S activate(Activation act, S x) {
  return act == Activation::kGelu ? gelu(x) : act == Activation::kGeluTanh ? gelu_tanh(x) : x;
}
template <class S>
S activation_grad(Activation act, S x) {
  return act == Activation::kGelu ? gelu_grad(x) : act == Activation::kGeluTanh ? gelu_tanh_grad(x) : S(1);
}

// Keep-scale of one dropout element (core/philox.h), 0 if it is dropped, 1 without dropout (p = 0 draws nothing).
// Hidden states: the 16-bit draw, kept iff >= ceil(p * 65536), scale dropout_keep_scale. Attention probabilities
// (kAttention): the 8-bit draw, kept iff >= ceil(p * 256), scale attention_dropout_keep_scale. The scale is the float
// the GPU kernels use, converted to S.
struct DropoutMask {
  enum Kind { kHidden, kAttention };
  uint64_t stream_key = 0;
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  Kind kind = kHidden;
  explicit DropoutMask(const Dropout& d, Kind k = kHidden) : kind(k) {
    if (kind == kAttention) {
      NOPAD_CHECK(attention_dropout_p_supported(d.p), "attention dropout probability must be in [0, 1 - 2^-8] (an "
                  "8-bit draw must be able to keep an element), got ", d.p);
      threshold = attention_dropout_threshold(d.p);
    } else {
      NOPAD_CHECK(dropout_p_supported(d.p), "dropout probability must be in [0, 1 - 2^-16] (a 16-bit draw must be "
                  "able to keep an element), got ", d.p);
      threshold = dropout_threshold(d.p);
    }
    if (threshold > 0) {
      stream_key = dropout_stream_key(d.seed, d.step, d.op_id);
      keep_scale = kind == kAttention ? attention_dropout_keep_scale(threshold) : dropout_keep_scale(threshold);
    }
  }
  bool on() const { return threshold > 0; }
  template <class S>
  S scale(uint64_t sample_id, uint64_t element) const {
    if (!on()) return S(1);
    const bool keep = kind == kAttention
                          ? attention_dropout_keep_threshold(stream_key, sample_id, element, threshold)
                          : dropout_keep_threshold(stream_key, sample_id, element, threshold, kPhiloxRounds);
    return keep ? static_cast<S>(keep_scale) : S(0);
  }
};

// LayerNorm of one row z[H] (out may alias z): out = (z - mean) * rstd * gamma + beta.
template <class S>
void layernorm_row(const S* z, int32_t H, const S* gamma, const S* beta, double eps, S* out, S& mean_out,
                   S& rstd_out) {
  S mean = 0;
  for (int32_t j = 0; j < H; ++j) mean += z[j];
  mean /= S(H);
  S var = 0;
  for (int32_t j = 0; j < H; ++j) var += (z[j] - mean) * (z[j] - mean);
  var /= S(H);
  const S rstd = S(1) / std::sqrt(var + static_cast<S>(eps));
  for (int32_t j = 0; j < H; ++j) out[j] = (z[j] - mean) * rstd * gamma[j] + beta[j];
  mean_out = mean;
  rstd_out = rstd;
}

// Backward of one LayerNorm row given dy = d(out): writes dz (may alias z, not dy), adds into d_gamma/d_beta.
template <class S>
void layernorm_row_backward(const S* dy, const S* z, S mean, S rstd, const S* gamma, int32_t H, S* dz, S* d_gamma,
                            S* d_beta) {
  S sum_g = 0, sum_gx = 0;
  for (int32_t j = 0; j < H; ++j) {
    const S xhat = (z[j] - mean) * rstd;
    const S g = dy[j] * gamma[j];
    sum_g += g;
    sum_gx += g * xhat;
    d_gamma[j] += dy[j] * xhat;
    d_beta[j] += dy[j];
  }
  sum_g /= S(H);
  sum_gx /= S(H);
  for (int32_t j = 0; j < H; ++j) {
    const S xhat = (z[j] - mean) * rstd;
    dz[j] = rstd * (dy[j] * gamma[j] - sum_g - xhat * sum_gx);
  }
}

// Runs fn(task, worker) for task in [0, n); worker in [0, workers) indexes per-worker scratch.
template <class Fn>
void parallel_tasks(size_t n, int workers, Fn&& fn) {
  std::atomic<size_t> next{0};
  parallel_for(static_cast<size_t>(workers), workers, [&](size_t w) {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i, w);
  });
}

}  // namespace

template <class P>
CpuBackend<P>::CpuBackend(int num_threads) : threads_(num_threads <= 0 ? hardware_threads() : num_threads) {}

template <class P>
void* CpuBackend<P>::allocate_bytes(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  // The poisoning below touches every page: past the memory available, the kernel's OOM killer would end the process
  // without a word, so a large buffer that cannot fit is refused here, with the numbers.
  if (rounded >= (size_t{64} << 20)) {
    const HostMemory mem = host_memory_available(/*with_swap=*/true);
    if (rounded > mem.available_bytes)
      throw OutOfMemory(str_cat("out of host memory: a buffer of ", format_bytes(rounded), " does not fit in the ",
                                format_bytes(mem.available_bytes), " available (", mem.limited_by,
                                "); use a smaller batch"));
  }
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) throw OutOfMemory(str_cat("out of host memory allocating ", bytes, " bytes"));
  // Poison: all-ones bytes are NaN in float and double, so anything read before it is written shows up in results.
  std::memset(p, 0xFF, rounded);
  return p;
}
template <class P>
void CpuBackend<P>::free_bytes(void* ptr) {
  std::free(ptr);
}
template <class P>
void CpuBackend<P>::upload_bytes(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
}
template <class P>
void CpuBackend<P>::download_bytes(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
}
template <class P>
void CpuBackend<P>::zero_bytes(void* x, size_t bytes) {
  if (bytes) std::memset(x, 0, bytes);  // all-zero bytes are +0 in float and double
}

template <class P>
auto CpuBackend<P>::scratch(Slot slot, size_t count) -> S* {
  auto& buf = scratch_[slot];
  if (buf.size() < count) buf.resize(count);
  return buf.data();
}

template <class P>
const int32_t* CpuBackend<P>::row_to_seq(const SeqView& seqs) {
  NOPAD_CHECK(seqs.num_seqs >= 0 && seqs.cu_seqlens != nullptr, "SeqView without cu_seqlens");
  NOPAD_CHECK(seqs.cu_seqlens[0] == 0 && seqs.cu_seqlens[seqs.num_seqs] == seqs.num_tokens,
              "cu_seqlens must run from 0 to num_tokens (", seqs.num_tokens, "), got ", seqs.cu_seqlens[0], "..",
              seqs.cu_seqlens[seqs.num_seqs]);
  row_seq_.resize(static_cast<size_t>(seqs.num_tokens));
  for (int32_t b = 0; b < seqs.num_seqs; ++b) {
    const int32_t len = seqs.cu_seqlens[b + 1] - seqs.cu_seqlens[b];
    NOPAD_CHECK(len >= 1 && len <= seqs.max_seqlen, "sequence ", b, " has length ", len, " (max_seqlen ",
                seqs.max_seqlen, ")");
    for (int32_t t = seqs.cu_seqlens[b]; t < seqs.cu_seqlens[b + 1]; ++t) row_seq_[t] = b;
  }
  return row_seq_.data();
}

namespace {
// Row t's position within its sequence b: the view's row_positions where it has them (a subset of each sequence's
// rows), else the offset from the sequence start.
uint32_t position_in_seq(const SeqView& seqs, int64_t t, int32_t b) {
  return static_cast<uint32_t>(seqs.row_positions != nullptr ? seqs.row_positions[t] : t - seqs.cu_seqlens[b]);
}
}  // namespace

// ---------------------------------------------------------------------------------------------- embeddings

template <class P>
void CpuBackend<P>::embed_layernorm_dropout_forward(const int32_t* tokens, const int32_t* positions,
                                                    const int32_t* segments, const SeqView& seqs,
                                                    const EmbeddingWeights<S>& w, const Dropout& drop, S* out,
                                                    S* ln_mean, S* ln_rstd) {
  require_whole_sequences(seqs, "embed_layernorm_dropout_forward");
  const int32_t H = w.hidden, T = seqs.num_tokens;
  const int32_t* row_seq = row_to_seq(seqs);
  const DropoutMask mask(drop);
  const int64_t chunks = (T + kRowsPerChunk - 1) / kRowsPerChunk;
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t t1 = std::min<int64_t>(T, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    for (int64_t t = static_cast<int64_t>(c) * kRowsPerChunk; t < t1; ++t) {
      const int32_t tok = tokens[t], pos = positions[t], seg = segments[t];
      NOPAD_CHECK(tok >= 0 && tok < w.vocab_size, "token id ", tok, " at row ", t, " outside vocab ", w.vocab_size);
      NOPAD_CHECK(pos >= 0 && pos < w.max_positions, "position ", pos, " at row ", t, " outside ", w.max_positions);
      NOPAD_CHECK(seg >= 0 && seg < w.type_vocab_size, "segment ", seg, " at row ", t, " outside ",
                  w.type_vocab_size);
      S* o = out + t * H;
      const S *we = w.word + int64_t{tok} * H, *pe = w.position + int64_t{pos} * H,
              *te = w.token_type + int64_t{seg} * H;
      for (int32_t j = 0; j < H; ++j) o[j] = we[j] + pe[j] + te[j];
      layernorm_row(o, H, w.ln_gamma, w.ln_beta, w.ln_eps, o, ln_mean[t], ln_rstd[t]);
      if (mask.on()) {
        const int32_t b = row_seq[t];
        const uint32_t pos_in_seq = static_cast<uint32_t>(t - seqs.cu_seqlens[b]);
        for (int32_t j = 0; j < H; ++j)
          o[j] *= mask.template scale<S>(seqs.sample_ids[b], element_hidden(pos_in_seq, static_cast<uint32_t>(j)));
      }
    }
  });
}

template <class P>
void CpuBackend<P>::embed_layernorm_dropout_backward(const S* d_out, const int32_t* tokens, const int32_t* positions,
                                                     const int32_t* segments, const SeqView& seqs,
                                                     const EmbeddingWeights<S>& w, const Dropout& drop,
                                                     const S* ln_mean, const S* ln_rstd,
                                                     const EmbeddingGrads<S>& g) {
  require_whole_sequences(seqs, "embed_layernorm_dropout_backward");
  const int32_t H = w.hidden, T = seqs.num_tokens;
  const int32_t* row_seq = row_to_seq(seqs);
  const DropoutMask mask(drop);
  const int64_t chunks = (T + kRowsPerChunk - 1) / kRowsPerChunk;
  S* dz_all = scratch(kOpA, static_cast<size_t>(T) * H);    // gradient at the LayerNorm input, per row
  S* dy_all = scratch(kOpB, static_cast<size_t>(T) * H);    // gradient at the LayerNorm output (after dropout)
  S* partial = scratch(kPartials, static_cast<size_t>(chunks) * 2 * H);  // [chunk][d_gamma | d_beta]
  std::fill_n(partial, chunks * 2 * H, S(0));
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t t1 = std::min<int64_t>(T, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    S* pg = partial + static_cast<int64_t>(c) * 2 * H;
    for (int64_t t = static_cast<int64_t>(c) * kRowsPerChunk; t < t1; ++t) {
      const int32_t b = row_seq[t];
      const uint32_t pos_in_seq = static_cast<uint32_t>(t - seqs.cu_seqlens[b]);
      S* dy = dy_all + t * H;
      S* z = dz_all + t * H;
      for (int32_t j = 0; j < H; ++j)
        dy[j] = d_out[t * H + j] *
                mask.template scale<S>(seqs.sample_ids[b], element_hidden(pos_in_seq, static_cast<uint32_t>(j)));
      const S *we = w.word + int64_t{tokens[t]} * H, *pe = w.position + int64_t{positions[t]} * H,
              *te = w.token_type + int64_t{segments[t]} * H;
      for (int32_t j = 0; j < H; ++j) z[j] = we[j] + pe[j] + te[j];
      layernorm_row_backward(dy, z, ln_mean[t], ln_rstd[t], w.ln_gamma, H, z, pg, pg + H);
    }
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int32_t j = 0; j < H; ++j) {
      if (g.d_ln_gamma) g.d_ln_gamma[j] += partial[c * 2 * H + j];
      if (g.d_ln_beta) g.d_ln_beta[j] += partial[c * 2 * H + H + j];
    }
  // Scatter into the tables in row order (rows may share a token, so this stays serial and deterministic).
  for (int64_t t = 0; t < T; ++t) {
    const S* dz = dz_all + t * H;
    S* dw = g.d_word + int64_t{tokens[t]} * H;
    S* dp = g.d_position + int64_t{positions[t]} * H;
    S* dt = g.d_token_type + int64_t{segments[t]} * H;
    for (int32_t j = 0; j < H; ++j) {
      dw[j] += dz[j];
      dp[j] += dz[j];
      dt[j] += dz[j];
    }
  }
}

// ---------------------------------------------------------------------------------------------- dense

template <class P>
void CpuBackend<P>::dense_forward(const S* x, const S* weight, const S* bias, int64_t rows, int32_t k, int32_t n,
                                  Activation act, S* y, S* act_grad) {
  S* w_t = scratch(kTranspose, static_cast<size_t>(k) * n);  // W^T [k, n], so the GEMM streams rows of B
  cpu::transpose(weight, n, k, w_t, threads_);
  NOPAD_CHECK(act == Activation::kNone || act_grad != nullptr, "dense_forward with an activation needs act_grad");
  gemm<S>(rows, n, k, x, k, 1, w_t, n, y, n, false, threads_);  // pre, in y
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  if (bias == nullptr && act == Activation::kNone) return;
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t r1 = std::min<int64_t>(rows, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    for (int64_t r = static_cast<int64_t>(c) * kRowsPerChunk; r < r1; ++r) {
      S* t = y + r * n;
      if (bias)
        for (int32_t j = 0; j < n; ++j) t[j] += bias[j];
      if (act != Activation::kNone) {
        for (int32_t j = 0; j < n; ++j) {
          act_grad[r * n + j] = activation_grad(act, t[j]);
          t[j] = activate(act, t[j]);
        }
      }
    }
  });
}

template <class P>
void CpuBackend<P>::dense_backward(const S* dy, const S* x, const S* weight, const S* act_grad, int64_t rows,
                                   int32_t k, int32_t n, Activation act, S* dx, bool accumulate_dx, S* d_weight,
                                   S* d_bias) {
  const S* dpre = dy;
  if (act != Activation::kNone) {
    NOPAD_CHECK(act_grad != nullptr, "dense_backward with an activation needs act_grad");
    S* buf = scratch(kDpre, static_cast<size_t>(rows) * n);
    parallel_for(static_cast<size_t>(rows), threads_, [&](size_t r) {
      for (int32_t j = 0; j < n; ++j) buf[r * n + j] = dy[r * n + j] * act_grad[r * n + j];
    }, 16);
    dpre = buf;
  }
  if (dx) gemm<S>(rows, k, n, dpre, n, 1, weight, k, dx, k, accumulate_dx, threads_);            // dpre W
  if (d_weight) gemm<S>(n, k, rows, dpre, 1, n, x, k, d_weight, k, /*accumulate=*/true, threads_);  // dpre^T x
  if (d_bias) add_column_sums(dpre, rows, n, d_bias, threads_);
}

template <class P>
void CpuBackend<P>::dense_backward_through_act(const S* dy, const S* x, const S* x_act_grad, const S* weight,
                                               int64_t rows, int32_t k, int32_t n, Activation x_act, S* dx_pre,
                                               S* d_weight, S* d_x_bias) {
  NOPAD_CHECK(x_act != Activation::kNone, "dense_backward_through_act needs an activation");
  NOPAD_CHECK(x_act_grad != nullptr && dx_pre != nullptr, "dense_backward_through_act needs x_act_grad and dx_pre");
  dense_backward(dy, x, weight, nullptr, rows, k, n, Activation::kNone, dx_pre, false, d_weight, nullptr);
  parallel_for(static_cast<size_t>(rows), threads_, [&](size_t r) {
    for (int32_t j = 0; j < k; ++j) dx_pre[r * k + j] *= x_act_grad[r * k + j];
  }, 16);
  if (d_x_bias) add_column_sums(dx_pre, rows, k, d_x_bias, threads_);
}

// ---------------------------------------------------------------------------------------------- attention

template <class P>
void CpuBackend<P>::attention_forward(const S* qkv, const SeqView& seqs, int32_t num_heads, int32_t head_dim,
                                      const Dropout& drop, S* ctx, S* lse) {
  require_whole_sequences(seqs, "attention_forward");
  row_to_seq(seqs);  // validates cu_seqlens
  attention_forward_impl(qkv, seqs, qkv, nullptr, num_heads, head_dim, drop, ctx, lse);
}

template <class P>
void CpuBackend<P>::attention_forward_rows(const S* qkv, const SeqView& seqs, const S* q_qkv, const SeqView& q_seqs,
                                           int32_t num_heads, int32_t head_dim, const Dropout& drop, S* ctx,
                                           S* lse) {
  check_query_rows(seqs, q_seqs, "attention_forward_rows");
  attention_forward_impl(qkv, seqs, q_qkv, &q_seqs, num_heads, head_dim, drop, ctx, lse);
}

template <class P>
void CpuBackend<P>::attention_backward(const S* d_ctx, const S* qkv, const S* ctx, const S* lse, const SeqView& seqs,
                                       int32_t num_heads, int32_t head_dim, const Dropout& drop, S* d_qkv,
                                       S* d_qkv_bias) {
  require_whole_sequences(seqs, "attention_backward");
  row_to_seq(seqs);
  attention_backward_impl(d_ctx, qkv, seqs, qkv, nullptr, ctx, lse, num_heads, head_dim, drop, d_qkv, d_qkv_bias);
}

template <class P>
void CpuBackend<P>::attention_backward_rows(const S* d_ctx, const S* qkv, const SeqView& seqs, const S* q_qkv,
                                            const SeqView& q_seqs, const S* ctx, const S* lse, int32_t num_heads,
                                            int32_t head_dim, const Dropout& drop, S* d_qkv, S* d_qkv_bias) {
  check_query_rows(seqs, q_seqs, "attention_backward_rows");
  attention_backward_impl(d_ctx, qkv, seqs, q_qkv, &q_seqs, ctx, lse, num_heads, head_dim, drop, d_qkv, d_qkv_bias);
}

// seqs whole (cu_seqlens valid); q_seqs over the same sequences, each query range within its sequence's length, the
// positions distinct within a sequence and inside it.
template <class P>
void CpuBackend<P>::check_query_rows(const SeqView& seqs, const SeqView& q_seqs, const char* op) {
  require_whole_sequences(seqs, op);
  row_to_seq(seqs);
  require_query_rows(seqs, q_seqs, op);
  const int32_t B = seqs.num_seqs;
  NOPAD_CHECK(q_seqs.num_tokens >= 0 && q_seqs.cu_seqlens[0] == 0 && q_seqs.cu_seqlens[B] == q_seqs.num_tokens, op,
              ": query cu_seqlens must run from 0 to num_tokens (", q_seqs.num_tokens, ")");
  pos_mark_.assign(static_cast<size_t>(seqs.max_seqlen), -1);
  for (int32_t b = 0; b < B; ++b) {
    const int32_t L = seqs.cu_seqlens[b + 1] - seqs.cu_seqlens[b];
    const int32_t q0 = q_seqs.cu_seqlens[b], q1 = q_seqs.cu_seqlens[b + 1];
    NOPAD_CHECK(q1 >= q0 && q1 - q0 <= L, op, ": sequence ", b, " has ", q1 - q0, " query rows for ", L, " rows");
    for (int32_t i = q0; i < q1; ++i) {
      const int32_t pos = q_seqs.row_positions[i];
      NOPAD_CHECK(pos >= 0 && pos < L, op, ": query row ", i, " has position ", pos, ", outside sequence ", b,
                  " (length ", L, ")");
      NOPAD_CHECK(pos_mark_[static_cast<size_t>(pos)] != b, op, ": position ", pos, " of sequence ", b,
                  " appears twice among the query rows");
      pos_mark_[static_cast<size_t>(pos)] = b;
    }
  }
}

// Queries: every row of each sequence (q_seqs null, q_qkv = qkv), or the rows of q_seqs at their positions. Keys and
// values: every row of the sequence.
template <class P>
void CpuBackend<P>::attention_forward_impl(const S* qkv, const SeqView& seqs, const S* q_qkv, const SeqView* q_seqs,
                                           int32_t num_heads, int32_t head_dim, const Dropout& drop, S* ctx,
                                           S* lse) {
  const int32_t H = num_heads * head_dim, L_max = seqs.max_seqlen;
  const int32_t Tq = q_seqs != nullptr ? q_seqs->num_tokens : seqs.num_tokens;
  const int64_t ld = 3 * int64_t{H};
  const S scale = S(1) / std::sqrt(static_cast<S>(head_dim));
  const DropoutMask mask(drop, DropoutMask::kAttention);
  const int workers = std::max(1, std::min<int>(threads_, seqs.num_seqs * num_heads));
  S* scores_all = scratch(kOpA, static_cast<size_t>(workers) * L_max);
  parallel_tasks(static_cast<size_t>(seqs.num_seqs) * num_heads, workers, [&](size_t task, size_t worker) {
    const int32_t b = static_cast<int32_t>(task / num_heads), h = static_cast<int32_t>(task % num_heads);
    const int32_t s0 = seqs.cu_seqlens[b], L = seqs.cu_seqlens[b + 1] - s0;
    const int32_t qs0 = q_seqs != nullptr ? q_seqs->cu_seqlens[b] : s0;
    const int32_t Lq = q_seqs != nullptr ? q_seqs->cu_seqlens[b + 1] - qs0 : L;
    const uint64_t sample = seqs.sample_ids[b];
    S* scores = scores_all + worker * L_max;
    for (int32_t i = 0; i < Lq; ++i) {
      const int64_t qrow = qs0 + i;  // the query's row of q_qkv, ctx and lse
      const uint32_t pos = static_cast<uint32_t>(q_seqs != nullptr ? q_seqs->row_positions[qrow] : i);
      const S* q = q_qkv + qrow * ld + h * head_dim;
      S mx = -std::numeric_limits<S>::infinity();
      for (int32_t j = 0; j < L; ++j) {
        scores[j] = scale * dot(q, qkv + (s0 + j) * ld + H + h * head_dim, head_dim);
        mx = std::max(mx, scores[j]);
      }
      S sum = 0;
      for (int32_t j = 0; j < L; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        sum += scores[j];
      }
      lse[int64_t{h} * Tq + qrow] = mx + std::log(sum);
      S* o = ctx + qrow * H + h * head_dim;
      std::fill_n(o, head_dim, S(0));
      for (int32_t j = 0; j < L; ++j) {
        const S p = scores[j] / sum * mask.template scale<S>(sample, element_attention(h, pos, j));
        if (p == S(0)) continue;
        const S* v = qkv + (s0 + j) * ld + 2 * H + h * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) o[d] += p * v[d];
      }
    }
  });
}

template <class P>
void CpuBackend<P>::attention_backward_impl(const S* d_ctx, const S* qkv, const SeqView& seqs, const S* q_qkv,
                                            const SeqView* q_seqs, const S* ctx, const S* lse, int32_t num_heads,
                                            int32_t head_dim, const Dropout& drop, S* d_qkv, S* d_qkv_bias) {
  const int32_t H = num_heads * head_dim, T = seqs.num_tokens;
  const int32_t Tq = q_seqs != nullptr ? q_seqs->num_tokens : T;
  const int64_t ld = 3 * int64_t{H};
  const S scale = S(1) / std::sqrt(static_cast<S>(head_dim));
  const DropoutMask mask(drop, DropoutMask::kAttention);
  // Task (b, h) owns the q, k and v columns of head h in the rows of sequence b: no two tasks write the same element.
  parallel_for(static_cast<size_t>(seqs.num_seqs) * num_heads, threads_, [&](size_t task) {
    const int32_t b = static_cast<int32_t>(task / num_heads), h = static_cast<int32_t>(task % num_heads);
    const int32_t s0 = seqs.cu_seqlens[b], L = seqs.cu_seqlens[b + 1] - s0;
    const int32_t qs0 = q_seqs != nullptr ? q_seqs->cu_seqlens[b] : s0;
    const int32_t Lq = q_seqs != nullptr ? q_seqs->cu_seqlens[b + 1] - qs0 : L;
    const uint64_t sample = seqs.sample_ids[b];
    for (int32_t j = 0; j < L; ++j) {
      if (q_seqs != nullptr) std::fill_n(d_qkv + (s0 + j) * ld + h * head_dim, head_dim, S(0));  // rows no query has
      std::fill_n(d_qkv + (s0 + j) * ld + H + h * head_dim, head_dim, S(0));
      std::fill_n(d_qkv + (s0 + j) * ld + 2 * H + h * head_dim, head_dim, S(0));
    }
    for (int32_t i = 0; i < Lq; ++i) {
      const int64_t qrow = qs0 + i;  // the query's row of q_qkv, d_ctx, ctx and lse
      const int32_t pos = q_seqs != nullptr ? q_seqs->row_positions[qrow] : i;
      const S* q = q_qkv + qrow * ld + h * head_dim;
      const S* d_o = d_ctx + qrow * H + h * head_dim;
      const S* o = ctx + qrow * H + h * head_dim;
      const S row_lse = lse[int64_t{h} * Tq + qrow];
      // D = sum_j P_ij dP_ij = dO . O (holds with dropout: both sides use the kept, rescaled probabilities).
      const S D = dot(d_o, o, head_dim);
      S* dq = d_qkv + (s0 + pos) * ld + h * head_dim;
      std::fill_n(dq, head_dim, S(0));
      for (int32_t j = 0; j < L; ++j) {
        const S* k = qkv + (s0 + j) * ld + H + h * head_dim;
        const S* v = qkv + (s0 + j) * ld + 2 * H + h * head_dim;
        const S p = std::exp(scale * dot(q, k, head_dim) - row_lse);
        const S keep = mask.template scale<S>(sample, element_attention(h, static_cast<uint32_t>(pos), j));
        S* dk = d_qkv + (s0 + j) * ld + H + h * head_dim;
        S* dv = d_qkv + (s0 + j) * ld + 2 * H + h * head_dim;
        const S pv = p * keep;
        if (pv != S(0))
          for (int32_t d = 0; d < head_dim; ++d) dv[d] += pv * d_o[d];
        const S d_score = p * (dot(d_o, v, head_dim) * keep - D) * scale;
        for (int32_t d = 0; d < head_dim; ++d) {
          dq[d] += d_score * k[d];
          dk[d] += d_score * q[d];
        }
      }
    }
  });
  if (d_qkv_bias) {  // the q and v blocks; the k bias has no gradient (ops.h)
    add_column_sums(d_qkv, T, H, d_qkv_bias, threads_, ld);
    add_column_sums(d_qkv + 2 * H, T, H, d_qkv_bias + 2 * H, threads_, ld);
  }
}

// ---------------------------------------------------------------------------------------------- residual + LN

template <class P>
void CpuBackend<P>::bias_dropout_residual_layernorm_forward(const S* x, const S* bias, const S* residual,
                                                            const S* ln_gamma, const S* ln_beta, const SeqView& seqs,
                                                            int32_t hidden, double ln_eps, const Dropout& drop,
                                                            S* out, S* ln_mean, S* ln_rstd) {
  const int32_t H = hidden, T = seqs.num_tokens;
  const int32_t* row_seq = row_to_seq(seqs);
  const DropoutMask mask(drop);
  const int64_t chunks = (T + kRowsPerChunk - 1) / kRowsPerChunk;
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t t1 = std::min<int64_t>(T, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    for (int64_t t = static_cast<int64_t>(c) * kRowsPerChunk; t < t1; ++t) {
      const int32_t b = row_seq[t];
      const uint32_t pos_in_seq = position_in_seq(seqs, t, b);
      S* o = out + t * H;
      for (int32_t j = 0; j < H; ++j)
        o[j] = (x[t * H + j] + bias[j]) *
                   mask.template scale<S>(seqs.sample_ids[b], element_hidden(pos_in_seq, static_cast<uint32_t>(j))) +
               residual[t * H + j];
      layernorm_row(o, H, ln_gamma, ln_beta, ln_eps, o, ln_mean[t], ln_rstd[t]);
    }
  });
}

template <class P>
void CpuBackend<P>::bias_dropout_residual_layernorm_backward(const S* d_out, const S* x, const S* bias,
                                                             const S* residual, const S* ln_gamma, const S* ln_mean,
                                                             const S* ln_rstd, const SeqView& seqs, int32_t hidden,
                                                             const Dropout& drop, S* d_x, S* d_residual, S* d_bias,
                                                             S* d_ln_gamma, S* d_ln_beta) {
  NOPAD_CHECK(d_residual != d_out, "bias_dropout_residual_layernorm_backward: d_residual must not alias d_out");
  const int32_t H = hidden, T = seqs.num_tokens;
  const int32_t* row_seq = row_to_seq(seqs);
  const DropoutMask mask(drop);
  const int64_t chunks = (T + kRowsPerChunk - 1) / kRowsPerChunk;
  S* partial = scratch(kPartials, static_cast<size_t>(chunks) * 3 * H);  // [chunk][d_gamma | d_beta | d_bias]
  std::fill_n(partial, chunks * 3 * H, S(0));
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t t1 = std::min<int64_t>(T, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    S* pg = partial + static_cast<int64_t>(c) * 3 * H;
    for (int64_t t = static_cast<int64_t>(c) * kRowsPerChunk; t < t1; ++t) {
      const int32_t b = row_seq[t];
      const uint32_t pos_in_seq = position_in_seq(seqs, t, b);
      S* dz = d_residual + t * H;  // holds the recomputed LayerNorm input first, then its gradient
      for (int32_t j = 0; j < H; ++j)
        dz[j] = (x[t * H + j] + bias[j]) *
                    mask.template scale<S>(seqs.sample_ids[b], element_hidden(pos_in_seq, static_cast<uint32_t>(j))) +
                residual[t * H + j];
      layernorm_row_backward(d_out + t * H, dz, ln_mean[t], ln_rstd[t], ln_gamma, H, dz, pg, pg + H);
      for (int32_t j = 0; j < H; ++j) {
        const S dxj =
            dz[j] * mask.template scale<S>(seqs.sample_ids[b], element_hidden(pos_in_seq, static_cast<uint32_t>(j)));
        d_x[t * H + j] = dxj;
        pg[2 * H + j] += dxj;
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int32_t j = 0; j < H; ++j) {
      const S* pg = partial + c * 3 * H;
      if (d_ln_gamma) d_ln_gamma[j] += pg[j];
      if (d_ln_beta) d_ln_beta[j] += pg[H + j];
      if (d_bias) d_bias[j] += pg[2 * H + j];
    }
}

template <class P>
void CpuBackend<P>::layernorm_rows_backward(const S* dy, const S* z, const S* mean, const S* rstd, const S* gamma,
                                            int64_t rows, int32_t H, S* dz, S* d_gamma, S* d_beta) {
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  S* partial = scratch(kPartials, static_cast<size_t>(chunks) * 2 * H);
  std::fill_n(partial, chunks * 2 * H, S(0));
  parallel_for(static_cast<size_t>(chunks), threads_, [&](size_t c) {
    const int64_t r1 = std::min<int64_t>(rows, (static_cast<int64_t>(c) + 1) * kRowsPerChunk);
    S* pg = partial + static_cast<int64_t>(c) * 2 * H;
    for (int64_t r = static_cast<int64_t>(c) * kRowsPerChunk; r < r1; ++r)
      layernorm_row_backward(dy + r * H, z + r * H, mean[r], rstd[r], gamma, H, dz + r * H, pg, pg + H);
  });
  for (int64_t c = 0; c < chunks; ++c)
    for (int32_t j = 0; j < H; ++j) {
      d_gamma[j] += partial[c * 2 * H + j];
      d_beta[j] += partial[c * 2 * H + H + j];
    }
}

// ---------------------------------------------------------------------------------------------- row gather / scatter

template <class P>
void CpuBackend<P>::gather_rows(const S* src, int64_t src_rows, const int32_t* rows, int32_t n, int32_t width,
                                S* dst) {
  NOPAD_CHECK(n >= 0 && width >= 0, "gather_rows: negative sizes");
  for (int32_t i = 0; i < n; ++i) {
    NOPAD_CHECK(rows[i] >= 0 && rows[i] < src_rows, "gather_rows: row ", rows[i], " at ", i, " outside [0, ",
                src_rows, ")");
    std::copy_n(src + int64_t{rows[i]} * width, width, dst + int64_t{i} * width);
  }
}

template <class P>
void CpuBackend<P>::scatter_rows(const S* src, const int32_t* rows, int32_t n, int32_t width, S* dst,
                                 int64_t dst_rows, bool accumulate) {
  NOPAD_CHECK(n >= 0 && width >= 0, "scatter_rows: negative sizes");
  std::vector<uint8_t>& seen = row_seen_;  // grow-only, like the scratch
  seen.assign(static_cast<size_t>(std::max<int64_t>(dst_rows, 0)), 0);
  for (int32_t i = 0; i < n; ++i) {
    NOPAD_CHECK(rows[i] >= 0 && rows[i] < dst_rows, "scatter_rows: row ", rows[i], " at ", i, " outside [0, ",
                dst_rows, ")");
    NOPAD_CHECK(!seen[rows[i]], "scatter_rows: row ", rows[i], " appears twice");
    seen[rows[i]] = 1;
    const S* s = src + int64_t{i} * width;
    S* d = dst + int64_t{rows[i]} * width;
    if (accumulate) {
      for (int32_t j = 0; j < width; ++j) d[j] += s[j];
    } else {
      std::copy_n(s, width, d);
    }
  }
}

// ---------------------------------------------------------------------------------------------- MLM head

template <class P>
void CpuBackend<P>::mlm_head_loss_forward(const S* hidden, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                          int32_t num_masked, const MlmHeadWeights<S>& w,
                                          const MlmHeadSaved<S, S>& saved, S* loss_sum, int32_t* num_correct) {
  const int32_t H = w.hidden, V = w.vocab_size, M = num_masked;
  NOPAD_CHECK(saved.probs_ld == 0 || saved.probs_ld == V, "the CPU MLM head takes contiguous logits rows (probs_ld ",
              saved.probs_ld, ", V ", V, ")");
  for (int32_t i = 0; i < M; ++i) {
    NOPAD_CHECK(mlm_positions[i] >= 0, "mlm position ", mlm_positions[i], " is negative");
    NOPAD_CHECK(mlm_labels[i] >= 0 && mlm_labels[i] < V, "mlm label ", mlm_labels[i], " outside vocab ", V);
    std::copy_n(hidden + int64_t{mlm_positions[i]} * H, H, saved.gathered + int64_t{i} * H);
  }
  dense_forward(saved.gathered, w.transform_weight, w.transform_bias, M, H, H, w.act,
                saved.transform_act, saved.transform_act_grad);
  parallel_for(static_cast<size_t>(M), threads_, [&](size_t i) {
    layernorm_row(saved.transform_act + i * H, H, w.ln_gamma, w.ln_beta, w.ln_eps, saved.ln_out + i * H,
                  saved.ln_mean[i], saved.ln_rstd[i]);
  }, 16);
  dense_forward(saved.ln_out, w.word_embeddings, w.output_bias, M, H, V, Activation::kNone, saved.probs, nullptr);
  S* row_loss = scratch(kOpA, static_cast<size_t>(M) * 2);  // [M] losses, [M] correct flags
  parallel_for(static_cast<size_t>(M), threads_, [&](size_t i) {
    S* logits = saved.probs + i * V;
    int32_t argmax = 0;
    for (int32_t v = 1; v < V; ++v)
      if (logits[v] > logits[argmax]) argmax = v;
    const S mx = logits[argmax];
    S sum = 0;
    for (int32_t v = 0; v < V; ++v) sum += std::exp(logits[v] - mx);
    const S lse = mx + std::log(sum);
    row_loss[i] = lse - logits[mlm_labels[i]];
    row_loss[M + i] = argmax == mlm_labels[i] ? S(1) : S(0);
    for (int32_t v = 0; v < V; ++v) logits[v] = std::exp(logits[v] - lse);
  });
  S total = 0;
  int32_t correct = 0;
  for (int32_t i = 0; i < M; ++i) {
    total += row_loss[i];
    correct += row_loss[M + i] != S(0);
  }
  *loss_sum = total;
  *num_correct = correct;
}

template <class P>
void CpuBackend<P>::mlm_head_loss_backward(double loss_scale, const int32_t* mlm_positions, const int32_t* mlm_labels,
                                           int32_t num_masked, const MlmHeadWeights<S>& w,
                                           const MlmHeadSaved<S, S>& saved, const MlmHeadGrads<S>& g, S* d_hidden) {
  const int32_t H = w.hidden, V = w.vocab_size, M = num_masked;
  NOPAD_CHECK(saved.probs_ld == 0 || saved.probs_ld == V, "the CPU MLM head takes contiguous logits rows (probs_ld ",
              saved.probs_ld, ", V ", V, ")");
  if (M == 0) return;
  const S scale = static_cast<S>(loss_scale);
  parallel_for(static_cast<size_t>(M), threads_, [&](size_t i) {  // d_logits = scale (softmax - onehot)
    S* d = saved.probs + i * V;
    for (int32_t v = 0; v < V; ++v) d[v] *= scale;
    d[mlm_labels[i]] -= scale;
  });
  S* d_ln_out = scratch(kOpA, static_cast<size_t>(M) * H);
  dense_backward(saved.probs, saved.ln_out, w.word_embeddings, nullptr, M, H, V, Activation::kNone, d_ln_out, false,
                 g.d_word_embeddings, g.d_output_bias);
  S* d_act = scratch(kOpB, static_cast<size_t>(M) * H);
  layernorm_rows_backward(d_ln_out, saved.transform_act, saved.ln_mean, saved.ln_rstd, w.ln_gamma, M, H, d_act,
                          g.d_ln_gamma, g.d_ln_beta);
  S* d_gathered = d_ln_out;  // no longer needed: reuse
  dense_backward(d_act, saved.gathered, w.transform_weight, saved.transform_act_grad, M, H, H, w.act,
                 d_gathered, false, g.d_transform_weight, g.d_transform_bias);
  for (int32_t i = 0; i < M; ++i) {  // serial: positions may repeat
    S* dh = d_hidden + int64_t{mlm_positions[i]} * H;
    for (int32_t j = 0; j < H; ++j) dh[j] += d_gathered[int64_t{i} * H + j];
  }
}

// ---------------------------------------------------------------------------------------------- NSP head

template <class P>
void CpuBackend<P>::nsp_head_loss_forward(const S* hidden, const SeqView& seqs, const int32_t* nsp_labels,
                                          const NspHeadWeights<S>& w, const NspHeadSaved<S>& saved, S* loss_sum,
                                          int32_t* num_correct) {
  const int32_t H = w.hidden, B = seqs.num_seqs;
  for (int32_t b = 0; b < B; ++b) {
    NOPAD_CHECK(nsp_labels[b] == 0 || nsp_labels[b] == 1, "nsp label ", nsp_labels[b], " of sequence ", b,
                " is not 0 or 1");
    std::copy_n(hidden + int64_t{seqs.cu_seqlens[b]} * H, H, saved.cls + int64_t{b} * H);
  }
  dense_forward(saved.cls, w.pooler_weight, w.pooler_bias, B, H, H, Activation::kNone, saved.pooled, nullptr);
  for (int64_t e = 0; e < int64_t{B} * H; ++e) saved.pooled[e] = std::tanh(saved.pooled[e]);
  S total = 0;
  int32_t correct = 0;
  for (int32_t b = 0; b < B; ++b) {
    S logit[2];
    for (int c = 0; c < 2; ++c)
      logit[c] = w.classifier_bias[c] + dot(saved.pooled + int64_t{b} * H, w.classifier_weight + c * H, H);
    const S mx = std::max(logit[0], logit[1]);
    const S lse = mx + std::log(std::exp(logit[0] - mx) + std::exp(logit[1] - mx));
    total += lse - logit[nsp_labels[b]];
    correct += (logit[1] > logit[0] ? 1 : 0) == nsp_labels[b];
    for (int c = 0; c < 2; ++c) saved.probs[b * 2 + c] = std::exp(logit[c] - lse);
  }
  *loss_sum = total;
  *num_correct = correct;
}

template <class P>
void CpuBackend<P>::nsp_head_loss_backward(double loss_scale, const SeqView& seqs, const int32_t* nsp_labels,
                                           const NspHeadWeights<S>& w, const NspHeadSaved<S>& saved,
                                           const NspHeadGrads<S>& g, S* d_hidden) {
  const int32_t H = w.hidden, B = seqs.num_seqs;
  if (B == 0) return;
  const S scale = static_cast<S>(loss_scale);
  for (int32_t b = 0; b < B; ++b) {
    saved.probs[b * 2 + 0] *= scale;
    saved.probs[b * 2 + 1] *= scale;
    saved.probs[b * 2 + nsp_labels[b]] -= scale;
  }
  S* d_pooled = scratch(kOpA, static_cast<size_t>(B) * H);
  dense_backward(saved.probs, saved.pooled, w.classifier_weight, nullptr, B, H, 2, Activation::kNone, d_pooled, false,
                 g.d_classifier_weight, g.d_classifier_bias);
  for (int64_t e = 0; e < int64_t{B} * H; ++e) d_pooled[e] *= S(1) - saved.pooled[e] * saved.pooled[e];
  S* d_cls = scratch(kOpB, static_cast<size_t>(B) * H);
  dense_backward(d_pooled, saved.cls, w.pooler_weight, nullptr, B, H, H, Activation::kNone, d_cls, false,
                 g.d_pooler_weight, g.d_pooler_bias);
  for (int32_t b = 0; b < B; ++b) {
    S* dh = d_hidden + int64_t{seqs.cu_seqlens[b]} * H;
    for (int32_t j = 0; j < H; ++j) dh[j] += d_cls[int64_t{b} * H + j];
  }
}

template class CpuBackend<CpuF32>;
template class CpuBackend<CpuF64>;

}  // namespace nopad::ops
