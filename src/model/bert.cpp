// BertForPreTraining on the ops interface (see bert.h for the network and the memory contract).
#include "model/bert.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "ops/attention_groups.h"

namespace nopad {

template <class P>
template <class U>
U* BertModel<P>::alloc(size_t count) {
  void* p = backend_.allocate_bytes(std::max<size_t>(count, 1) * sizeof(U));
  allocations_.push_back(p);
  allocated_bytes_ += std::max<size_t>(count, 1) * sizeof(U);
  return static_cast<U*>(p);
}

// Mirrors the constructor's alloc calls below, in the same order (keep the two together).
template <class P>
uint64_t BertModel<P>::planned_bytes(const BertConfig& config, int64_t max_tokens, int64_t max_seqs,
                                     int64_t max_masked, int64_t probs_ld) {
  const uint64_t T = static_cast<uint64_t>(std::max<int64_t>(max_tokens, 0)),
                 B = static_cast<uint64_t>(std::max<int64_t>(max_seqs, 0)),
                 M = static_cast<uint64_t>(std::max<int64_t>(max_masked, 0)),
                 H = static_cast<uint64_t>(config.hidden_size), I = static_cast<uint64_t>(config.intermediate_size),
                 NH = static_cast<uint64_t>(config.num_attention_heads), L = static_cast<uint64_t>(config.num_hidden_layers),
                 V = static_cast<uint64_t>(probs_ld);
  const uint64_t a = sizeof(A), st = sizeof(St), i32 = sizeof(int32_t);
  uint64_t bytes = 0;
  const auto add = [&](uint64_t count, uint64_t size) { bytes += std::max<uint64_t>(count, 1) * size; };
  const uint64_t numel = ParamLayout(config).total_numel();
  add(numel, sizeof(W));
  add(numel, sizeof(G));
  for (uint64_t l = 0; l < L; ++l) {
    for (const uint64_t n : {T * 3 * H, T * H}) add(n, a);  // qkv, ctx
    add(NH * T, st);                                         // lse
    for (const uint64_t n : {T * H, T * H}) add(n, a);       // attn_dense, out1
    add(T, st), add(T, st);                                  // ln1
    for (const uint64_t n : {T * I, T * I, T * H, T * H}) add(n, a);  // inter_grad, inter_act, ffn_dense, out2
    add(T, st), add(T, st);                                           // ln2
  }
  const uint64_t N = std::min(T, B + M);
  for (int slot = 0; slot < 2; ++slot) add(N, i32), add(N, i32), add(B + 1, i32), add(M, i32);
  for (const uint64_t n : {N * H, N * H, N * H, N * 3 * H}) add(n, a);  // last_ctx, last_h, d_last_h, last_qkv
  for (int slot = 0; slot < 2; ++slot) {
    for (const uint64_t n : {T, T, T, B + 1, M, M, B}) add(n, i32);  // tokens .. nsp_labels
    add(B, sizeof(uint64_t));                                       // sample_ids
    add(B, i32);                                                    // by_length
  }
  add(T * H, a), add(T, st), add(T, st);                            // embeddings' output and LayerNorm
  for (const uint64_t n : {M * H, M * H, M * H}) add(n, a);         // MLM gathered, transform_act_grad, _act
  add(M, st), add(M, st), add(M * H, a), add(M * V, a);             // MLM LayerNorm, ln_out, probs
  add(B * H, a), add(B * H, a), add(B * 2, a);                      // NSP
  add(2, st), add(2, i32);                                          // loss sums, correct counts
  for (const uint64_t n : {T * H, T * H, T * H, T * H, T * 3 * H, T * I}) add(n, a);  // backward's buffers
  return bytes;
}

template <class P>
BertModel<P>::BertModel(const BertConfig& config, ops::Backend<P>& backend, int32_t max_tokens, int32_t max_seqs,
                        int32_t max_masked)
    : config_(config), backend_(backend), layout_(config), max_tokens_(max_tokens), max_seqs_(max_seqs),
      max_masked_(max_masked) {
  NOPAD_CHECK(max_tokens > 0 && max_seqs > 0 && max_masked >= 0 && max_seqs <= max_tokens,
              "BertModel: bad capacity (max_tokens ", max_tokens, ", max_seqs ", max_seqs, ", max_masked ",
              max_masked, ")");
  const size_t T = static_cast<size_t>(max_tokens), B = static_cast<size_t>(max_seqs),
               M = static_cast<size_t>(max_masked), H = static_cast<size_t>(config.hidden_size),
               I = static_cast<size_t>(config.intermediate_size), NH = static_cast<size_t>(config.num_attention_heads);
  params_ = alloc<W>(layout_.total_numel());
  grads_ = alloc<G>(layout_.total_numel());
  backend_.zero_bytes(params_, layout_.total_numel() * sizeof(W));
  backend_.zero_bytes(grads_, layout_.total_numel() * sizeof(G));

  for (int32_t l = 0; l < config.num_hidden_layers; ++l) {
    const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
    Layer L{};
    L.off_w_qkv = layout_.offset(p + "attention.self.query.weight");
    L.off_b_qkv = layout_.offset(p + "attention.self.query.bias");
    // The fused QKV views rely on the layout keeping q, k, v adjacent (params.h).
    NOPAD_CHECK(layout_.offset(p + "attention.self.value.weight") == L.off_w_qkv + 2 * H * H &&
                    layout_.offset(p + "attention.self.value.bias") == L.off_b_qkv + 2 * H,
                "parameter layout does not keep query/key/value adjacent");
    L.off_w_attn_out = layout_.offset(p + "attention.output.dense.weight");
    L.off_b_attn_out = layout_.offset(p + "attention.output.dense.bias");
    L.off_ln1_gamma = layout_.offset(p + "attention.output.LayerNorm.weight");
    L.off_ln1_beta = layout_.offset(p + "attention.output.LayerNorm.bias");
    L.off_w_inter = layout_.offset(p + "intermediate.dense.weight");
    L.off_b_inter = layout_.offset(p + "intermediate.dense.bias");
    L.off_w_out = layout_.offset(p + "output.dense.weight");
    L.off_b_out = layout_.offset(p + "output.dense.bias");
    L.off_ln2_gamma = layout_.offset(p + "output.LayerNorm.weight");
    L.off_ln2_beta = layout_.offset(p + "output.LayerNorm.bias");
    L.w_qkv = params_ + L.off_w_qkv;
    L.b_qkv = params_ + L.off_b_qkv;
    L.w_attn_out = params_ + L.off_w_attn_out;
    L.b_attn_out = params_ + L.off_b_attn_out;
    L.ln1_gamma = params_ + L.off_ln1_gamma;
    L.ln1_beta = params_ + L.off_ln1_beta;
    L.w_inter = params_ + L.off_w_inter;
    L.b_inter = params_ + L.off_b_inter;
    L.w_out = params_ + L.off_w_out;
    L.b_out = params_ + L.off_b_out;
    L.ln2_gamma = params_ + L.off_ln2_gamma;
    L.ln2_beta = params_ + L.off_ln2_beta;
    L.qkv = alloc<A>(T * 3 * H);
    L.ctx = alloc<A>(T * H);
    L.lse = alloc<St>(NH * T);
    L.attn_dense = alloc<A>(T * H);
    L.out1 = alloc<A>(T * H);
    L.ln1_mean = alloc<St>(T);
    L.ln1_rstd = alloc<St>(T);
    L.inter_grad = alloc<A>(T * I);
    L.inter_act = alloc<A>(T * I);
    L.ffn_dense = alloc<A>(T * H);
    L.out2 = alloc<A>(T * H);
    L.ln2_mean = alloc<St>(T);
    L.ln2_rstd = alloc<St>(T);
    layers_.push_back(L);
  }
  // Gradient buckets (bert.h): each layer's tensors must fill [lo, hi) alone (alignment gaps included) to be a bucket.
  {
    const size_t total = layout_.total_numel();
    std::vector<std::pair<size_t, size_t>> layer_ranges;  // [lo, hi) per layer
    bool ok = true;
    for (int32_t l = 0; l < config.num_hidden_layers && ok; ++l) {
      const std::string p = "bert.encoder.layer." + std::to_string(l) + ".";
      size_t lo = total, hi = 0;
      for (const ParamTensor& t : layout_.tensors())
        if (t.name.rfind(p, 0) == 0) lo = std::min(lo, t.offset), hi = std::max(hi, t.offset + t.numel);
      for (const ParamTensor& t : layout_.tensors())  // no other tensor inside
        if (t.name.rfind(p, 0) != 0 && t.offset < hi && t.offset + t.numel > lo) ok = false;
      ok = ok && lo < hi;
      layer_ranges.emplace_back(lo, hi);
    }
    // A layer's bucket also takes the alignment padding up to the next layer's first tensor (no tiny gap buckets).
    for (size_t l = 0; ok && l + 1 < layer_ranges.size(); ++l) {
      const size_t gap_lo = layer_ranges[l].second, gap_hi = layer_ranges[l + 1].first;
      bool empty = gap_lo <= gap_hi;
      for (const ParamTensor& t : layout_.tensors()) empty = empty && !(t.offset >= gap_lo && t.offset < gap_hi);
      if (empty) layer_ranges[l].second = gap_hi;
    }
    if (ok) {
      for (int32_t l = config.num_hidden_layers - 1; l >= 0; --l)
        grad_buckets_.emplace_back(layer_ranges[l].first, layer_ranges[l].second - layer_ranges[l].first);
      std::sort(layer_ranges.begin(), layer_ranges.end());
      size_t at = 0;
      for (const auto& [lo, hi] : layer_ranges) {  // the rest: the gaps between the layers' ranges
        if (lo > at) grad_buckets_.emplace_back(at, lo - at);
        at = std::max(at, hi);
      }
      if (at < total) grad_buckets_.emplace_back(at, total - at);
      layer_buckets_ = true;
    } else {
      grad_buckets_.assign(1, {0, total});
    }
  }

  // Rows of the sparse last layer: each sequence's [CLS] row and masked rows, at most T.
  const size_t N = std::min(T, B + M);
  if (const char* v = std::getenv("NOPAD_SPARSE_LAST_LAYER"); v != nullptr && std::strcmp(v, "0") == 0)
    sparse_last_layer_ = false;
  if (const char* v = std::getenv("NOPAD_SPARSE_LAST_ATTENTION"); v != nullptr && std::strcmp(v, "0") == 0)
    sparse_last_attention_ = false;
  for (BatchSlot& slot : slots_) {
    slot.last_rows = alloc<int32_t>(N);
    slot.last_positions = alloc<int32_t>(N);
    slot.last_cu_seqlens = alloc<int32_t>(B + 1);
    slot.last_mlm_positions = alloc<int32_t>(M);
    slot.host_last_rows.reserve(N);
    slot.host_last_positions.reserve(N);
    slot.host_last_cu_seqlens.reserve(B + 1);
    slot.host_last_mlm_positions.reserve(M);
  }
  host_row_mark_.reserve(T);
  last_ctx_ = alloc<A>(N * H);
  last_h_ = alloc<A>(N * H);
  d_last_h_ = alloc<A>(N * H);
  last_qkv_ = alloc<A>(N * 3 * H);
  for (BatchSlot& slot : slots_) {
    slot.tokens = alloc<int32_t>(T);
    slot.positions = alloc<int32_t>(T);
    slot.segments = alloc<int32_t>(T);
    slot.cu_seqlens = alloc<int32_t>(B + 1);
    slot.mlm_positions = alloc<int32_t>(M);
    slot.mlm_labels = alloc<int32_t>(M);
    slot.nsp_labels = alloc<int32_t>(B);
    slot.sample_ids = alloc<uint64_t>(B);
    slot.by_length = alloc<int32_t>(B);
    slot.host_by_length.reserve(B);
    slot.host_cu_seqlens.reserve(B + 1);
  }
  tokens_ = slots_[0].tokens;
  positions_ = slots_[0].positions;
  segments_ = slots_[0].segments;
  cu_seqlens_ = slots_[0].cu_seqlens;
  mlm_positions_ = slots_[0].mlm_positions;
  mlm_labels_ = slots_[0].mlm_labels;
  nsp_labels_ = slots_[0].nsp_labels;
  sample_ids_ = slots_[0].sample_ids;
  results_.resize(8);
  emb_out_ = alloc<A>(T * H);
  emb_mean_ = alloc<St>(T);
  emb_rstd_ = alloc<St>(T);
  mlm_saved_.gathered = alloc<A>(M * H);
  mlm_saved_.transform_act_grad = alloc<A>(M * H);
  mlm_saved_.transform_act = alloc<A>(M * H);
  mlm_saved_.ln_mean = alloc<St>(M);
  mlm_saved_.ln_rstd = alloc<St>(M);
  mlm_saved_.ln_out = alloc<A>(M * H);
  mlm_saved_.probs_ld = backend_.mlm_logits_row_stride(config.vocab_size);  // a GPU pads rows to 16 bytes
  mlm_saved_.probs = alloc<A>(M * static_cast<size_t>(mlm_saved_.probs_ld));
  nsp_saved_.cls = alloc<A>(B * H);
  nsp_saved_.pooled = alloc<A>(B * H);
  nsp_saved_.probs = alloc<A>(B * 2);
  loss_sums_ = alloc<St>(2);
  correct_ = alloc<int32_t>(2);
  d_hidden_ = alloc<A>(T * H);
  d_hidden2_ = alloc<A>(T * H);
  d_tmp_ = alloc<A>(T * H);
  d_ctx_ = alloc<A>(T * H);
  d_qkv_ = alloc<A>(T * 3 * H);
  d_inter_ = alloc<A>(T * I);
  resolve_head_tensors();
}

template <class P>
BertModel<P>::~BertModel() {
  for (void* p : allocations_) backend_.free_bytes(p);
}

template <class P>
template <class T>
void BertModel<P>::upload_converted(T* dst, const HostScalar* host) const {
  const size_t n = layout_.total_numel();
  if constexpr (std::is_same_v<T, HostScalar>) {
    backend_.upload_bytes(dst, host, n * sizeof(T));
  } else {
    std::vector<T> tmp(n);
    for (size_t i = 0; i < n; ++i) tmp[i] = convert<T>(host[i]);
    backend_.upload_bytes(dst, tmp.data(), n * sizeof(T));
  }
}
template <class P>
template <class T>
void BertModel<P>::download_converted(HostScalar* host, const T* src) const {
  const size_t n = layout_.total_numel();
  if constexpr (std::is_same_v<T, HostScalar>) {
    backend_.download_bytes(host, src, n * sizeof(T));
  } else {
    std::vector<T> tmp(n);
    backend_.download_bytes(tmp.data(), src, n * sizeof(T));
    for (size_t i = 0; i < n; ++i) host[i] = convert<HostScalar>(tmp[i]);
  }
}

template <class P>
void BertModel<P>::get_mlm_probabilities(std::vector<float>& out) const {
  NOPAD_CHECK(have_forward_, "get_mlm_probabilities: no forward has run");
  const size_t V = static_cast<size_t>(config_.vocab_size), M = static_cast<size_t>(num_masked_);
  const size_t ld = static_cast<size_t>(mlm_saved_.probs_ld > 0 ? mlm_saved_.probs_ld : config_.vocab_size);
  std::vector<A> rows(M * ld);
  if (M > 0) backend_.download_bytes(rows.data(), mlm_saved_.probs, rows.size() * sizeof(A));
  out.resize(M * V);
  for (size_t i = 0; i < M; ++i)
    for (size_t v = 0; v < V; ++v) out[i * V + v] = convert<float>(rows[i * ld + v]);
}

template <class P>
void BertModel<P>::init_params(uint64_t seed) {
  std::vector<HostScalar> host(layout_.total_numel());
  initialize_params(layout_, config_, seed, host.data());
  set_params(host.data());
}
template <class P>
void BertModel<P>::set_params(const HostScalar* host_params) {
  upload_converted(params_, host_params);
}
template <class P>
void BertModel<P>::get_params(HostScalar* host_params) const {
  download_converted(host_params, params_);
}
template <class P>
void BertModel<P>::get_grads(HostScalar* host_grads) const {
  download_converted(host_grads, grads_);
}
template <class P>
void BertModel<P>::zero_grad() {
  backend_.zero_bytes(grads_, layout_.total_numel() * sizeof(G));
}

template <class P>
ops::Dropout BertModel<P>::dropout(float p, uint32_t op_id) const {
  ops::Dropout d;
  d.p = train_ ? p : 0.0f;
  d.seed = seed_;
  d.step = step_;
  d.op_id = op_id;
  return d;
}

// The embedding and head tensors are looked up by name once: their pointers never move, and a per-step lookup would
// build strings inside the step.
template <class P>
void BertModel<P>::resolve_head_tensors() {
  emb_w_.word = param("bert.embeddings.word_embeddings.weight");
  emb_w_.position = param("bert.embeddings.position_embeddings.weight");
  emb_w_.token_type = param("bert.embeddings.token_type_embeddings.weight");
  emb_w_.ln_gamma = param("bert.embeddings.LayerNorm.weight");
  emb_w_.ln_beta = param("bert.embeddings.LayerNorm.bias");
  emb_w_.vocab_size = config_.vocab_size;
  emb_w_.max_positions = config_.max_position_embeddings;
  emb_w_.type_vocab_size = config_.type_vocab_size;
  emb_w_.hidden = config_.hidden_size;
  emb_w_.ln_eps = config_.layer_norm_eps;
  emb_g_.d_word = grad("bert.embeddings.word_embeddings.weight");
  emb_g_.d_position = grad("bert.embeddings.position_embeddings.weight");
  emb_g_.d_token_type = grad("bert.embeddings.token_type_embeddings.weight");
  emb_g_.d_ln_gamma = grad("bert.embeddings.LayerNorm.weight");
  emb_g_.d_ln_beta = grad("bert.embeddings.LayerNorm.bias");

  mlm_w_.transform_weight = param("cls.predictions.transform.dense.weight");
  mlm_w_.transform_bias = param("cls.predictions.transform.dense.bias");
  mlm_w_.ln_gamma = param("cls.predictions.transform.LayerNorm.weight");
  mlm_w_.ln_beta = param("cls.predictions.transform.LayerNorm.bias");
  mlm_w_.word_embeddings = param("bert.embeddings.word_embeddings.weight");  // tied decoder
  mlm_w_.output_bias = param("cls.predictions.bias");
  mlm_w_.padded_vocab = static_cast<int32_t>(padded_vocab_size(config_.vocab_size));  // the layout's zero rows
  mlm_w_.hidden = config_.hidden_size;
  mlm_w_.vocab_size = config_.vocab_size;
  mlm_w_.ln_eps = config_.layer_norm_eps;
  mlm_w_.act = activation();
  mlm_g_.d_transform_weight = grad("cls.predictions.transform.dense.weight");
  mlm_g_.d_transform_bias = grad("cls.predictions.transform.dense.bias");
  mlm_g_.d_ln_gamma = grad("cls.predictions.transform.LayerNorm.weight");
  mlm_g_.d_ln_beta = grad("cls.predictions.transform.LayerNorm.bias");
  mlm_g_.d_word_embeddings = grad("bert.embeddings.word_embeddings.weight");
  mlm_g_.d_output_bias = grad("cls.predictions.bias");

  nsp_w_.pooler_weight = param("bert.pooler.dense.weight");
  nsp_w_.pooler_bias = param("bert.pooler.dense.bias");
  nsp_w_.classifier_weight = param("cls.seq_relationship.weight");
  nsp_w_.classifier_bias = param("cls.seq_relationship.bias");
  nsp_w_.hidden = config_.hidden_size;
  nsp_g_.d_pooler_weight = grad("bert.pooler.dense.weight");
  nsp_g_.d_pooler_bias = grad("bert.pooler.dense.bias");
  nsp_g_.d_classifier_weight = grad("cls.seq_relationship.weight");
  nsp_g_.d_classifier_bias = grad("cls.seq_relationship.bias");
}

template <class P>
void BertModel<P>::set_result_capacity(size_t n) {
  NOPAD_CHECK(n >= 1, "BertModel::set_result_capacity needs at least 1");
  NOPAD_CHECK(results_made_ == 0, "BertModel::set_result_capacity must be called before the first forward");
  results_.assign(n, PendingResult{});
}

// The rows the heads read from the last layer (bert.h, sparse last layer): each sequence's first row ([CLS], what
// the NSP head reads) and its masked rows, in row order, so each sequence's rows stay together and its [CLS] row
// comes first (the NSP head finds it at last_cu_seqlens[b]). O(T) on the host, no allocation (capacities are fixed
// in the constructor).
template <class P>
void BertModel<P>::last_layer_rows(const HostBatch& batch, BatchSlot& slot) {
  const int32_t T = batch.num_tokens(), B = batch.num_seqs(), M = batch.num_masked();
  NOPAD_CHECK(batch.cu_seqlens[0] == 0 && batch.cu_seqlens[B] == T, "inconsistent batch: cu_seqlens run from ",
              batch.cu_seqlens[0], " to ", batch.cu_seqlens[B], ", not from 0 to the ", T, " tokens");
  for (int32_t b = 0; b < B; ++b)
    NOPAD_CHECK(batch.cu_seqlens[b + 1] > batch.cu_seqlens[b], "inconsistent batch: sequence ", b, " is empty");
  std::vector<int32_t>& mark = host_row_mark_;  // -1: not kept; else the row's index among the kept rows
  mark.assign(static_cast<size_t>(T), -1);
  for (int32_t b = 0; b < B; ++b) mark[batch.cu_seqlens[b]] = 0;
  for (int32_t i = 0; i < M; ++i) mark[batch.mlm_positions[i]] = 0;
  slot.host_last_rows.clear();
  slot.host_last_positions.clear();
  slot.host_last_cu_seqlens.assign(1, 0);
  int32_t max_rows = 0;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t s0 = batch.cu_seqlens[b], s1 = batch.cu_seqlens[b + 1];
    for (int32_t r = s0; r < s1; ++r) {
      if (mark[r] < 0) continue;
      mark[r] = static_cast<int32_t>(slot.host_last_rows.size());
      slot.host_last_rows.push_back(r);
      slot.host_last_positions.push_back(r - s0);
    }
    const int32_t n = static_cast<int32_t>(slot.host_last_rows.size());
    max_rows = std::max(max_rows, n - slot.host_last_cu_seqlens.back());
    slot.host_last_cu_seqlens.push_back(n);
  }
  slot.host_last_mlm_positions.resize(static_cast<size_t>(M));
  for (int32_t i = 0; i < M; ++i) slot.host_last_mlm_positions[i] = mark[batch.mlm_positions[i]];
  const int32_t N = static_cast<int32_t>(slot.host_last_rows.size());
  backend_.upload_bytes_async(slot.last_rows, slot.host_last_rows.data(), sizeof(int32_t) * N);
  backend_.upload_bytes_async(slot.last_positions, slot.host_last_positions.data(), sizeof(int32_t) * N);
  backend_.upload_bytes_async(slot.last_cu_seqlens, slot.host_last_cu_seqlens.data(), sizeof(int32_t) * (B + 1));
  backend_.upload_bytes_async(slot.last_mlm_positions, slot.host_last_mlm_positions.data(), sizeof(int32_t) * M);
  num_last_rows_ = N;
  last_seqs_ = ops::SeqView{N, B, max_rows, slot.last_cu_seqlens, slot.sample_ids};
  last_seqs_.row_positions = slot.last_positions;
  last_rows_ = slot.last_rows;
  last_mlm_positions_ = slot.last_mlm_positions;
}

