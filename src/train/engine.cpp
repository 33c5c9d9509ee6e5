// The CPU TrainEngine and device selection (see engine.h).
#include "train/engine.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <span>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "optim/clip.h"
#include "ops/cpu/cpu_backend.h"

#ifdef NOPAD_HAVE_CUDA
#include "ops/cuda/gpu_engine.h"
#endif

namespace nopad {
namespace {

class CpuEngine final : public TrainEngine {
 public:
  explicit CpuEngine(const EngineOptions& o)
      : backend_(o.threads),
        model_(o.config, backend_, o.max_tokens, o.max_seqs, o.max_masked),
        bucket_clip_norm_(o.bucket_clip_norm),
        world_size_(std::max(1, o.world_size)),
        reduce_bf16_(o.reduce_bf16) {
    std::vector<ParamView> views;
    for (const ParamTensor& t : model_.layout().tensors())
      views.push_back({t.name, model_.params() + t.offset, model_.grads() + t.offset, t.numel, t.no_weight_decay});
    optimizer_ = make_optimizer(o.optimizer, std::move(views), o.optim);
  }

  std::string device_name() const override {
    return "cpu (" + std::to_string(backend_.num_threads()) + " threads)";
  }
  const ParamLayout& layout() const override { return model_.layout(); }
  void init_params(uint64_t seed) override { model_.init_params(seed); }
  void set_params(const float* host) override { model_.set_params(host); }
  void get_params(std::vector<float>& host) override {
    host.resize(model_.num_params());
    model_.get_params(host.data());
  }
  void zero_grad() override {
    step_start_ = Clock::now();
    model_.zero_grad();
    current_ = StepOutcome{};
    finite_ = true;
  }
  std::string precision() const override { return "fp32"; }
  void micro_step(const HostBatch& batch, uint64_t seed, uint64_t step, LossDenominators denoms, double loss_scale,
                  bool last_micro_batch) override {
    const StepResult r = model_.forward(batch, /*train=*/true, seed, step, denoms);
    accumulate(current_.result, r);
    if (!std::isfinite(r.loss)) finite_ = false;
    if (finite_) model_.backward(loss_scale);  // nothing more is accumulated once the step is lost
    if (finite_ && last_micro_batch && bucket_clip_norm_ > 0) {
      // The step's gradients are final: each bucket of this rank's share to bucket_clip_norm / ranks, in the units
      // of the raw (loss-scaled) gradients.
      const double threshold = bucket_clip_norm_ / world_size_ * loss_scale;
      for (const auto& [offset, count] : model_.grad_buckets()) clip_to_norm(model_.grads() + offset, count, threshold);
    }
    current_.compute_ms = ms_since(step_start_);
    current_.reduce_ms = 0;
  }
  void reduce_gradients(dist::Communicator& comm) override {
    // One all-reduce for the step's result sums and the skip flag, one for the gradients (identical bits on every
    // rank: the MPI communicator reduces to rank 0 and broadcasts, so the ranks' weights never drift apart).
    const auto reduce_start = Clock::now();
    StepResult& r = current_.result;
    std::array<double, 3> losses = {r.loss, r.mlm_loss, r.nsp_loss};
    std::array<int64_t, 5> counts = {r.mlm_correct, r.mlm_count, r.nsp_correct, r.nsp_count, finite_ ? 0 : 1};
    comm.all_reduce_sum(std::span<double>(losses));
    comm.all_reduce_sum(std::span<int64_t>(counts));
    r.loss = losses[0];
    r.mlm_loss = losses[1];
    r.nsp_loss = losses[2];
    r.mlm_correct = counts[0];
    r.mlm_count = counts[1];
    r.nsp_correct = counts[2];
    r.nsp_count = counts[3];
    finite_ = counts[4] == 0;
    if (finite_) {
      float* g = model_.grads();
      const size_t n = model_.num_params();
      // dist.reduce = bf16: what the GPUs' bf16 NCCL all-reduce computes for two ranks exactly (each share rounded,
      // the fp32 sum rounded); NCCL also rounds the partial sums of more ranks.
      if (reduce_bf16_) round_to_bf16(g, n);
      comm.all_reduce_sum(std::span<float>(g, n));
      if (reduce_bf16_) round_to_bf16(g, n);
    }
    current_.reduce_ms = ms_since(reduce_start);
  }
  void optimizer_step(double lr, double grad_scale) override {
    NOPAD_CHECK(unread_ < kMaxStepsInFlight, "CpuEngine: more than ", kMaxStepsInFlight,
                " steps unread (call finish_step)");
    if (finite_) {
      current_.stats = optimizer_->step(lr, grad_scale);
    } else {
      current_.stats.skipped = true;
      current_.stats.grad_norm = std::numeric_limits<double>::quiet_NaN();
    }
    done_[(first_ + unread_) % kMaxStepsInFlight] = current_;
    ++unread_;
  }
  StepOutcome finish_step() override {
    NOPAD_CHECK(unread_ > 0, "CpuEngine::finish_step: no step to finish");
    const StepOutcome o = done_[first_];
    first_ = (first_ + 1) % kMaxStepsInFlight;
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
  int64_t optimizer_steps() override { return optimizer_->step_count(); }
  const Optimizer& optimizer_state() override { return *optimizer_; }
  void load_optimizer_state(int64_t step, const std::vector<StateTensor>& tensors) override {
    optimizer_->load_state(step, tensors);
  }

 private:
  ops::CpuBackend<ops::CpuF32> backend_;
  BertModel<ops::CpuF32> model_;
  std::unique_ptr<Optimizer> optimizer_;
  StepOutcome current_;
  double bucket_clip_norm_ = 0;
  int world_size_ = 1;
  bool reduce_bf16_ = false;  // dist.reduce = bf16
  bool finite_ = true;
  using Clock = std::chrono::steady_clock;
  static double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  }
  Clock::time_point step_start_ = Clock::now();
  std::array<StepOutcome, kMaxStepsInFlight> done_{};  // ended, unread: a ring from first_
  int first_ = 0, unread_ = 0;
};

}  // namespace

void TrainEngine::reduce_gradients(dist::Communicator& comm) {
  if (comm.size() == 1) return;
  fail("data-parallel training is not available on ", device_name(), ": set train.device=cpu or run one process");
}

void accumulate(StepResult& sum, const StepResult& r) {
  sum.loss += r.loss;
  sum.mlm_loss += r.mlm_loss;
  sum.nsp_loss += r.nsp_loss;
  sum.mlm_correct += r.mlm_correct;
  sum.mlm_count += r.mlm_count;
  sum.nsp_correct += r.nsp_correct;
  sum.nsp_count += r.nsp_count;
}

std::unique_ptr<TrainEngine> make_cpu_engine(const EngineOptions& options) {
  return std::make_unique<CpuEngine>(options);
}

std::string resolve_device(const std::string& device, std::string* note) {
  NOPAD_CHECK(device == "auto" || device == "cpu" || device == "cuda", "train.device must be auto, cpu or cuda, got \"",
              device, "\"");
  if (device == "cpu") return "cpu";
#ifdef NOPAD_HAVE_CUDA
  std::string why;
  if (cuda::cuda_device_visible(&why)) return "cuda";
#else
  const std::string why = "this nopad was built without the CUDA backend (rebuild with -DNOPAD_CUDA=ON)";
#endif
  if (device == "auto") {
    if (note) *note = "no CUDA device (" + why + ")";
    return "cpu";
  }
  fail("no CUDA device: ", why, "; use --set train.device=cpu");
}

std::string resolve_precision(const std::string& precision, const std::string& device) {
  NOPAD_CHECK(precision == "auto" || precision == "fp32" || precision == "bf16" || precision == "fp16",
              "train.precision must be auto, fp32, bf16 or fp16, got \"", precision, "\"");
  if (precision == "auto") return device == "cpu" ? "fp32" : "bf16";
  if (device == "cpu")
    NOPAD_CHECK(precision == "fp32", "train.precision ", precision,
                " needs a GPU (train.device cuda); the CPU trains in fp32");
  else
    NOPAD_CHECK(precision != "fp32", "train.precision fp32 is CPU-only; on a GPU use bf16 or fp16");
  return precision;
}

uint64_t cpu_engine_bytes(const EngineOptions& o) {
  const BertConfig& c = o.config;
  const uint64_t V = static_cast<uint64_t>(c.vocab_size), H = static_cast<uint64_t>(c.hidden_size),
                 I = static_cast<uint64_t>(c.intermediate_size);
  const uint64_t model = BertModel<ops::CpuF32>::planned_bytes(c, o.max_tokens, o.max_seqs, o.max_masked, c.vocab_size);
  const uint64_t moments = (2 * ParamLayout(c).total_numel() + 1) * sizeof(float);
  // The backend's grow-only scratch in a forward: the transposed weight of the widest dense layer (the MLM decoder,
  // [V, H]), each row's sequence and the masked rows' losses.
  const uint64_t scratch = (std::max({V, I, 3 * H}) * H + static_cast<uint64_t>(o.max_tokens) +
                            2 * static_cast<uint64_t>(o.max_masked)) * sizeof(float);
  return model + moments + scratch;
}

EngineOptions with_batch(EngineOptions o, int32_t batch, int64_t max_len, int64_t max_masked) {
  o.max_tokens = static_cast<int32_t>(batch * max_len);
  o.max_seqs = batch;
  o.max_masked = static_cast<int32_t>(batch * max_masked);
  return o;
}

void check_cpu_batch_fits(const EngineOptions& options, int32_t asked, int32_t batch, int64_t max_len,
                          int64_t max_masked, const HostMemory& memory) {
  const auto need = [&](int32_t b) {
    const uint64_t host_batch = static_cast<uint64_t>(b) * static_cast<uint64_t>(12 * max_len + 8 * max_masked + 40);
    return cpu_engine_bytes(with_batch(options, b, max_len, max_masked)) + host_batch;
  };
  const uint64_t usable = memory.available_bytes / 10 * 9;  // a margin for the allocator and everything else
  if (need(batch) <= usable) return;
  int32_t lo = 0, hi = batch;  // need(lo) fits (0: nothing does yet), need(hi) does not
  while (hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    (need(mid) <= usable ? lo : hi) = mid;
  }
  const std::string what = str_cat("--batch ", asked, " needs about ", format_bytes(need(batch)),
                                   " of memory (the model, its optimizer state and the activations of ", batch,
                                   " sequences of up to ", max_len, " tokens), but ",
                                   format_bytes(memory.available_bytes), " is available (", memory.limited_by, ")");
  if (lo == 0)
    fail(what, "; even --batch 1 needs ", format_bytes(need(1)),
         ": free memory, or evaluate on a larger machine or on a GPU (--device cuda)");
  fail(what, ": use --batch ", lo, " or less");
}

std::unique_ptr<TrainEngine> make_engine(const std::string& device, const EngineOptions& options) {
  if (device == "cpu") return make_cpu_engine(options);
#ifdef NOPAD_HAVE_CUDA
  if (device == "cuda") return cuda::make_gpu_engine(options);
#endif
  fail("no engine for train.device \"", device, "\" in this build");
}

}  // namespace nopad
