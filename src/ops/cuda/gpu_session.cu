// GpuSession: one GPU's training step (model + FusedLamb, bf16 or fp16 ops) for host-only callers; see gpu_session.h.
#include "ops/cuda/gpu_session.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "model/params.h"
#include "ops/cuda/check.h"
#include "ops/cuda/cuda_backend.h"
#include "ops/cuda/lamb.h"

namespace nopad::cuda {
namespace {

void require_device(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) (void)cudaGetLastError();  // clear the sticky slot: later checks must not see it
  if (err != cudaSuccess || count == 0)
    fail("no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "the driver reports 0 devices",
         "; use --device cpu");
  NOPAD_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count, " visible)");
}

// Free device memory once the context exists and before anything of ours is allocated: the baseline of the
// memory high-water mark.
size_t baseline_free_bytes(int device) {
  require_device(device);
  NOPAD_CUDA_CHECK(cudaSetDevice(device));
  NOPAD_CUDA_CHECK(cudaFree(nullptr));  // creates the context
  size_t free_b = 0, total_b = 0;
  NOPAD_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b;
}

// The session's state for one precision policy P, behind a policy-free interface (Session) so that GpuSession stays
// one plain class.
class Session {
 public:
  virtual ~Session() = default;
  virtual void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) = 0;
  virtual StepResult last_result() = 0;
  virtual void synchronize() = 0;  // also samples the memory high-water mark
  virtual size_t peak_memory_bytes() = 0;
  virtual int device() const = 0;
  virtual int64_t skipped_steps() = 0;
  virtual void set_op_timing(bool on) = 0;
  virtual std::vector<std::pair<std::string, double>> op_times_ms() = 0;
  virtual void capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) = 0;
  virtual void replay_captured() = 0;
};

template <class P>
class SessionT final : public Session {
 public:
  SessionT(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked, uint64_t seed,
           const OptimizerOptions& options, double loss_scale, int device)
      : free0_(baseline_free_bytes(device)),
        backend_(device),
        model_(config, backend_, max_tokens, max_seqs, max_masked),
        lamb_(lamb_tensors(model_.layout()), model_.num_params(), options, backend_.stream()),
        loss_scale_(loss_scale) {
    // The same host-side BERT init as the CPU path; the masters keep it in fp32, the ops read its 16-bit rounding.
    std::vector<float> host(model_.num_params());
    initialize_params(model_.layout(), config, seed, host.data());
    lamb_.load_master(host.data());
    lamb_.write_weight_copy(model_.params());
    backend_.synchronize();
    sample_memory();
  }
  ~SessionT() override {
    // No throwing from a destructor: statuses are ignored while tearing down.
    (void)cudaStreamSynchronize(backend_.stream());
    for (cudaEvent_t e : lamb_events_) (void)cudaEventDestroy(e);
    if (graph_) (void)cudaGraphExecDestroy(graph_);
  }
  SessionT(const SessionT&) = delete;
  SessionT& operator=(const SessionT&) = delete;

