// Variable-length fused multi-head attention on tensor cores (FMHA), forward and backward, for the CUDA backend.
// One plain parameter struct is the whole interface between the host and the kernels.
//
// Contract (the same as the CPU twin ops::Backend::attention_forward/backward in ops/cpu):
//   qkv [T, 3H] = [q | k | v], each block head-major (head h owns columns h*hd .. h*hd+hd-1), bf16 or fp16;
//   sequence b is rows [cu_seqlens[b], cu_seqlens[b+1]) and attends only to itself (no mask, no padding);
//   scores = q k^T * scale; P = softmax(scores); P' = dropout(P) with the Philox key of core/philox.h
//   (seed, step, op_id, sample_ids[b], element = (head, query pos, key pos)); ctx [T, H] = P' v;
//   lse [num_heads, T] (fp32) = log-sum-exp of each query row's scaled scores, kept for backward.
//   Backward regenerates P from q, k and lse, and the dropout mask from Philox; writes every element of d_qkv.
//   With d_qkv_bias set it also adds (fp32 atomics, any order) the column sums of d_qkv's q and v blocks over the
//   launch's rows, each element as written (rounded to 16 bits): the QKV projection's bias gradient, without a pass
//   that reads d_qkv. The k bias has no gradient (ops/ops.h), so d_qkv_bias[H, 2H) is not touched.
// Grouping (the grouped multi-stream scheduler): when seq_index is not null, a launch covers only the sequences
// seq_index[0 .. num_launch_seqs) (indices into cu_seqlens), so groups of sequences can run as separate launches on
// separate streams over the same tensors; max_seqlen is then the longest sequence of the group.
// Dropout follows core/philox.h's 8-bit attention contract: p must be in [0, 1 - 2^-8] (attention_dropout_p_supported)
// and runs as ceil(p * 256) / 256.
// Kernel variants (tile shapes, docs/fmha.md "Variants") are chosen per call: fwd_variant / bwd_variant when >= 0,
// else the environment variables NOPAD_FMHA_FWD_VARIANT / NOPAD_FMHA_BWD_VARIANT (read once per process) when set,
// else the built-in default. Every variant computes the same function (same mask bits; fp32 summation order differs).
// No host synchronisation, no allocation: the backward's fp32 scratch is the caller's (fmha_backward_workspace_bytes).
// It needs no initialisation: fmha_backward writes every workspace element that its launch reads (the D rows and
// the zeroed dq accumulator rows of the launch's sequences) before reading it, and touches no other rows, so
// launches over disjoint sequences may share one workspace.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/attention_groups.h"

namespace nopad::cuda {

// log2(e): the backward's lse2 = lse * kFmhaLog2e (exp2 of scores scaled by it is the softmax's exp).
inline constexpr float kFmhaLog2e = 1.4426950408889634f;

struct FmhaParams {
  const void* qkv = nullptr;      // [T, 3H]
  void* ctx = nullptr;            // [T, H]          forward output; backward input
  float* lse = nullptr;           // [num_heads, T]  forward output; backward input
  const void* d_ctx = nullptr;    // [T, H]          backward input
  void* d_qkv = nullptr;          // [T, 3H]         backward output
  float* d_qkv_bias = nullptr;    // [3H] fp32       backward, optional: += column sums of d_qkv's q, v blocks
  void* workspace = nullptr;      // backward scratch
  size_t workspace_bytes = 0;

  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], device
  const uint64_t* sample_ids = nullptr; // [num_seqs], device: dropout keys
  const int32_t* seq_index = nullptr;   // optional [num_launch_seqs], device: the sequences of this launch
  int32_t num_seqs = 0;                 // B
  int32_t num_launch_seqs = 0;          // sequences in this launch (= num_seqs when seq_index is null)
  int32_t num_tokens = 0;               // T
  int32_t max_seqlen = 0;               // longest sequence of this launch (host value)
  int32_t num_heads = 0;
  int32_t head_dim = 64;
  float scale = 0.125f;                 // 1/sqrt(head_dim)
  float dropout_p = 0.0f;
  uint64_t seed = 0, step = 0;
  uint32_t op_id = 0;
  bool fp16 = false;                    // element type: false = bf16, true = fp16
  int32_t fwd_variant = -1;             // forward kernel variant, -1 = default (see above)
  int32_t bwd_variant = -1;             // backward kernel variant, -1 = default
  // Query rows (optional; q_cu_seqlens null: every row of a sequence is a query). With q_cu_seqlens [num_seqs + 1]
  // set, the queries of sequence b are rows q_cu_seqlens[b] .. q_cu_seqlens[b + 1] - 1 of q_qkv [num_q_tokens, 3H]
  // (laid out as qkv; only its q block is read), query i sitting at position q_positions[i] of its sequence
  // (distinct within a sequence, < its length: the dropout key and where its dQ goes); ctx, d_ctx are then
  // [num_q_tokens, H] and lse [num_heads, num_q_tokens]. Keys and values stay every row of qkv. The backward writes
  // dQ of query i into d_qkv row cu_seqlens[b] + q_positions[i] and zeros into the q block of every other row (and its
  // workspace needs only num_q_tokens rows). max_q_seqlen: the most queries of one sequence. No grouping (seq_index
  // must be null). What the sparse last encoder layer runs: its queries are the rows the heads read (model/bert.h).
  const void* q_qkv = nullptr;            // [num_q_tokens, 3H]
  const int32_t* q_cu_seqlens = nullptr;  // [num_seqs + 1], device
  const int32_t* q_positions = nullptr;   // [num_q_tokens], device
  int32_t num_q_tokens = 0;
  int32_t max_q_seqlen = 0;
  // Backward: the caller has already done the first pass over every row of the workspace (fmha_backward_workspace
  // below: D and lse2 written, the dQ accumulator and the item counters zeroed), as the attention-output dx product's
  // epilogue does (CudaBackend::attention_output_backward); the launch then skips it. Not with query rows.
  bool prepared = false;
};

