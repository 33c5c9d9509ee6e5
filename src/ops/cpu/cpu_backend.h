// The CPU reference backend: plain, readable implementations of every op in ops/ops.h, for CpuF32 (training on a
// machine without a GPU) and CpuF64 (finite-difference gradient checks). Both policies use one type for
// activations, weights, gradients and statistics, so the code computes in that single scalar type S.
// Multi-threaded with parallel_for over rows, sequences x heads, or GEMM tiles; every reduction has a fixed order, so
// results do not depend on the thread count.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/ops.h"

namespace nopad::ops {

template <class P>
class CpuBackend final : public Backend<P> {
 public:
  using S = typename P::Act;
  static_assert(std::is_same_v<S, typename P::Weight> && std::is_same_v<S, typename P::Grad> &&
                    std::is_same_v<S, typename P::Stat> && std::is_floating_point_v<S>,
                "the CPU backend computes in one floating-point type: use CpuF32 or CpuF64");

  // num_threads <= 0: all hardware threads.
  explicit CpuBackend(int num_threads = 0);
  const char* name() const override { return "cpu"; }
  int num_threads() const { return threads_; }

  void* allocate_bytes(size_t bytes) override;
  void free_bytes(void* ptr) override;
  void upload_bytes(void* dst, const void* host_src, size_t bytes) override;
  void download_bytes(void* host_dst, const void* src, size_t bytes) override;
  void zero_bytes(void* x, size_t bytes) override;

  void embed_layernorm_dropout_forward(const int32_t* tokens, const int32_t* positions, const int32_t* segments,
                                       const SeqView& seqs, const EmbeddingWeights<S>& w, const Dropout& drop,
                                       S* out, S* ln_mean, S* ln_rstd) override;
  void embed_layernorm_dropout_backward(const S* d_out, const int32_t* tokens, const int32_t* positions,
                                        const int32_t* segments, const SeqView& seqs, const EmbeddingWeights<S>& w,
                                        const Dropout& drop, const S* ln_mean, const S* ln_rstd,
                                        const EmbeddingGrads<S>& g) override;
  void dense_forward(const S* x, const S* weight, const S* bias, int64_t rows, int32_t k, int32_t n, Activation act,
                     S* y, S* act_grad) override;
  void dense_backward(const S* dy, const S* x, const S* weight, const S* act_grad, int64_t rows, int32_t k, int32_t n,
                      Activation act, S* dx, bool accumulate_dx, S* d_weight, S* d_bias) override;
  void dense_backward_through_act(const S* dy, const S* x, const S* x_act_grad, const S* weight, int64_t rows,
                                  int32_t k, int32_t n, Activation x_act, S* dx_pre, S* d_weight,
                                  S* d_x_bias) override;
  void attention_forward(const S* qkv, const SeqView& seqs, int32_t num_heads, int32_t head_dim, const Dropout& drop,
                         S* ctx, S* lse) override;
  void attention_backward(const S* d_ctx, const S* qkv, const S* ctx, const S* lse, const SeqView& seqs,
                          int32_t num_heads, int32_t head_dim, const Dropout& drop, S* d_qkv,
                          S* d_qkv_bias) override;
  void attention_forward_rows(const S* qkv, const SeqView& seqs, const S* q_qkv, const SeqView& q_seqs,
                              int32_t num_heads, int32_t head_dim, const Dropout& drop, S* ctx, S* lse) override;
  void attention_backward_rows(const S* d_ctx, const S* qkv, const SeqView& seqs, const S* q_qkv,
                               const SeqView& q_seqs, const S* ctx, const S* lse, int32_t num_heads, int32_t head_dim,
                               const Dropout& drop, S* d_qkv, S* d_qkv_bias) override;
  void bias_dropout_residual_layernorm_forward(const S* x, const S* bias, const S* residual, const S* ln_gamma,
                                               const S* ln_beta, const SeqView& seqs, int32_t hidden, double ln_eps,
                                               const Dropout& drop, S* out, S* ln_mean, S* ln_rstd) override;
  void bias_dropout_residual_layernorm_backward(const S* d_out, const S* x, const S* bias, const S* residual,
                                                const S* ln_gamma, const S* ln_mean, const S* ln_rstd,
                                                const SeqView& seqs, int32_t hidden, const Dropout& drop, S* d_x,
                                                S* d_residual, S* d_bias, S* d_ln_gamma, S* d_ln_beta) override;
  void gather_rows(const S* src, int64_t src_rows, const int32_t* rows, int32_t n, int32_t width, S* dst) override;
  void scatter_rows(const S* src, const int32_t* rows, int32_t n, int32_t width, S* dst, int64_t dst_rows,
                    bool accumulate) override;
  void mlm_head_loss_forward(const S* hidden, const int32_t* mlm_positions, const int32_t* mlm_labels,
                             int32_t num_masked, const MlmHeadWeights<S>& w, const MlmHeadSaved<S, S>& saved,
                             S* loss_sum, int32_t* num_correct) override;
  void mlm_head_loss_backward(double loss_scale, const int32_t* mlm_positions, const int32_t* mlm_labels,
                              int32_t num_masked, const MlmHeadWeights<S>& w, const MlmHeadSaved<S, S>& saved,
                              const MlmHeadGrads<S>& g, S* d_hidden) override;
  void nsp_head_loss_forward(const S* hidden, const SeqView& seqs, const int32_t* nsp_labels,
                             const NspHeadWeights<S>& w, const NspHeadSaved<S>& saved, S* loss_sum,
                             int32_t* num_correct) override;
  void nsp_head_loss_backward(double loss_scale, const SeqView& seqs, const int32_t* nsp_labels,
                              const NspHeadWeights<S>& w, const NspHeadSaved<S>& saved, const NspHeadGrads<S>& g,
                              S* d_hidden) override;

 private:
  // Grow-only scratch, one buffer per purpose so that an op holding one can call a helper that uses another.
  enum Slot { kTranspose, kDpre, kOpA, kOpB, kPartials, kNumSlots };
  S* scratch(Slot slot, size_t count);
  const int32_t* row_to_seq(const SeqView& seqs);  // [T] sequence index of each row (validates cu_seqlens)
  // Attention with queries = every row (q_seqs null: q_qkv is qkv) or the rows of q_seqs (check_query_rows first).
  void attention_forward_impl(const S* qkv, const SeqView& seqs, const S* q_qkv, const SeqView* q_seqs,
                              int32_t num_heads, int32_t head_dim, const Dropout& drop, S* ctx, S* lse);
  void attention_backward_impl(const S* d_ctx, const S* qkv, const SeqView& seqs, const S* q_qkv,
                               const SeqView* q_seqs, const S* ctx, const S* lse, int32_t num_heads, int32_t head_dim,
                               const Dropout& drop, S* d_qkv, S* d_qkv_bias);
  void check_query_rows(const SeqView& seqs, const SeqView& q_seqs, const char* op);
  void layernorm_rows_backward(const S* dy, const S* z, const S* mean, const S* rstd, const S* gamma, int64_t rows,
                               int32_t hidden, S* dz, S* d_gamma, S* d_beta);

  int threads_;
  std::vector<S> scratch_[kNumSlots];
  std::vector<int32_t> row_seq_;
  std::vector<uint8_t> row_seen_;  // scatter_rows' distinctness check
  std::vector<int32_t> pos_mark_;  // check_query_rows' distinctness check: the last sequence that used a position
};

extern template class CpuBackend<CpuF32>;
extern template class CpuBackend<CpuF64>;

}  // namespace nopad::ops