  void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    model_.zero_grad();
    model_.forward_async(batch, /*train=*/true, seed, step);
    model_.backward(loss_scale_);
    lamb_step(lr);
  }
  StepResult last_result() override { return model_.read_result(); }
  void synchronize() override {
    backend_.synchronize();
    sample_memory();
  }
  size_t peak_memory_bytes() override {
    sample_memory();
    return peak_;
  }
  int device() const override { return backend_.device(); }
  int64_t skipped_steps() override { return lamb_steps_ - lamb_.step_count(); }

  void set_op_timing(bool on) override {
    if (on) {
      backend_.reset_op_times();  // synchronises, so the LAMB events are free too
      lamb_recorded_ = 0;
      lamb_ms_ = 0;
    }
    timing_ = on;
    backend_.set_op_timing(on);
  }
  std::vector<std::pair<std::string, double>> op_times_ms() override {
    std::vector<std::pair<std::string, double>> out = backend_.op_times_ms();  // synchronises
    for (size_t i = 0; i < lamb_recorded_; ++i) {
      float ms = 0;
      NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, lamb_events_[2 * i], lamb_events_[2 * i + 1]));
      lamb_ms_ += static_cast<double>(ms);
    }
    lamb_recorded_ = 0;
    if (lamb_ms_ > 0) out.emplace_back("lamb", lamb_ms_);
    return out;
  }

  void capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    NOPAD_CHECK(!timing_, "GpuSession::capture_step: turn op timing off first");
    train_step(batch, lr, seed, step);  // eager first: scratch grown, GEMM plans made, kernel attributes set
    synchronize();
    if (graph_) {
      NOPAD_CUDA_CHECK(cudaGraphExecDestroy(graph_));
      graph_ = nullptr;
    }
    const cudaStream_t stream = backend_.stream();
    backend_.set_capture_mode(true);
    NOPAD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    cudaGraph_t g = nullptr;
    try {
      train_step(batch, lr, seed, step);
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &g);
      if (g) (void)cudaGraphDestroy(g);
      backend_.set_capture_mode(false);
      throw;
    }
    const cudaError_t end = cudaStreamEndCapture(stream, &g);
    backend_.set_capture_mode(false);
    NOPAD_CUDA_CHECK(end);
    const cudaError_t inst = cudaGraphInstantiate(&graph_, g, 0);
    (void)cudaGraphDestroy(g);
    NOPAD_CUDA_CHECK(inst);
  }
  void replay_captured() override {
    NOPAD_CHECK(graph_ != nullptr, "GpuSession::replay_captured: no captured step");
    NOPAD_CUDA_CHECK(cudaGraphLaunch(graph_, backend_.stream()));
  }

 private:
  void lamb_step(float lr) {
    ++lamb_steps_;
    const auto grad_scale = static_cast<float>(1.0 / loss_scale_);
    if (!timing_) {
      lamb_.step(model_.grads(), model_.params(), lr, grad_scale);
      return;
    }
    const size_t first = 2 * lamb_recorded_;
    while (lamb_events_.size() < first + 2) {
      cudaEvent_t e = nullptr;
      NOPAD_CUDA_CHECK(cudaEventCreate(&e));
      lamb_events_.push_back(e);
    }
    NOPAD_CUDA_CHECK(cudaEventRecord(lamb_events_[first], backend_.stream()));
    lamb_.step(model_.grads(), model_.params(), lr, grad_scale);
    NOPAD_CUDA_CHECK(cudaEventRecord(lamb_events_[first + 1], backend_.stream()));
    ++lamb_recorded_;
  }
  void sample_memory() {
    size_t free_b = 0, total_b = 0;
    NOPAD_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (free0_ > free_b) peak_ = std::max(peak_, free0_ - free_b);
  }

  size_t free0_;  // first member: measured before the backend allocates
  CudaBackendT<P> backend_;
  BertModel<P> model_;
  FusedLamb lamb_;
  double loss_scale_ = 1.0;
  int64_t lamb_steps_ = 0;  // LAMB steps enqueued (captured replays not counted)
  size_t peak_ = 0;
  // Op timing: the LAMB step's own start/end event pairs (grow-only pool), read in op_times_ms().
  bool timing_ = false;
  std::vector<cudaEvent_t> lamb_events_;
  size_t lamb_recorded_ = 0;  // pairs recorded, not yet read
  double lamb_ms_ = 0;
  cudaGraphExec_t graph_ = nullptr;  // capture_step
};

}  // namespace

struct GpuSession::Impl {
  std::unique_ptr<Session> session;
  std::string precision;
  std::chrono::steady_clock::time_point mark_time = std::chrono::steady_clock::now();
};