template <class P>
uint64_t BertModel<P>::forward_async(const HostBatch& batch, bool train, uint64_t seed, uint64_t step,
                                     LossDenominators denoms) {
  const int32_t T = batch.num_tokens(), B = batch.num_seqs(), M = batch.num_masked();
  NOPAD_CHECK(T <= max_tokens_ && B <= max_seqs_ && M <= max_masked_, "batch (", T, " tokens, ", B, " sequences, ",
              M, " masked) exceeds the model's capacity (", max_tokens_, ", ", max_seqs_, ", ", max_masked_, ")");
  NOPAD_CHECK(B >= 1, "empty batch");
  NOPAD_CHECK(batch.positions.size() == static_cast<size_t>(T) && batch.segments.size() == static_cast<size_t>(T) &&
                  batch.cu_seqlens.size() == static_cast<size_t>(B) + 1 &&
                  batch.sample_ids.size() == static_cast<size_t>(B) &&
                  batch.mlm_labels.size() == static_cast<size_t>(M),
              "inconsistent batch: array sizes do not match");
  NOPAD_CHECK(batch.max_seqlen <= config_.max_position_embeddings, "max_seqlen ", batch.max_seqlen,
              " exceeds max_position_embeddings ", config_.max_position_embeddings);
  for (int32_t i = 0; i < M; ++i)
    NOPAD_CHECK(batch.mlm_positions[i] >= 0 && batch.mlm_positions[i] < T, "mlm position ", batch.mlm_positions[i],
                " outside [0, ", T, ")");
  // The other batch slot: its last reader (the forward/backward before the last) must be done before it is
  // overwritten; the copies run beside the compute work still in flight.
  cur_slot_ ^= 1;
  BatchSlot& slot = slots_[cur_slot_];
  backend_.uploads_wait(slot.free_fence);
  backend_.upload_bytes_async(slot.tokens, batch.tokens.data(), sizeof(int32_t) * T);
  backend_.upload_bytes_async(slot.positions, batch.positions.data(), sizeof(int32_t) * T);
  backend_.upload_bytes_async(slot.segments, batch.segments.data(), sizeof(int32_t) * T);
  backend_.upload_bytes_async(slot.cu_seqlens, batch.cu_seqlens.data(), sizeof(int32_t) * (B + 1));
  backend_.upload_bytes_async(slot.mlm_positions, batch.mlm_positions.data(), sizeof(int32_t) * M);
  backend_.upload_bytes_async(slot.mlm_labels, batch.mlm_labels.data(), sizeof(int32_t) * M);
  backend_.upload_bytes_async(slot.nsp_labels, batch.nsp_labels.data(), sizeof(int32_t) * B);
  backend_.upload_bytes_async(slot.sample_ids, batch.sample_ids.data(), sizeof(uint64_t) * B);
  // The length order, once per batch: every attention call of the step cuts its launches from it (no allocation:
  // the host vectors hold max_seqs from the constructor).
  slot.host_cu_seqlens.assign(batch.cu_seqlens.begin(), batch.cu_seqlens.end());
  slot.host_by_length.resize(static_cast<size_t>(B));
  ops::order_by_length(slot.host_cu_seqlens.data(), B, slot.host_by_length.data());
  backend_.upload_bytes_async(slot.by_length, slot.host_by_length.data(), sizeof(int32_t) * B);
  sparse_last_ = sparse_last_layer_ && config_.num_hidden_layers > 0;
  sparse_attn_ = sparse_last_ && sparse_last_attention_;
  if (sparse_last_) last_layer_rows(batch, slot);
  backend_.compute_waits_for_uploads();
  tokens_ = slot.tokens;
  positions_ = slot.positions;
  segments_ = slot.segments;
  cu_seqlens_ = slot.cu_seqlens;
  mlm_positions_ = slot.mlm_positions;
  mlm_labels_ = slot.mlm_labels;
  nsp_labels_ = slot.nsp_labels;
  sample_ids_ = slot.sample_ids;

  seqs_ = ops::SeqView{T, B, batch.max_seqlen, cu_seqlens_, sample_ids_};
  seqs_.by_length = slot.by_length;
  seqs_.host_by_length = slot.host_by_length.data();
  seqs_.host_cu_seqlens = slot.host_cu_seqlens.data();
  num_masked_ = M;
  train_ = train;
  seed_ = seed;
  step_ = step;
  mlm_denom_ = denoms.mlm > 0 ? denoms.mlm : std::max(1, M);
  nsp_denom_ = denoms.nsp > 0 ? denoms.nsp : B;
  const float p_hidden = static_cast<float>(config_.hidden_dropout_prob);
  const float p_attn = static_cast<float>(config_.attention_probs_dropout_prob);
  const int32_t H = config_.hidden_size, I = config_.intermediate_size, NH = config_.num_attention_heads;
  const double eps = config_.layer_norm_eps;

  backend_.embed_layernorm_dropout_forward(tokens_, positions_, segments_, seqs_, emb_w_,
                                           dropout(p_hidden, kOpIdEmbeddingDropout), emb_out_, emb_mean_, emb_rstd_);
  const A* h = emb_out_;
  for (int32_t l = 0; l < config_.num_hidden_layers; ++l) {
    Layer& L = layers_[l];
    // The layer after the QKV projection on R rows: all T, or in the sparse last layer the N rows the heads read
    // (there the attention has them as its only queries, with every row as a key and value).
    const bool sparse = sparse_last_ && l == config_.num_hidden_layers - 1;
    const int32_t R = sparse ? num_last_rows_ : T;
    const ops::SeqView& rows = sparse ? last_seqs_ : seqs_;
    backend_.dense_forward(h, L.w_qkv, L.b_qkv, T, H, 3 * H, ops::Activation::kNone, L.qkv, nullptr);
    const ops::Dropout attn_drop = dropout(p_attn, op_id_attention_probs(l));
    if (sparse && sparse_attn_) {
      backend_.gather_rows(L.qkv, T, last_rows_, R, 3 * H, last_qkv_);
      backend_.attention_forward_rows(L.qkv, seqs_, last_qkv_, last_seqs_, NH, config_.head_dim(), attn_drop,
                                      last_ctx_, L.lse);
    } else {
      backend_.attention_forward(L.qkv, seqs_, NH, config_.head_dim(), attn_drop, L.ctx, L.lse);
    }
    const A* ctx = L.ctx;
    const A* residual = h;
    if (sparse) {
      if (!sparse_attn_) backend_.gather_rows(L.ctx, T, last_rows_, R, H, last_ctx_);
      backend_.gather_rows(h, T, last_rows_, R, H, last_h_);
      ctx = last_ctx_;
      residual = last_h_;
    }
    backend_.dense_forward(ctx, L.w_attn_out, nullptr, R, H, H, ops::Activation::kNone, L.attn_dense, nullptr);
    backend_.bias_dropout_residual_layernorm_forward(L.attn_dense, L.b_attn_out, residual, L.ln1_gamma, L.ln1_beta,
                                                     rows, H, eps, dropout(p_hidden, op_id_attention_output(l)),
                                                     L.out1, L.ln1_mean, L.ln1_rstd);
    backend_.dense_forward(L.out1, L.w_inter, L.b_inter, R, H, I, activation(), L.inter_act, L.inter_grad);
    backend_.dense_forward(L.inter_act, L.w_out, nullptr, R, I, H, ops::Activation::kNone, L.ffn_dense, nullptr);
    backend_.bias_dropout_residual_layernorm_forward(L.ffn_dense, L.b_out, L.out1, L.ln2_gamma, L.ln2_beta, rows, H,
                                                     eps, dropout(p_hidden, op_id_ffn_output(l)), L.out2, L.ln2_mean,
                                                     L.ln2_rstd);
    h = L.out2;
  }
  // The heads read the last layer's output: [T, H], or [N, H] with the masked rows and [CLS] rows renumbered.
  if (M > 0) {
    backend_.mlm_head_loss_forward(h, sparse_last_ ? last_mlm_positions_ : mlm_positions_, mlm_labels_, M, mlm_w_,
                                   mlm_saved_, loss_sums_, correct_);
  } else {
    backend_.zero_bytes(loss_sums_, sizeof(St));
  }
  backend_.nsp_head_loss_forward(h, sparse_last_ ? last_seqs_ : seqs_, nsp_labels_, nsp_w_, nsp_saved_,
                                 loss_sums_ + 1, correct_ + 1);
  slot.free_fence = backend_.fence_compute();  // backward moves it later

  // The loss sums go back without a wait; the next forward may overwrite the device copies (the download is
  // ordered before it).
  const uint64_t ticket = ++results_made_;
  PendingResult& r = results_[ticket % results_.size()];
  if (r.ticket != 0) {  // a result nobody read: finish its downloads before the slot is reused
    backend_.wait_download(r.dl_sums);
    backend_.wait_download(r.dl_correct);
  }
  r.ticket = ticket;
  r.num_masked = M;
  r.num_seqs = B;
  r.mlm_denom = mlm_denom_;
  r.nsp_denom = nsp_denom_;
  r.dl_sums = backend_.download_bytes_async(r.sums, loss_sums_, sizeof(r.sums));
  r.dl_correct = backend_.download_bytes_async(r.correct, correct_, sizeof(r.correct));
  have_forward_ = true;
  return ticket;
}

