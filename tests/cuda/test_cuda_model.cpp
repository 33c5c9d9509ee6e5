// The whole BertModel on the GPU (BertModel<ops::GpuBf16> over cuda::CudaBackend, and BertModel<ops::GpuF16> over
// cuda::CudaBackendF16) against the CPU model (BertModel<ops::CpuF32>): one unpadded batch of mixed lengths (1..512
// tokens, masked positions, NSP labels), the same weights on both sides (drawn on the CPU, rounded to the GPU's 16-bit
// type, and those rounded values given to both, so the GPU's weight copy holds exactly what the CPU uses), dropout off
// and on (the GPU draws the CPU's masks, see test_cuda_ops.cpp). Configurations: bert-tiny, a 2-layer H=1024 /
// 16-head model, and bert-base (12 layers, H=768, 12 heads: the depth over which 16-bit rounding accumulates in real
// training), each in bf16 and fp16.
//
// fp16 runs backward with a loss scale of 4096, as fp16 training does (train.loss_scale): unscaled, the gradients of
// the non-label logits (~3e-5 / M) and much of what flows back from them would be fp16 subnormals. The GPU's
// gradients are divided by the scale (a power of two: exact) before the comparison.
//
// Tolerances (bf16; fp16's are a quarter of each, see below), and why:
//  - losses (MLM and NSP separately): relative 1e-2. The GPU stores activations in bf16 (relative rounding <= 2^-9,
//    ~2e-3, per value) between ops that compute in fp32; a value passes through a handful of such roundings before
//    the logits, and the loss, an average of log-softmax terms over many rows, averages the independent errors, so
//    it moves by ~1e-3; 1e-2 leaves room for the wider model's longer sums.
//  - MLM/NSP correct counts: an argmax can flip where two logits lie within bf16 noise of each other; at most
//    max(2, 2% of the rows) flips allowed.
//  - gradients: global norm within 3%, every tensor's norm within 5% plus a floor of 1e-3 of the global norm, cosine
//    of the full gradient vectors > 0.99. Activation gradients are bf16 too, so each parameter gradient is an fp32
//    sum of products of values carrying ~2^-9 relative error: norms of such sums move by well under 1%; small tensors
//    fed by few rows (token_type, classifier) see the least averaging, hence 5%. The floor covers tensors whose exact
//    gradient is zero (attention key biases: softmax ignores a per-key constant), where both sides hold rounding
//    noise only.
//  - fp16: 11 significant bits against bf16's 8, so every rounding error above is 8x smaller; a quarter of the bf16
//    tolerances (and of the noise floor, and of 1 - the minimum cosine) keeps twice bf16's margin. Correct counts
//    keep bf16's allowance.
//
// Needs a GPU (built as nopad_cuda_tests, not registered with CTest).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/rng.h"
#include "data/batch.h"
#include "model/bert.h"
#include "model/config.h"
#include "ops/cpu/cpu_backend.h"
#include "ops/cuda/cuda_backend.h"