GpuSession::GpuSession(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked,
                       uint64_t seed, const OptimizerOptions& options, const std::string& precision,
                       double loss_scale, int device)
    : impl_(std::make_unique<Impl>()) {
  NOPAD_CHECK(precision == "bf16" || precision == "fp16", "GPU precision must be bf16 or fp16, got \"", precision,
              "\"");
  NOPAD_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "the loss scale must be a positive number, got ",
              loss_scale);
  impl_->precision = precision;
  if (precision == "fp16")
    impl_->session = std::make_unique<SessionT<ops::GpuF16>>(config, max_tokens, max_seqs, max_masked, seed, options,
                                                             loss_scale, device);
  else
    impl_->session = std::make_unique<SessionT<ops::GpuBf16>>(config, max_tokens, max_seqs, max_masked, seed,
                                                              options, loss_scale, device);
}

GpuSession::~GpuSession() = default;

void GpuSession::train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) {
  impl_->session->train_step(batch, lr, seed, step);
}

StepResult GpuSession::last_result() { return impl_->session->last_result(); }
int64_t GpuSession::skipped_steps() { return impl_->session->skipped_steps(); }
const std::string& GpuSession::precision() const { return impl_->precision; }

void GpuSession::synchronize() { impl_->session->synchronize(); }

void GpuSession::mark() {
  synchronize();
  impl_->mark_time = std::chrono::steady_clock::now();
}

double GpuSession::elapsed_ms_since_mark() {
  synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - impl_->mark_time).count();
}

size_t GpuSession::peak_memory_bytes() { return impl_->session->peak_memory_bytes(); }

std::string GpuSession::device_name() const {
  cudaDeviceProp prop{};
  NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, impl_->session->device()));
  return prop.name;
}

std::string GpuSession::pci_bus_id() const {
  char id[64] = {};
  NOPAD_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, impl_->session->device()));
  return id;
}

void GpuSession::set_op_timing(bool on) { impl_->session->set_op_timing(on); }

std::vector<std::pair<std::string, double>> GpuSession::op_times_ms() { return impl_->session->op_times_ms(); }

void GpuSession::capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) {
  impl_->session->capture_step(batch, lr, seed, step);
}

void GpuSession::replay_captured() { impl_->session->replay_captured(); }

bool GpuSession::available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

namespace {

class GpuRunner final : public StepRunner {
 public:
  GpuRunner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked, uint64_t seed,
            const OptimizerOptions& options, const std::string& precision, double loss_scale)
      : session_(config, max_tokens, max_seqs, max_masked, seed, options, precision, loss_scale),
        meter_(session_.pci_bus_id()) {}
  void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    session_.train_step(batch, lr, seed, step);
  }
  StepResult last_result() override { return session_.last_result(); }
  int64_t skipped_steps() override { return session_.skipped_steps(); }
  void synchronize() override { session_.synchronize(); }
  size_t peak_memory_bytes() override { return session_.peak_memory_bytes(); }
  std::string device_name() const override { return session_.device_name(); }
  void set_breakdown(bool on) override { session_.set_op_timing(on); }
  std::vector<std::pair<std::string, double>> breakdown_ms() override { return session_.op_times_ms(); }
  bool capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    session_.capture_step(batch, lr, seed, step);
    return true;
  }
  void replay_captured() override { session_.replay_captured(); }
  EnergyMeter* energy_meter() override { return &meter_; }

 private:
  GpuSession session_;
  EnergyMeter meter_;
};

}  // namespace

std::unique_ptr<StepRunner> make_gpu_runner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs,
                                            int32_t max_masked, uint64_t seed, const OptimizerOptions& options,
                                            const std::string& precision, double loss_scale) {
  try {
    return std::make_unique<GpuRunner>(config, max_tokens, max_seqs, max_masked, seed, options, precision,
                                       loss_scale);
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(str_cat("the model for a batch of ", max_seqs, " sequences (up to ", max_tokens,
                              " tokens) does not fit on the GPU: ", e.what(), ". Use a smaller --batch"));
  }
}

}  // namespace nopad::cuda
