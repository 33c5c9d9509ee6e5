// The attention benchmark (`nopad bench attention`): forward, backward and forward+backward time of the fused
// attention on real batch lengths, for each launch schedule (ops/attention_groups.h: one launch, one launch longest
// first, length groups on 1..K streams) and dropout probability, as one JSON line per measurement; optionally every
// kernel variant on every length group (to choose per-group kernels). The lengths come from a prepared dataset (the
// batches `nopad bench model` would draw with the same seed) or a 'length [masked]' file, and can be written out for
// the PyTorch attention peer. Plain C++: the GPU part is reached through ops/cuda/attention_bench.h in CUDA builds.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace nopad {

struct AttentionBenchOptions {
  std::string data;      // dataset folder (batches drawn as bench model draws them), or
  std::string lengths;   // a file of 'length [masked]' lines, cut into batches in file order
  uint64_t batch = 128;  // sequences per batch
  uint64_t batches = 3;  // batches measured
  uint64_t seed = 1;     // shuffle seed (with --data) and input values
  int heads = 16, head_dim = 64;
  std::string precision = "bf16";  // bf16 or fp16
  std::vector<double> dropouts = {0.0, 0.1};
  std::vector<std::string> schedules = {"single", "sorted", "grouped"};
  std::vector<int> streams = {1, 4};   // grouped: each stream count
  std::vector<int> buckets = {64};     // grouped: each bucket width (tokens)
  bool variants = false;  // also time every kernel variant on each length group of the grouped plan
  bool bias_grad = false;  // the backward also sums the QKV bias gradient (FmhaParams::d_qkv_bias), as training does
  int warmup = 3, reps = 20;
  std::string workload;   // write the batches' 'length masked' lines here (for peers/peer_attention.py)
};

// The batches' sequence lengths (and masked counts, for the workload file), CPU only.
struct AttentionBenchBatches {
  std::vector<std::vector<int32_t>> lengths, masked;
};
AttentionBenchBatches attention_bench_batches(const AttentionBenchOptions& o);
// Forward FLOPs of the attention products (QK^T and PV) over a batch: 4 L^2 head_dim heads per sequence; the
// benchmark counts forward+backward as 3.5x this, as the peers do.
double attention_forward_flops(const std::vector<int32_t>& lengths, int heads, int head_dim);

// Runs the benchmark on the GPU (throws nopad::Error without the CUDA backend or a GPU). Returns the JSON lines; a
// table goes to stderr.
std::vector<std::string> run_attention_bench(const AttentionBenchOptions& o);

}  // namespace nopad
