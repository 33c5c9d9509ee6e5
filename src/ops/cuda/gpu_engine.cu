// The GPU TrainEngine (see gpu_engine.h and train/engine.h), one class template over the precision policy: GpuBf16
// (bf16 ops) or GpuF16 (fp16 ops, run with the trainer's loss scale).
#include "ops/cuda/gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "model/params.h"
#include "ops/cuda/check.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/grad_cast.h"
#include "ops/cuda/grad_clip.h"
#include "ops/cuda/lamb.h"
#include "ops/cuda/nccl_comm.h"

namespace nopad::cuda {

bool cuda_device_visible(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky slot: later checks must not see it
    if (why) *why = cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why) *why = "the driver reports 0 devices";
    return false;
  }
  return true;
}

namespace {

template <class P>
class GpuEngine final : public TrainEngine {
 public:
  explicit GpuEngine(const EngineOptions& o)
      : backend_(o.device),
        model_(o.config, backend_, o.max_tokens, o.max_seqs, o.max_masked),
        lamb_(lamb_tensors(model_.layout()), model_.num_params(), o.optim, backend_.stream()),
        host_params_(model_.num_params(), 0.0f),
        host_m_(model_.num_params(), 0.0f),
        host_v_(model_.num_params(), 0.0f),
        micro_per_step_(std::max(1, o.micro_batches_per_step)),
        timeout_s_(o.dist_timeout_s),
        overlap_(o.overlap_grad_reduce),
        nccl_max_ctas_(o.nccl_max_ctas),
        bucket_clip_norm_(o.bucket_clip_norm),
        world_size_(std::max(1, o.world_size)),
        reduce_bf16_(o.reduce_bf16) {
    // Room for every result of the unread steps, the step being built and a few evaluation forwards.
    model_.set_result_capacity(static_cast<size_t>(kMaxStepsInFlight + 1) * micro_per_step_ + 4);
    for (PendingStep& p : steps_) {
      p.tickets.reserve(static_cast<size_t>(micro_per_step_));
      p.stats_host.assign(FusedLamb::state_size(), 0);
      NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
      for (cudaEvent_t* e : std::array<cudaEvent_t*, 3>{&p.t_start, &p.t_backward, &p.t_reduced})
        NOPAD_CUDA_CHECK(cudaEventCreate(e));
    }
    // Host mirror of the optimizer in the CPU form, for checkpoints (never stepped).
    std::vector<ParamView> views;
    for (const ParamTensor& t : model_.layout().tensors())
      views.push_back({t.name, host_params_.data() + t.offset, host_params_.data() + t.offset, t.numel,
                       t.no_weight_decay});
    mirror_ = make_optimizer("lamb", std::move(views), o.optim);
    // dist.clip = bucket: one device sum of squares per gradient bucket. The model calls the hook only while it is
    // armed (micro_step: clipping or a data-parallel all-reduce on the step's last micro-batch).
    if (bucket_clip_norm_ > 0)
      clip_sums_ = static_cast<float*>(backend_.allocate_bytes(sizeof(float) * model_.grad_buckets().size()));
    model_.set_grad_ready_hook([this](size_t offset, size_t count) { on_bucket_ready(offset, count); });
    cudaDeviceProp prop{};
    NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, backend_.device()));
    name_ = std::string("cuda (") + prop.name + ")";
  }
  ~GpuEngine() override {  // no throwing while tearing down
    (void)cudaStreamSynchronize(backend_.stream());
    if (comm_stream_) (void)cudaStreamSynchronize(comm_stream_);
    nccl_.reset();
    if (clip_sums_) backend_.free_bytes(clip_sums_);
    if (grads16_) backend_.free_bytes(grads16_);
    for (cudaEvent_t e : bucket_ready_) (void)cudaEventDestroy(e);
    if (comm_done_) (void)cudaEventDestroy(comm_done_);
    if (comm_stream_) (void)cudaStreamDestroy(comm_stream_);
    for (PendingStep& p : steps_)
      for (cudaEvent_t e : std::array<cudaEvent_t, 4>{p.done, p.t_start, p.t_backward, p.t_reduced})
        if (e) (void)cudaEventDestroy(e);
  }

  std::string device_name() const override { return name_; }
  const ParamLayout& layout() const override { return model_.layout(); }

  void init_params(uint64_t seed) override {
    // The CPU path's host-side init; the masters keep it in fp32, the ops read its 16-bit rounding.
    initialize_params(model_.layout(), model_.config(), seed, host_params_.data());
    set_params(host_params_.data());
  }
  void set_params(const float* host) override {
    lamb_.load_master(host);
    lamb_.write_weight_copy(model_.params());
    backend_.synchronize();
  }
  void get_params(std::vector<float>& host) override {
    host.resize(model_.num_params());
    lamb_.download_master(host.data());
  }

  // A step only enqueues: the loss is not known while it is built, so backward runs whatever it is, and a
  // non-finite loss shows up as a non-finite gradient norm, on which FusedLamb skips the update on the device.
  void zero_grad() override {
    PendingStep& p = building();
    p.tickets.clear();
    NOPAD_CUDA_CHECK(cudaEventRecord(p.t_start, backend_.stream()));
    model_.zero_grad();
  }
  std::string precision() const override { return std::is_same_v<P, ops::GpuF16> ? "fp16" : "bf16"; }
  void micro_step(const HostBatch& batch, uint64_t seed, uint64_t step, LossDenominators denoms, double loss_scale,
                  bool last_micro_batch) override {
    PendingStep& p = building();
    NOPAD_CHECK(p.tickets.size() < static_cast<size_t>(micro_per_step_), "GpuEngine: more than ",
                micro_per_step_, " micro-batches in one step (EngineOptions::micro_batches_per_step)");
    p.tickets.push_back(model_.forward_async(batch, /*train=*/true, seed, step, denoms));
    // Data parallel, last micro-batch: each bucket's all-reduce starts as soon as backward has enqueued its last
    // gradient (on_bucket_ready), on the communication stream, overlapping the rest of backward. With dist.clip =
    // bucket, each final bucket is first clipped on the compute stream (this rank's share to bucket_clip_norm / ranks,
    // in the loss-scaled units of the raw gradients).
    reduce_armed_ = nccl_ != nullptr && overlap_ && last_micro_batch;
    clip_armed_ = bucket_clip_norm_ > 0 && last_micro_batch;
    if (clip_armed_) {
      clip_next_ = 0;
      clip_threshold_ = static_cast<float>(bucket_clip_norm_ / world_size_ * loss_scale);
      NOPAD_CUDA_CHECK(cudaMemsetAsync(clip_sums_, 0, sizeof(float) * model_.grad_buckets().size(),
                                       backend_.stream()));
    }
    model_.arm_grad_ready_hook(reduce_armed_ || clip_armed_);
    model_.backward(loss_scale);
    model_.arm_grad_ready_hook(false);
    NOPAD_CHECK(!clip_armed_ || clip_next_ == model_.grad_buckets().size(), "GpuEngine: ", clip_next_, " of ",
                model_.grad_buckets().size(), " gradient buckets were clipped");
    reduce_armed_ = clip_armed_ = false;
    NOPAD_CUDA_CHECK(cudaEventRecord(p.t_backward, backend_.stream()));  // the last one recorded counts
  }
  void connect(dist::Communicator& comm) override {
    if (comm.size() == 1) return;
    NOPAD_CUDA_CHECK(cudaSetDevice(backend_.device()));
    comm_ = &comm;
    nccl_ = make_nccl_comm(comm, nccl_max_ctas_);
    NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
    bucket_ready_.assign(model_.grad_buckets().size(), nullptr);
    for (cudaEvent_t& e : bucket_ready_) NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    NOPAD_CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    // dist.reduce = bf16: a bf16 staging copy of the whole gradient buffer, so every bucket has its own slice.
    if (reduce_bf16_) grads16_ = static_cast<bf16*>(backend_.allocate_bytes(sizeof(bf16) * model_.num_params()));
  }
  // The gradients' sum over the ranks. Overlapped: the buckets' all-reduces were enqueued during the last backward
  // on the communication stream; the compute stream now waits for them. Otherwise (overlap off, or a rank with no
  // micro-batch this step) the same buckets, in the same order, on the compute stream: every rank issues the same
  // sequence of NCCL calls. The step results are summed in finish_step.
  void reduce_gradients(dist::Communicator& comm) override {
    if (comm.size() == 1) return;
    NOPAD_CHECK(nccl_ != nullptr && comm_ == &comm, "GpuEngine::reduce_gradients before connect()");
    const auto& buckets = model_.grad_buckets();
    if (next_bucket_ == 0) {
      for (const auto& [offset, count] : buckets) reduce_bucket(offset, count, backend_.stream());
    } else {
      NOPAD_CHECK(next_bucket_ == buckets.size(), "GpuEngine: ", next_bucket_, " of ", buckets.size(),
                  " gradient buckets were reduced during backward");
      NOPAD_CUDA_CHECK(cudaEventRecord(comm_done_, comm_stream_));
      NOPAD_CUDA_CHECK(cudaStreamWaitEvent(backend_.stream(), comm_done_, 0));
    }
    next_bucket_ = 0;
    PendingStep& p = building();
    p.reduced = true;
    NOPAD_CUDA_CHECK(cudaEventRecord(p.t_reduced, backend_.stream()));  // the summed gradients usable here
  }
  void optimizer_step(double lr, double grad_scale) override {
    NOPAD_CHECK(unread_ < kMaxStepsInFlight, "GpuEngine: more than ", kMaxStepsInFlight,
                " steps unread (call finish_step)");
    PendingStep& p = building();
    lamb_.step(model_.grads(), model_.params(), static_cast<float>(lr), static_cast<float>(grad_scale));
    p.stats_ticket = backend_.download_bytes_async(p.stats_host.data(), lamb_.device_state(), FusedLamb::state_size());
    NOPAD_CUDA_CHECK(cudaEventRecord(p.done, backend_.stream()));
    ++unread_;
  }
  StepOutcome finish_step() override {
    NOPAD_CHECK(unread_ > 0, "GpuEngine::finish_step: no step to finish");
    PendingStep& p = steps_[first_];
    StepOutcome o;
    // A step with collectives is waited for under the watch of NCCL's error state and dist.timeout_s: a dead or hung
    // peer ends this rank with an error instead of a wait without end.
    if (p.reduced) nccl_->wait_for(p.done, timeout_s_, "a step's gradient all-reduce and update");
    if (!p.tickets.empty()) {  // device time of this rank's compute and of its gradient reduction
      NOPAD_CUDA_CHECK(cudaEventSynchronize(p.done));
      float ms = 0;
      NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, p.t_start, p.t_backward));
      o.compute_ms = ms;
      o.reduce_ms = 0;
      if (p.reduced) {
        NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, p.t_backward, p.t_reduced));
        o.reduce_ms = ms;
      }
    }
    p.reduced = false;
    for (const uint64_t t : p.tickets) accumulate(o.result, model_.read_result(t));  // waits for that forward
    if (comm_) {  // the global batch's result, as the CPU engine's reduce_gradients gives it
      StepResult& r = o.result;
      std::array<double, 3> losses = {r.loss, r.mlm_loss, r.nsp_loss};
      std::array<int64_t, 4> counts = {r.mlm_correct, r.mlm_count, r.nsp_correct, r.nsp_count};
      comm_->all_reduce_sum(std::span<double>(losses));
      comm_->all_reduce_sum(std::span<int64_t>(counts));
      r.loss = losses[0];
      r.mlm_loss = losses[1];
      r.nsp_loss = losses[2];
      r.mlm_correct = counts[0];
      r.mlm_count = counts[1];
      r.nsp_correct = counts[2];
      r.nsp_count = counts[3];
    }
    backend_.wait_download(p.stats_ticket);
    const FusedLamb::Stats st = FusedLamb::decode_state(p.stats_host.data());
    o.stats.grad_norm = st.grad_norm;
    o.stats.skipped = st.skipped;  // clip_factor is not reported by FusedLamb
    first_ = (first_ + 1) % static_cast<int>(steps_.size());
    --unread_;
    return o;
  }
  StepResult evaluate(const HostBatch& batch) override {
    return model_.forward(batch, /*train=*/false, 0, 0, LossDenominators{1.0, 1.0});
  }
  std::vector<float> mlm_probabilities(const HostBatch& batch) override {
    model_.forward(batch, /*train=*/false, 0, 0, LossDenominators{1.0, 1.0});
    std::vector<float> probs;
    model_.get_mlm_probabilities(probs);
    return probs;
  }

  int64_t optimizer_steps() override { return lamb_.step_count(); }  // waits for the stream
  const Optimizer& optimizer_state() override {
    lamb_.download_moments(host_m_.data(), host_v_.data());
    mirror_->load_state(lamb_.step_count(), moment_views());
    return *mirror_;
  }
  void load_optimizer_state(int64_t step, const std::vector<StateTensor>& tensors) override {
    mirror_->load_state(step, tensors);  // checks names and sizes; throws before anything changes
    std::unordered_map<std::string, const ParamTensor*> by_name;
    for (const ParamTensor& t : model_.layout().tensors()) by_name[t.name] = &t;
    for (const StateTensor& s : mirror_->state_tensors()) {
      const size_t dot = s.name.rfind('.');
      const auto it = by_name.find(s.name.substr(0, dot));
      NOPAD_CHECK(dot != std::string::npos && it != by_name.end() && it->second->numel == s.numel,
                  "optimizer state: unexpected tensor '", s.name, "'");
      const std::string kind = s.name.substr(dot + 1);
      NOPAD_CHECK(kind == "exp_avg" || kind == "exp_avg_sq", "optimizer state: unexpected tensor '", s.name, "'");
      std::vector<float>& dst = kind == "exp_avg" ? host_m_ : host_v_;
      std::copy(s.data, s.data + s.numel, dst.begin() + static_cast<std::ptrdiff_t>(it->second->offset));
    }
    lamb_.load_moments(host_m_.data(), host_v_.data(), step);
  }

 private:
  struct PendingStep {
    std::vector<uint64_t> tickets;        // the model's result tickets of its micro-batches
    uint64_t stats_ticket = 0;            // the backend download of FusedLamb's state after its update
    std::vector<unsigned char> stats_host;
    cudaEvent_t done = nullptr;           // recorded after the step's update
    bool reduced = false;                 // the step has a gradient all-reduce
    cudaEvent_t t_start = nullptr, t_backward = nullptr, t_reduced = nullptr;  // timing: StepOutcome::compute_ms
  };
  // steps_[first_ .. first_ + unread_) are ended and unread; the next one is being built.
  PendingStep& building() { return steps_[(first_ + unread_) % static_cast<int>(steps_.size())]; }

  std::vector<StateTensor> moment_views() const {
    std::vector<StateTensor> out;
    for (const ParamTensor& t : model_.layout().tensors()) {
      out.push_back({t.name + ".exp_avg", host_m_.data() + t.offset, t.numel});
      out.push_back({t.name + ".exp_avg_sq", host_v_.data() + t.offset, t.numel});
    }
    return out;
  }

  // Called by the model's backward (armed) when a gradient bucket is final: start its all-reduce on the
  // communication stream once the compute stream has produced it.
  void on_bucket_ready(size_t offset, size_t count) {
    if (clip_armed_) {
      NOPAD_CHECK(clip_next_ < model_.grad_buckets().size(), "GpuEngine: more gradient buckets than the model has");
      float* sum_sq = clip_sums_ + clip_next_++;
      launch_sum_of_squares(model_.grads() + offset, count, sum_sq, backend_.multiprocessors(), backend_.stream());
      launch_clip_scale(model_.grads() + offset, count, sum_sq, clip_threshold_, backend_.multiprocessors(),
                        backend_.stream());
    }
    if (!reduce_armed_) return;
    NOPAD_CHECK(next_bucket_ < bucket_ready_.size(), "GpuEngine: more gradient buckets than the model has");
    // bf16 reduction: the bucket's rounding runs on the compute stream (it reads what backward just wrote), before
    // the event the communication stream waits for.
    if (reduce_bf16_)
      launch_fp32_to_bf16(model_.grads() + offset, grads16_ + offset, count, backend_.multiprocessors(),
                          backend_.stream());
    cudaEvent_t ev = bucket_ready_[next_bucket_++];
    NOPAD_CUDA_CHECK(cudaEventRecord(ev, backend_.stream()));
    NOPAD_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ev, 0));
    reduce_bucket(offset, count, comm_stream_, /*rounded=*/true);
  }
  // The all-reduce of one bucket on `stream`: in place in fp32, or (dist.reduce = bf16) rounded into the staging
  // copy (unless `rounded` says that is done), summed there in bf16 and widened back into the fp32 gradients.
  void reduce_bucket(size_t offset, size_t count, cudaStream_t stream, bool rounded = false) {
    if (!reduce_bf16_) {
      nccl_->all_reduce_sum(model_.grads() + offset, count, stream);
      return;
    }
    const int sms = backend_.multiprocessors();
    if (!rounded) launch_fp32_to_bf16(model_.grads() + offset, grads16_ + offset, count, sms, stream);
    nccl_->all_reduce_sum_bf16(grads16_ + offset, count, stream);
    launch_bf16_to_fp32(grads16_ + offset, model_.grads() + offset, count, sms, stream);
  }

  CudaBackendT<P> backend_;
  BertModel<P> model_;
  FusedLamb lamb_;
  std::vector<float> host_params_, host_m_, host_v_;  // host staging for init and checkpoints
  std::unique_ptr<Optimizer> mirror_;
  std::string name_;
  int micro_per_step_ = 1;
  double timeout_s_ = 600;
  bool overlap_ = true;
  int nccl_max_ctas_ = 0;
  cudaStream_t comm_stream_ = nullptr;       // data parallel: the buckets' all-reduces during backward
  std::vector<cudaEvent_t> bucket_ready_;    // one per gradient bucket: produced on the compute stream
  cudaEvent_t comm_done_ = nullptr;          // all buckets reduced
  size_t next_bucket_ = 0;                   // buckets started in this step
  bool reduce_armed_ = false;                // this backward all-reduces its buckets as they are ready
  // dist.clip = bucket: the threshold (0: off), the ranks, a device sum of squares per bucket, this backward's state
  double bucket_clip_norm_ = 0;
  int world_size_ = 1;
  float* clip_sums_ = nullptr;
  bool clip_armed_ = false;
  size_t clip_next_ = 0;
  float clip_threshold_ = 0;
  bool reduce_bf16_ = false;   // dist.reduce = bf16
  bf16* grads16_ = nullptr;    // its staging copy of the gradients (allocated by connect)
  dist::Communicator* comm_ = nullptr;  // data parallel (after connect): the host communicator
  std::unique_ptr<NcclComm> nccl_;
  std::array<PendingStep, kMaxStepsInFlight + 1> steps_;
  int first_ = 0, unread_ = 0;
};

}  // namespace