template <class P>
StepResult BertModel<P>::forward(const HostBatch& batch, bool train, uint64_t seed, uint64_t step,
                                 LossDenominators denoms) {
  return read_result(forward_async(batch, train, seed, step, denoms));
}

template <class P>
StepResult BertModel<P>::read_result() {
  NOPAD_CHECK(results_made_ > 0, "BertModel::read_result needs a forward first");
  return read_result(results_made_);
}

template <class P>
StepResult BertModel<P>::read_result(uint64_t ticket) {
  NOPAD_CHECK(ticket >= 1 && ticket <= results_made_ && results_made_ - ticket < results_.size(),
              "BertModel::read_result: ticket ", ticket, " is not one of the last ", results_.size(),
              " forwards (", results_made_, " made; raise set_result_capacity)");
  PendingResult& p = results_[ticket % results_.size()];
  backend_.wait_download(p.dl_sums);
  backend_.wait_download(p.dl_correct);
  const int32_t M = p.num_masked, B = p.num_seqs;
  StepResult r;
  r.mlm_loss = static_cast<double>(p.sums[0]) / p.mlm_denom;
  r.nsp_loss = static_cast<double>(p.sums[1]) / p.nsp_denom;
  r.loss = r.mlm_loss + r.nsp_loss;
  r.mlm_correct = M == 0 ? 0 : p.correct[0];
  r.mlm_count = M;
  r.nsp_correct = p.correct[1];
  r.nsp_count = B;
  return r;
}