namespace nopad {
namespace {

constexpr double kTolLoss = 1e-2, kTolGlobalNorm = 3e-2, kTolTensorNorm = 5e-2, kNormFloor = 1e-3,
                 kMinCosine = 0.99;
constexpr double kF16Factor = 0.25;     // fp16 tolerances = bf16's x this
constexpr double kF16LossScale = 4096;  // fp16 backward's loss scale

BertConfig tiny_config() { return BertConfig::from_file(std::string(NOPAD_SOURCE_DIR) + "/data/configs/bert-tiny.json"); }

BertConfig wide_config() {
  BertConfig c = tiny_config();
  c.hidden_size = 1024;
  c.num_attention_heads = 16;
  c.intermediate_size = 4096;
  c.num_hidden_layers = 2;
  c.validate();
  return c;
}

// Sequences of lengths 1..512 packed back to back: [CLS] then random word ids, segment B from the middle on, ~15%
// of the non-CLS rows masked (replaced by [MASK], label = the original id), random NSP labels.
HostBatch make_batch(const BertConfig& config, uint64_t seed) {
  const int32_t lengths[] = {1, 2, 3, 17, 64, 128, 200, 511, 512, 33};
  Rng rng(seed);
  HostBatch b;
  for (size_t s = 0; s < std::size(lengths); ++s) {
    const int32_t len = lengths[s], base = b.num_tokens();
    for (int32_t p = 0; p < len; ++p) {
      int32_t tok = p == 0 ? 101 : static_cast<int32_t>(rng.uniform_int(1000, config.vocab_size - 1));
      if (p > 0 && rng.uniform() < 0.15) {
        b.mlm_positions.push_back(base + p);
        b.mlm_labels.push_back(tok);
        tok = 103;
      }
      b.tokens.push_back(tok);
      b.positions.push_back(p);
      b.segments.push_back(p >= (len + 1) / 2 && len > 1 ? 1 : 0);
    }
    b.cu_seqlens.push_back(base + len);
    b.max_seqlen = std::max(b.max_seqlen, len);
    b.nsp_labels.push_back(static_cast<int32_t>(rng.uniform_int(0, 1)));
    b.sample_ids.push_back(1000 + s);
  }
  return b;
}

double norm(const float* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return std::sqrt(s);
}

// Runs forward + backward on both models and compares. P is ops::GpuBf16 or ops::GpuF16.
template <class P>
void compare_models(const BertConfig& config, bool dropout) {
  using H = typename P::Weight;  // bf16 or f16
  constexpr bool kF16 = std::is_same_v<H, f16>;
  const double f = kF16 ? kF16Factor : 1.0;
  const double tol_loss = kTolLoss * f, tol_global = kTolGlobalNorm * f, tol_tensor = kTolTensorNorm * f,
               floor = kNormFloor * f, min_cosine = 1.0 - (1.0 - kMinCosine) * f;
  const double loss_scale = kF16 ? kF16LossScale : 1.0;
  const HostBatch batch = make_batch(config, 42);
  const int32_t T = batch.num_tokens(), B = batch.num_seqs(), M = batch.num_masked();
  ASSERT_GT(M, 0);
  std::printf("    %s: T=%d B=%d M=%d H=%d layers=%d dropout=%d\n", kF16 ? "fp16" : "bf16", T, B, M, config.hidden_size,
              config.num_hidden_layers, int(dropout));

  ops::CpuBackend<ops::CpuF32> cpu_backend(0);
  cuda::CudaBackendT<P> gpu_backend(0);
  BertModel<ops::CpuF32> cpu(config, cpu_backend, T, B, M);
  BertModel<P> gpu(config, gpu_backend, T, B, M);
  const size_t n = cpu.num_params();
  ASSERT_EQ(gpu.num_params(), n);

  // Identical starting weights: BERT init on the CPU, rounded to the GPU's type, the rounded values to both.
  cpu.init_params(2024);
  std::vector<float> w(n);
  cpu.get_params(w.data());
  for (float& x : w) x = to_float(convert<H>(x));
  cpu.set_params(w.data());
  gpu.set_params(w.data());
  {
    std::vector<float> back(n, std::nanf(""));
    gpu.get_params(back.data());
    size_t diff = 0;
    for (size_t i = 0; i < n; ++i) diff += back[i] != w[i];
    ASSERT_EQ(diff, 0u) << "16-bit weight round trip through the GPU model changed values";
  }

  cpu.zero_grad();
  gpu.zero_grad();
  const uint64_t seed = 7, step = 3;
  const StepResult rc = cpu.forward(batch, dropout, seed, step);
  const StepResult rg = gpu.forward(batch, dropout, seed, step);
  std::printf("    mlm loss gpu %.6f cpu %.6f | nsp loss gpu %.6f cpu %.6f | mlm correct %lld/%lld | nsp %lld/%lld\n",
              rg.mlm_loss, rc.mlm_loss, rg.nsp_loss, rc.nsp_loss, (long long)rg.mlm_correct,
              (long long)rc.mlm_correct, (long long)rg.nsp_correct, (long long)rc.nsp_correct);
  EXPECT_TRUE(std::isfinite(rg.mlm_loss) && std::isfinite(rg.nsp_loss));
  EXPECT_NEAR(rg.mlm_loss, rc.mlm_loss, tol_loss * std::fabs(rc.mlm_loss)) << "MLM loss";
  EXPECT_NEAR(rg.nsp_loss, rc.nsp_loss, tol_loss * std::fabs(rc.nsp_loss)) << "NSP loss";
  EXPECT_EQ(rg.mlm_count, rc.mlm_count);
  EXPECT_EQ(rg.nsp_count, rc.nsp_count);
  EXPECT_LE(std::llabs(rg.mlm_correct - rc.mlm_correct), std::max<long long>(2, M / 50)) << "MLM correct count";
  EXPECT_LE(std::llabs(rg.nsp_correct - rc.nsp_correct), std::max<long long>(2, B / 50)) << "NSP correct count";

  cpu.backward(1.0);
  gpu.backward(loss_scale);
  std::vector<float> gc(n), gg(n, std::nanf(""));
  cpu.get_grads(gc.data());
  gpu.get_grads(gg.data());
  size_t nans = 0;
  for (float& x : gg) {
    nans += !std::isfinite(x);
    x = static_cast<float>(x / loss_scale);  // a power of two: exact
  }
  ASSERT_EQ(nans, 0u) << "non-finite GPU gradients (loss scale " << loss_scale << ")";
  // The layout's gap elements (alignment, and the vocabulary padding the GPU's MLM decoder runs over) stay zero.
  {
    std::vector<char> in_tensor(n, 0);
    for (const ParamTensor& t : gpu.layout().tensors()) std::fill_n(in_tensor.begin() + t.offset, t.numel, 1);
    size_t gap_nonzero = 0, gaps = 0;
    for (size_t i = 0; i < n; ++i)
      if (!in_tensor[i]) {
        ++gaps;
        gap_nonzero += gg[i] != 0.0f;
      }
    EXPECT_GT(gaps, 0u);
    EXPECT_EQ(gap_nonzero, 0u) << "GPU gradients written into the layout's gaps";
  }

  const double global_c = norm(gc.data(), n), global_g = norm(gg.data(), n);
  double dot = 0;
  for (size_t i = 0; i < n; ++i) dot += double(gc[i]) * gg[i];
  const double cosine = dot / (global_c * global_g);
  std::printf("    grad norm gpu %.6g cpu %.6g, cosine %.6f\n", global_g, global_c, cosine);
  EXPECT_NEAR(global_g, global_c, tol_global * global_c) << "global gradient norm";
  EXPECT_GT(cosine, min_cosine) << "cosine of the full gradient vectors";

  for (const ParamTensor& t : cpu.layout().tensors()) {
    const double nc = norm(gc.data() + t.offset, t.numel), ng = norm(gg.data() + t.offset, t.numel);
    EXPECT_NEAR(ng, nc, tol_tensor * nc + floor * global_c) << "gradient norm of " << t.name;
  }
}

BertConfig base_config() {
  return BertConfig::from_file(std::string(NOPAD_SOURCE_DIR) + "/data/configs/bert-base.json");
}

enum class Arch { kTiny, kWide, kBase };

struct ModelCase {
  const char* name;
  Arch arch;
  bool dropout;
  bool fp16 = false;  // GpuF16 instead of GpuBf16
  bool gelu_tanh = false;  // hidden_act "gelu_new": cuBLASLt's GELU epilogues on the GPU, the tanh twin on the CPU
};

class CudaModelTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(CudaModelTest, ForwardBackwardMatchCpu) {
  const ModelCase c = GetParam();
  BertConfig config = c.arch == Arch::kTiny ? tiny_config() : (c.arch == Arch::kWide ? wide_config() : base_config());
  if (c.gelu_tanh) config.hidden_act = "gelu_new";
  if (c.fp16)
    compare_models<ops::GpuF16>(config, c.dropout);
  else
    compare_models<ops::GpuBf16>(config, c.dropout);
}

INSTANTIATE_TEST_SUITE_P(Configs, CudaModelTest,
                         ::testing::Values(ModelCase{"tiny_no_dropout", Arch::kTiny, false},
                                           ModelCase{"tiny_dropout", Arch::kTiny, true},
                                           ModelCase{"h1024_no_dropout", Arch::kWide, false},
                                           ModelCase{"h1024_dropout", Arch::kWide, true},
                                           ModelCase{"bert_base_no_dropout", Arch::kBase, false},
                                           ModelCase{"bert_base_dropout", Arch::kBase, true},
                                           ModelCase{"fp16_tiny_no_dropout", Arch::kTiny, false, true},
                                           ModelCase{"fp16_tiny_dropout", Arch::kTiny, true, true},
                                           ModelCase{"fp16_h1024_no_dropout", Arch::kWide, false, true},
                                           ModelCase{"fp16_h1024_dropout", Arch::kWide, true, true},
                                           ModelCase{"fp16_bert_base_dropout", Arch::kBase, true, true},
                                           ModelCase{"gelu_tanh_h1024_dropout", Arch::kWide, true, false, true},
                                           ModelCase{"gelu_tanh_bert_base_dropout", Arch::kBase, true, false, true},
                                           ModelCase{"fp16_gelu_tanh_bert_base_dropout", Arch::kBase, true, true,
                                                     true}),
                         [](const ::testing::TestParamInfo<ModelCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace nopad