// The variants, for tests and benchmarks: count, and a short name of each ("m64w4" ...: tile rows x warps).
int fmha_forward_variant_count();
const char* fmha_forward_variant_name(int variant);
int fmha_backward_variant_count();
const char* fmha_backward_variant_name(int variant);
// The variant a call with these params runs (the field, else the environment, else the default).
int fmha_forward_variant(const FmhaParams& p);
int fmha_backward_variant(const FmhaParams& p);

// Whether fmha_backward can take FmhaParams::d_qkv_bias at these sizes (num_heads * head_dim <= 2048: its dQ
// conversion keeps one 8-column chunk per thread of a 256-thread block); elsewhere the caller sums d_qkv's columns.
bool fmha_backward_bias_supported(int32_t num_heads, int32_t head_dim);

// Bytes of scratch fmha_backward needs for these sizes.
size_t fmha_backward_workspace_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim);
// Where the first pass's results lie in the workspace (bytes): [0, zero_bytes) must be zero (the dQ accumulator, then
// the item counters, rounded up to whole 16-byte vectors; its extent depends on T and H = num_heads * head_dim alone),
// D [num_heads, T] fp32 at d_offset (D[h, t] = the sum over the head's columns of d_ctx * ctx, times
// fmha_backward_d_scale), lse2 [num_heads, T] fp32 at lse2_offset (lse * log2(e)); total_bytes =
// fmha_backward_workspace_bytes.
struct FmhaWorkspaceLayout {
  size_t zero_bytes = 0;
  size_t d_offset = 0;
  size_t lse2_offset = 0;
  size_t total_bytes = 0;
};
FmhaWorkspaceLayout fmha_backward_workspace_layout(int32_t num_tokens, int32_t num_heads, int32_t head_dim);
// The factor D carries: (256 - threshold) / 256 of the 8-bit attention dropout contract (1 without dropout).
float fmha_backward_d_scale(float dropout_p);
// Throws nopad::Error for unsupported head_dim/sizes; launch errors are checked.
void fmha_forward(const FmhaParams& p, cudaStream_t stream);
void fmha_backward(const FmhaParams& p, cudaStream_t stream);

// ---- grouped multi-stream launches (docs/fmha.md "Grouping"; the plan comes from ops/attention_groups.h)

// The side streams of grouped launches and the events that fork them from, and join them back to, the caller's
// stream. Made once at setup time (it creates streams and events); count in [1, AttentionSchedule::kMaxStreams].
class FmhaStreams {
 public:
  explicit FmhaStreams(int count);
  ~FmhaStreams();
  FmhaStreams(const FmhaStreams&) = delete;
  FmhaStreams& operator=(const FmhaStreams&) = delete;
  int count() const { return count_; }
  // Makes side streams 1 .. n-1 wait for the work enqueued on `stream` so far (n <= count()).
  void fork(cudaStream_t stream, int n);
  // Makes `stream` wait for everything enqueued on side streams 1 .. n-1.
  void join(cudaStream_t stream, int n);
  // Stream i of a plan: 0 is the caller's.
  cudaStream_t get(int i, cudaStream_t caller) const { return i == 0 ? caller : side_[i]; }

 private:
  int count_ = 1;
  cudaStream_t side_[ops::AttentionSchedule::kMaxStreams] = {};
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_[ops::AttentionSchedule::kMaxStreams] = {};
};

// Runs a plan's launches: group g covers the sequences order[g.begin .. g.begin + g.count) (plan.uses_order; order is
// the device copy of the length order the plan was cut from) or the whole batch in batch order (kSingle), with the
// group's max_seqlen, on stream g.stream (0 = `stream`). Everything is ordered after the work enqueued on `stream`
// before the call and before the work enqueued on it after the call; nothing waits on the host. p's seq_index,
// num_launch_seqs and max_seqlen are replaced per launch; its other fields are as for fmha_forward / fmha_backward
// (the backward's launches share p.workspace: they touch disjoint rows of it).
void fmha_forward_planned(const FmhaParams& p, const int32_t* order, const ops::AttentionPlan& plan,
                          FmhaStreams& streams, cudaStream_t stream);
void fmha_backward_planned(const FmhaParams& p, const int32_t* order, const ops::AttentionPlan& plan,
                           FmhaStreams& streams, cudaStream_t stream);

}  // namespace nopad::cuda