template <class P>
void BertModel<P>::backward(double loss_scale) {
  NOPAD_CHECK(have_forward_, "BertModel::backward needs a forward first (and runs once per forward)");
  have_forward_ = false;
  const int32_t T = seqs_.num_tokens, H = config_.hidden_size, I = config_.intermediate_size,
                NH = config_.num_attention_heads;
  const float p_hidden = static_cast<float>(config_.hidden_dropout_prob);
  const float p_attn = static_cast<float>(config_.attention_probs_dropout_prob);
  G* g = grads_;

  // Both heads scatter-add into d_hidden (the last layer's output gradient: [T, H], or [N, H] when sparse).
  const int32_t R_last = sparse_last_ ? num_last_rows_ : T;
  backend_.zero_bytes(d_hidden_, static_cast<size_t>(R_last) * H * sizeof(A));
  if (num_masked_ > 0) {
    backend_.mlm_head_loss_backward(loss_scale / mlm_denom_, sparse_last_ ? last_mlm_positions_ : mlm_positions_,
                                    mlm_labels_, num_masked_, mlm_w_, mlm_saved_, mlm_g_, d_hidden_);
  }
  backend_.nsp_head_loss_backward(loss_scale / nsp_denom_, sparse_last_ ? last_seqs_ : seqs_, nsp_labels_, nsp_w_,
                                  nsp_saved_, nsp_g_, d_hidden_);

  for (int32_t l = config_.num_hidden_layers - 1; l >= 0; --l) {
    Layer& L = layers_[l];
    const A* h_in = l == 0 ? emb_out_ : layers_[l - 1].out2;
    const bool sparse = sparse_last_ && l == config_.num_hidden_layers - 1;  // as in forward
    const int32_t R = sparse ? num_last_rows_ : T;
    const ops::SeqView& rows = sparse ? last_seqs_ : seqs_;
    // d_hidden_ = d(out2). Output block: d_tmp = d(ffn_dense), d_hidden2_ = d(out1) (residual path).
    backend_.bias_dropout_residual_layernorm_backward(d_hidden_, L.ffn_dense, L.b_out, L.out1, L.ln2_gamma,
                                                      L.ln2_mean, L.ln2_rstd, rows, H,
                                                      dropout(p_hidden, op_id_ffn_output(l)), d_tmp_, d_hidden2_,
                                                      g + L.off_b_out, g + L.off_ln2_gamma, g + L.off_ln2_beta);
    // d_inter_ = d(intermediate pre-activation) = (d_tmp_ W_out) * inter_grad (the saved GELU derivative): the GELU's
    // backward and d(b_inter) fold into the FFN output layer's dx product.
    backend_.dense_backward_through_act(d_tmp_, L.inter_act, L.inter_grad, L.w_out, R, I, H, activation(), d_inter_,
                                        g + L.off_w_out, g + L.off_b_inter);
    backend_.dense_backward(d_inter_, L.out1, L.w_inter, nullptr, R, H, I, ops::Activation::kNone, d_hidden2_,
                            /*accumulate_dx=*/true, g + L.off_w_inter, nullptr);
    // Attention block: d_tmp = d(attn_dense), d(h_in) from the residual path into d_hidden_ (sparse: d_last_h_, the
    // N rows', spread over the T rows below).
    backend_.bias_dropout_residual_layernorm_backward(d_hidden2_, L.attn_dense, L.b_attn_out,
                                                      sparse ? last_h_ : h_in, L.ln1_gamma, L.ln1_mean, L.ln1_rstd,
                                                      rows, H, dropout(p_hidden, op_id_attention_output(l)), d_tmp_,
                                                      sparse ? d_last_h_ : d_hidden_, g + L.off_b_attn_out,
                                                      g + L.off_ln1_gamma, g + L.off_ln1_beta);
    // d(b_qkv) comes out of the attention backward (the column sums of d_qkv as it writes them).
    const ops::Dropout attn_drop = dropout(p_attn, op_id_attention_probs(l));
    if (sparse) {
      // d(ctx) of the N rows (in d_hidden2_, free again); d(h_in) spread over [T, H] with zeros in the rows the heads
      // never read, so that the QKV backward adds into it as in the other layers.
      backend_.dense_backward(d_tmp_, last_ctx_, L.w_attn_out, nullptr, R, H, H, ops::Activation::kNone, d_hidden2_,
                              false, g + L.off_w_attn_out, nullptr);
      backend_.zero_bytes(d_hidden_, static_cast<size_t>(T) * H * sizeof(A));
      backend_.scatter_rows(d_last_h_, last_rows_, R, H, d_hidden_, T, /*accumulate=*/false);
      if (sparse_attn_) {
        backend_.attention_backward_rows(d_hidden2_, L.qkv, seqs_, last_qkv_, last_seqs_, last_ctx_, L.lse, NH,
                                         config_.head_dim(), attn_drop, d_qkv_, g + L.off_b_qkv);
      } else {  // all T rows were queries: d(ctx) is zero outside the N rows
        backend_.zero_bytes(d_ctx_, static_cast<size_t>(T) * H * sizeof(A));
        backend_.scatter_rows(d_hidden2_, last_rows_, R, H, d_ctx_, T, /*accumulate=*/false);
        backend_.attention_backward(d_ctx_, L.qkv, L.ctx, L.lse, seqs_, NH, config_.head_dim(), attn_drop, d_qkv_,
                                    g + L.off_b_qkv);
      }
    } else {  // d(ctx) = d_tmp W_attn_out into d_ctx_, then the attention backward (one op: a backend may fuse them)
      backend_.attention_output_backward(d_tmp_, L.w_attn_out, L.qkv, L.ctx, L.lse, seqs_, NH, config_.head_dim(),
                                         attn_drop, d_ctx_, g + L.off_w_attn_out, d_qkv_, g + L.off_b_qkv);
    }
    backend_.dense_backward(d_qkv_, h_in, L.w_qkv, nullptr, T, H, 3 * H, ops::Activation::kNone, d_hidden_,
                            /*accumulate_dx=*/true, g + L.off_w_qkv, nullptr);
    // Layer l's gradients are final once this is enqueued: its bucket can be reduced while backward goes on.
    if (grad_hook_ && grad_hook_armed_ && layer_buckets_) {
      const auto& b = grad_buckets_[static_cast<size_t>(config_.num_hidden_layers - 1 - l)];
      grad_hook_(b.first, b.second);
    }
  }
  backend_.embed_layernorm_dropout_backward(d_hidden_, tokens_, positions_, segments_, seqs_, emb_w_,
                                            dropout(p_hidden, kOpIdEmbeddingDropout), emb_mean_, emb_rstd_, emb_g_);
  if (grad_hook_ && grad_hook_armed_) {  // the rest (embeddings, pooler, heads), or the whole buffer
    for (size_t i = layer_buckets_ ? static_cast<size_t>(config_.num_hidden_layers) : 0; i < grad_buckets_.size(); ++i)
      grad_hook_(grad_buckets_[i].first, grad_buckets_[i].second);
  }
  slots_[cur_slot_].free_fence = backend_.fence_compute();
}

template class BertModel<ops::CpuF32>;
template class BertModel<ops::CpuF64>;
template class BertModel<ops::GpuBf16>;  // driven by the CUDA backend; needs no CUDA headers
template class BertModel<ops::GpuF16>;   // likewise

}  // namespace nopad
