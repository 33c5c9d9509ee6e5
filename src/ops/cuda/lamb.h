// FusedLamb: the LAMB optimiser on the GPU, with the semantics of the CPU twin nopad::Lamb (optim/optimizer.h, apex
// FusedLAMB): global gradient norm of grad_scale * g, clipping to max_grad_norm, bias correction, weight decay and
// trust ratio on decayed tensors only (TrustRatio::kAllTensors: on every tensor), skip on a non-finite norm.
//
// State (device memory, allocated once in the constructor): fp32 master weights, m and v over the flat parameter
// range [0, total_numel), a chunk table and per-chunk partial sums. The 16-bit weight copy the ops read is the model's
// params() buffer, passed to step(), which refreshes it from the master weights (round to nearest even). The copy is
// bf16 or fp16, chosen by the pointer type of step() / write_weight_copy() (the GpuBf16 or GpuF16 model's params());
// an fp16 copy saturates nothing: a master weight beyond +-65504 would become +-inf (BERT's weights stay far below).
//
// step() enqueues four kernels on the stream and returns: no host synchronisation, no allocation. Everything that
// decides the update (norm, clip factor, skip, step count, bias corrections) lives in device memory, so a skipped
// step (inf/NaN gradients, e.g. an overflowing fp16 loss scale) changes no weight, moment, 16-bit copy or step count. Every reduction has a fixed order
// (one partial per chunk, then a fixed tree), so results are bit-reproducible run to run.
//
// Work is cut into chunks of at most kChunk elements, never straddling a tensor; the table (tensor, start, length)
// is built at construction and one launch covers every tensor (the multi-tensor-apply pattern).
//
// Differences from the CPU twin (docs/cuda-lamb.md): sums of squares are fp32 (the CPU sums in double), so the
// reported norm and the trust ratios agree to ~1e-6 relative, and a gradient sum of squares above FLT_MAX (norm
// > ~1.8e19) counts as non-finite here. The element-wise arithmetic is the CPU's, in the same order, without FMA
// contraction.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "model/params.h"
#include "optim/optimizer.h"

namespace nopad::cuda {

// One tensor of the flat range: elements [offset, offset + numel).
struct LambTensor {
  size_t offset = 0;
  size_t numel = 0;
  bool no_weight_decay = false;
};

// The tensors of a model's ParamLayout, in layout order.
std::vector<LambTensor> lamb_tensors(const ParamLayout& layout);

class FusedLamb {
 public:
  static constexpr int kChunk = 16384;  // elements per chunk (one thread block each)

  // tensors: disjoint ranges within [0, total_numel). options.threads is ignored. Master weights start at zero:
  // call load_master() (and write_weight_copy()) before the first step. Throws nopad::Error on bad input.
  FusedLamb(std::vector<LambTensor> tensors, size_t total_numel, OptimizerOptions options, cudaStream_t stream);
  ~FusedLamb();
  FusedLamb(const FusedLamb&) = delete;
  FusedLamb& operator=(const FusedLamb&) = delete;

  // One update from grads [total_numel] (device, fp32, multiplied by grad_scale first: 1 / the loss scale); writes
  // the master weights and weight_copy [total_numel] (device, bf16 or fp16). Asynchronous on stream().
  void step(const float* grads, bf16* weight_copy, float lr, float grad_scale = 1.0f);
  void step(const float* grads, f16* weight_copy, float lr, float grad_scale = 1.0f);

  // What a step leaves for the host, read without waiting on the stream: copy state_size() bytes from
  // device_state() after step() (e.g. CudaBackend::download_bytes_async) and decode the host copy.
  struct Stats {
    double grad_norm = 0;  // ||grad_scale * g|| before clipping
    bool skipped = false;  // the step changed nothing (non-finite gradients)
    int64_t step = 0;      // completed, non-skipped steps after it
  };
  const void* device_state() const { return state_; }
  static size_t state_size();
  static Stats decode_state(const void* host_copy);

  // Results of the last step; each waits for the stream (call outside the step loop's hot path).
  double last_grad_norm() const;   // ||grad_scale * g|| before clipping (inf/NaN when the step was skipped)
  bool last_step_skipped() const;
  int64_t step_count() const;      // completed, non-skipped steps

  // Checkpoint I/O, host arrays of total_numel floats; each waits for the stream. load_* do not touch the 16-bit
  // copy: call write_weight_copy() after load_master().
  void load_master(const float* host);
  void download_master(float* host) const;
  void load_moments(const float* host_m, const float* host_v, int64_t step_count);
  void download_moments(float* host_m, float* host_v) const;
  void write_weight_copy(bf16* weight_copy);  // weight_copy = bf16(master), asynchronous
  void write_weight_copy(f16* weight_copy);   // weight_copy = fp16(master), asynchronous

  float* master() { return master_; }  // device [total_numel]
  const float* exp_avg() const { return m_; }
  const float* exp_avg_sq() const { return v_; }
  size_t total_numel() const { return total_; }
  size_t num_chunks() const { return num_chunks_; }
  cudaStream_t stream() const { return stream_; }
  const OptimizerOptions& options() const { return options_; }

  struct DeviceState;  // lamb.cu: norm, clip multiplier, bias corrections, skip flag, step count

 private:
  DeviceState read_state() const;
  template <class T>  // the device 16-bit type of the copy
  void step_impl(const float* grads, T* weight_copy, float lr, float grad_scale);
  template <class T>
  void write_copy_impl(T* weight_copy);

  std::vector<LambTensor> tensors_;
  size_t total_ = 0;
  OptimizerOptions options_;
  cudaStream_t stream_ = nullptr;
  size_t num_chunks_ = 0;
  float* master_ = nullptr;
  float* m_ = nullptr;
  float* v_ = nullptr;
  void* chunks_ = nullptr;        // device chunk table
  void* tensor_info_ = nullptr;   // device per-tensor info
  float* partial_g_ = nullptr;    // [num_chunks] sum of g^2
  float* partial_w_ = nullptr;    // [num_chunks] sum of w^2
  float* partial_u_ = nullptr;    // [num_chunks] sum of u^2
  DeviceState* state_ = nullptr;  // device
};

}  // namespace nopad::cuda
