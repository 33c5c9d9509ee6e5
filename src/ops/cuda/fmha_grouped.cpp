// Grouped multi-stream FMHA launches (fmha.h, docs/fmha.md "Grouping"): one fmha_forward / fmha_backward per group of
// an ops::AttentionPlan, on streams forked from the caller's stream and joined back to it with events. Host code only.
#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/fmha.h"

namespace nopad::cuda {

FmhaStreams::FmhaStreams(int count) : count_(count) {
  NOPAD_CHECK(count >= 1 && count <= ops::AttentionSchedule::kMaxStreams, "FmhaStreams: count must be in [1, ",
              ops::AttentionSchedule::kMaxStreams, "], got ", count);
  NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  for (int i = 1; i < count_; ++i) {
    NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&side_[i], cudaStreamNonBlocking));
    NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&join_[i], cudaEventDisableTiming));
  }
}

FmhaStreams::~FmhaStreams() {
  // Destructors do not throw: statuses are dropped here (the streams' work was joined into the caller's stream).
  for (int i = 1; i < count_; ++i) {
    if (side_[i] != nullptr) cudaStreamDestroy(side_[i]);
    if (join_[i] != nullptr) cudaEventDestroy(join_[i]);
  }
  if (fork_ != nullptr) cudaEventDestroy(fork_);
}

void FmhaStreams::fork(cudaStream_t stream, int n) {
  NOPAD_CHECK(n >= 1 && n <= count_, "FmhaStreams::fork: ", n, " streams asked of ", count_);
  if (n == 1) return;
  NOPAD_CUDA_CHECK(cudaEventRecord(fork_, stream));
  for (int i = 1; i < n; ++i) NOPAD_CUDA_CHECK(cudaStreamWaitEvent(side_[i], fork_, 0));
}

void FmhaStreams::join(cudaStream_t stream, int n) {
  for (int i = 1; i < n; ++i) {
    NOPAD_CUDA_CHECK(cudaEventRecord(join_[i], side_[i]));
    NOPAD_CUDA_CHECK(cudaStreamWaitEvent(stream, join_[i], 0));
  }
}

namespace {

template <class Launch>
void run_planned(const FmhaParams& p, const int32_t* order, const ops::AttentionPlan& plan, FmhaStreams& streams,
                 cudaStream_t stream, Launch launch) {
  NOPAD_CHECK(plan.num_groups >= 0 && plan.num_groups <= ops::AttentionPlan::kMaxGroups,
              "fmha planned launch: bad plan (", plan.num_groups, " groups)");
  NOPAD_CHECK(plan.num_streams <= streams.count(), "fmha planned launch: the plan uses ", plan.num_streams,
              " streams, only ", streams.count(), " were made");
  NOPAD_CHECK(!plan.uses_order || order != nullptr, "fmha planned launch: the plan needs the length order");
  streams.fork(stream, plan.num_streams);
  for (int i = 0; i < plan.num_groups; ++i) {
    const ops::AttentionGroup& g = plan.groups[i];
    FmhaParams q = p;
    q.seq_index = plan.uses_order ? order + g.begin : nullptr;
    q.num_launch_seqs = plan.uses_order ? g.count : p.num_seqs;
    q.max_seqlen = g.max_seqlen;
    launch(q, streams.get(g.stream, stream));
  }
  streams.join(stream, plan.num_streams);
}

}  // namespace

void fmha_forward_planned(const FmhaParams& p, const int32_t* order, const ops::AttentionPlan& plan,
                          FmhaStreams& streams, cudaStream_t stream) {
  run_planned(p, order, plan, streams, stream, [](const FmhaParams& q, cudaStream_t s) { fmha_forward(q, s); });
}

void fmha_backward_planned(const FmhaParams& p, const int32_t* order, const ops::AttentionPlan& plan,
                           FmhaStreams& streams, cudaStream_t stream) {
  run_planned(p, order, plan, streams, stream, [](const FmhaParams& q, cudaStream_t s) { fmha_backward(q, s); });
}

}  // namespace nopad::cuda