std::unique_ptr<TrainEngine> make_gpu_engine(const EngineOptions& options) {
  NOPAD_CHECK(options.optimizer == "lamb", "optim.name ", options.optimizer,
              " is CPU-only for now; use lamb or --set train.device=cpu");
  NOPAD_CHECK(options.precision == "bf16" || options.precision == "fp16" || options.precision == "auto",
              "train.precision ", options.precision, " is not available on the GPU; use bf16 or fp16");
  std::string why;
  if (!cuda_device_visible(&why)) fail("no CUDA device: ", why, "; use --set train.device=cpu");
  int count = 0;
  NOPAD_CUDA_CHECK(cudaGetDeviceCount(&count));
  NOPAD_CHECK(options.device >= 0, "GPU index ", options.device, " is negative");
  EngineOptions o = options;
  o.device = options.device % count;  // a data-parallel job's local rank on the GPUs this process sees
  try {
    if (o.precision == "fp16") return std::make_unique<GpuEngine<ops::GpuF16>>(o);
    return std::make_unique<GpuEngine<ops::GpuBf16>>(o);  // bf16, and auto
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(str_cat("the model for a micro-batch of ", options.max_seqs, " sequences (up to ",
                              options.max_tokens, " tokens, ", options.max_masked,
                              " masked positions) does not fit on the GPU: ", e.what(),
                              ". Lower train.global_batch or raise train.grad_accumulation"));
  }
}

}  // namespace nopad::cuda
