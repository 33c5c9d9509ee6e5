// GpuSession: one GPU's training step (model + FusedLamb) for host-only callers; see gpu_session.h.
#include "ops/cuda/gpu_session.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
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

}  // namespace

struct GpuSession::Impl {
  size_t free0;  // first member: measured before the backend allocates
  CudaBackend backend;
  BertModel<ops::GpuBf16> model;
  FusedLamb lamb;
  size_t peak = 0;
  // Op timing: the LAMB step's own start/end event pairs (grow-only pool), read in op_times_ms().
  bool timing = false;
  std::vector<cudaEvent_t> lamb_events;
  size_t lamb_recorded = 0;  // pairs recorded, not yet read
  double lamb_ms = 0;
  std::chrono::steady_clock::time_point mark_time = std::chrono::steady_clock::now();

  Impl(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked,
       const OptimizerOptions& options, int device)
      : free0(baseline_free_bytes(device)),
        backend(device),
        model(config, backend, max_tokens, max_seqs, max_masked),
        lamb(lamb_tensors(model.layout()), model.num_params(), options, backend.stream()) {}
  cudaGraphExec_t graph = nullptr;  // capture_step

  ~Impl() {
    // No throwing from a destructor: statuses are ignored while tearing down.
    (void)cudaStreamSynchronize(backend.stream());
    for (cudaEvent_t e : lamb_events) (void)cudaEventDestroy(e);
    if (graph) (void)cudaGraphExecDestroy(graph);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  void lamb_step(float lr) {
    if (!timing) {
      lamb.step(model.grads(), model.params(), lr, 1.0f);
      return;
    }
    const size_t first = 2 * lamb_recorded;
    while (lamb_events.size() < first + 2) {
      cudaEvent_t e = nullptr;
      NOPAD_CUDA_CHECK(cudaEventCreate(&e));
      lamb_events.push_back(e);
    }
    NOPAD_CUDA_CHECK(cudaEventRecord(lamb_events[first], backend.stream()));
    lamb.step(model.grads(), model.params(), lr, 1.0f);
    NOPAD_CUDA_CHECK(cudaEventRecord(lamb_events[first + 1], backend.stream()));
    ++lamb_recorded;
  }

  void sample_memory() {
    size_t free_b = 0, total_b = 0;
    NOPAD_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (free0 > free_b) peak = std::max(peak, free0 - free_b);
  }
};

GpuSession::GpuSession(const BertConfig& config, int32_t max_tokens, int32_t max_seqs, int32_t max_masked,
                       uint64_t seed, const OptimizerOptions& options, int device)
    : impl_(std::make_unique<Impl>(config, max_tokens, max_seqs, max_masked, options, device)) {
  // The same host-side BERT init as the CPU path; the masters keep it in fp32, the ops read its bf16 rounding.
  std::vector<float> host(impl_->model.num_params());
  initialize_params(impl_->model.layout(), config, seed, host.data());
  impl_->lamb.load_master(host.data());
  impl_->lamb.write_weight_copy(impl_->model.params());
  impl_->backend.synchronize();
  impl_->sample_memory();
}

GpuSession::~GpuSession() = default;

void GpuSession::train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) {
  Impl& s = *impl_;
  s.model.zero_grad();
  s.model.forward_async(batch, /*train=*/true, seed, step);
  s.model.backward(1.0);
  s.lamb_step(lr);
}

StepResult GpuSession::last_result() { return impl_->model.read_result(); }

void GpuSession::synchronize() {
  impl_->backend.synchronize();
  impl_->sample_memory();
}

void GpuSession::mark() {
  synchronize();
  impl_->mark_time = std::chrono::steady_clock::now();
}

double GpuSession::elapsed_ms_since_mark() {
  synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - impl_->mark_time).count();
}

size_t GpuSession::peak_memory_bytes() {
  impl_->sample_memory();
  return impl_->peak;
}

std::string GpuSession::device_name() const {
  cudaDeviceProp prop{};
  NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, impl_->backend.device()));
  return prop.name;
}

void GpuSession::set_op_timing(bool on) {
  Impl& s = *impl_;
  if (on) {
    s.backend.reset_op_times();  // synchronises, so the LAMB events are free too
    s.lamb_recorded = 0;
    s.lamb_ms = 0;
  }
  s.timing = on;
  s.backend.set_op_timing(on);
}

std::vector<std::pair<std::string, double>> GpuSession::op_times_ms() {
  Impl& s = *impl_;
  std::vector<std::pair<std::string, double>> out = s.backend.op_times_ms();  // synchronises
  for (size_t i = 0; i < s.lamb_recorded; ++i) {
    float ms = 0;
    NOPAD_CUDA_CHECK(cudaEventElapsedTime(&ms, s.lamb_events[2 * i], s.lamb_events[2 * i + 1]));
    s.lamb_ms += static_cast<double>(ms);
  }
  s.lamb_recorded = 0;
  if (s.lamb_ms > 0) out.emplace_back("lamb", s.lamb_ms);
  return out;
}

void GpuSession::capture_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) {
  Impl& s = *impl_;
  NOPAD_CHECK(!s.timing, "GpuSession::capture_step: turn op timing off first");
  train_step(batch, lr, seed, step);  // eager first: scratch grown, GEMM plans made, kernel attributes set
  synchronize();
  if (s.graph) {
    NOPAD_CUDA_CHECK(cudaGraphExecDestroy(s.graph));
    s.graph = nullptr;
  }
  const cudaStream_t stream = s.backend.stream();
  s.backend.set_capture_mode(true);
  NOPAD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  cudaGraph_t g = nullptr;
  try {
    train_step(batch, lr, seed, step);
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &g);
    if (g) (void)cudaGraphDestroy(g);
    s.backend.set_capture_mode(false);
    throw;
  }
  const cudaError_t end = cudaStreamEndCapture(stream, &g);
  s.backend.set_capture_mode(false);
  NOPAD_CUDA_CHECK(end);
  const cudaError_t inst = cudaGraphInstantiate(&s.graph, g, 0);
  (void)cudaGraphDestroy(g);
  NOPAD_CUDA_CHECK(inst);
}

void GpuSession::replay_captured() {
  NOPAD_CHECK(impl_->graph != nullptr, "GpuSession::replay_captured: no captured step");
  NOPAD_CUDA_CHECK(cudaGraphLaunch(impl_->graph, impl_->backend.stream()));
}

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
            const OptimizerOptions& options)
      : session_(config, max_tokens, max_seqs, max_masked, seed, options) {}
  void train_step(const HostBatch& batch, float lr, uint64_t seed, uint64_t step) override {
    session_.train_step(batch, lr, seed, step);
  }
  StepResult last_result() override { return session_.last_result(); }
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

 private:
  GpuSession session_;
};

}  // namespace

std::unique_ptr<StepRunner> make_gpu_runner(const BertConfig& config, int32_t max_tokens, int32_t max_seqs,
                                            int32_t max_masked, uint64_t seed, const OptimizerOptions& options) {
  try {
    return std::make_unique<GpuRunner>(config, max_tokens, max_seqs, max_masked, seed, options);
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(str_cat("the model for a batch of ", max_seqs, " sequences (up to ", max_tokens,
                              " tokens) does not fit on the GPU: ", e.what(), ". Use a smaller --batch"));
  }
}

}  // namespace nopad::cuda
