// `nopad bench attention` on the GPU (attention_bench.h): random 16-bit q, k, v and d_ctx for each batch of real
// lengths, then for each dropout probability and schedule the median over `reps` event-timed calls of the forward,
// the backward and the pair. Before a schedule is timed its outputs are compared with the single launch's: ctx and
// lse bitwise (dropout masks and summation order do not depend on the schedule), so a schedule that drops or
// duplicates work cannot post a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/philox.h"
#include "ops/attention_groups.h"
#include "ops/cuda/attention_bench.h"
#include "ops/cuda/check.h"
#include "ops/cuda/fmha.h"

namespace nopad::cuda {
namespace {

template <class T>
struct Buf {
  T* ptr = nullptr;
  size_t count = 0;
  explicit Buf(size_t n) : count(n) {
    NOPAD_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~Buf() {
    if (ptr) cudaFree(ptr);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  size_t bytes() const { return count * sizeof(T); }
};

struct Schedule {
  ops::AttentionSchedule s;
  std::string label;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

std::vector<std::string> run_attention_bench_gpu(const AttentionBenchOptions& o,
                                                 const std::vector<std::vector<int32_t>>& batches) {
  NOPAD_CHECK(o.precision == "bf16" || o.precision == "fp16", "--precision must be bf16 or fp16, got ", o.precision);
  NOPAD_CHECK(o.heads >= 1 && (o.head_dim == 32 || o.head_dim == 64 || o.head_dim == 128),
              "--heads must be >= 1 and --head-dim 32, 64 or 128");
  NOPAD_CHECK(o.reps >= 1 && o.warmup >= 0, "--reps must be >= 1 and --warmup >= 0");
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  NOPAD_CHECK(err == cudaSuccess && count > 0, "bench attention needs a CUDA device (",
              err != cudaSuccess ? cudaGetErrorString(err) : "none visible", ")");
  cudaDeviceProp prop{};
  NOPAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const bool fp16 = o.precision == "fp16";

  std::vector<Schedule> schedules;
  for (const std::string& name : o.schedules) {
    const ops::AttentionMode mode = ops::parse_attention_mode(name);
    if (mode != ops::AttentionMode::kGrouped) {
      Schedule s;
      s.s.mode = mode;
      s.s.streams = 1;
      s.label = name;
      schedules.push_back(s);
      continue;
    }
    for (int bucket : o.buckets)
      for (int st : o.streams) {
        Schedule s;
        s.s.mode = mode;
        s.s.streams = st;
        s.s.bucket_tokens = bucket;
        ops::validate(s.s);
        s.label = name + "/" + std::to_string(st) + "s/b" + std::to_string(bucket);
        schedules.push_back(s);
      }
  }
  NOPAD_CHECK(!schedules.empty(), "bench attention: no schedule to time");

  cudaStream_t stream = nullptr;
  NOPAD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FmhaStreams streams(ops::AttentionSchedule::kMaxStreams);
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  NOPAD_CUDA_CHECK(cudaEventCreate(&ev0));
  NOPAD_CUDA_CHECK(cudaEventCreate(&ev1));
  std::vector<std::string> lines;
  std::fprintf(stderr, "%-5s %-6s %-18s %8s %8s %8s %10s %10s %s\n", "batch", "drop", "schedule", "fwd ms", "bwd ms",
               "f+b ms", "fwd TF/s", "f+b TF/s", "launches");

  for (size_t bi = 0; bi < batches.size(); ++bi) {
    const std::vector<int32_t>& lens = batches[bi];
    const auto B = static_cast<int32_t>(lens.size());
    std::vector<int32_t> cu(lens.size() + 1, 0);
    for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + lens[i];
    const int32_t T = cu.back();
    const int32_t max_len = *std::max_element(lens.begin(), lens.end());
    const int32_t H = o.heads * o.head_dim;
    std::vector<int32_t> order(lens.size());
    ops::order_by_length(cu.data(), B, order.data());
    std::vector<uint64_t> ids(lens.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = 1000003ull * (bi + 1) + i;

    // Inputs: N(0, 1) values rounded to 16 bits (scores of realistic spread), never zeros.
    std::mt19937_64 rng(o.seed * 7919 + bi);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> qkv_h(static_cast<size_t>(T) * 3 * H), dctx_h(static_cast<size_t>(T) * H);
    for (auto& x : qkv_h) x = fp16 ? to_f16(nd(rng)).bits : to_bf16(nd(rng)).bits;
    for (auto& x : dctx_h) x = fp16 ? to_f16(nd(rng)).bits : to_bf16(nd(rng)).bits;
    Buf<uint16_t> qkv(qkv_h.size()), ctx(static_cast<size_t>(T) * H), dctx(dctx_h.size()), dqkv(qkv_h.size());
    Buf<float> lse(static_cast<size_t>(o.heads) * T);
    Buf<int32_t> cu_d(cu.size()), order_d(order.size());
    Buf<uint64_t> ids_d(ids.size());
    Buf<unsigned char> ws(fmha_backward_workspace_bytes(T, o.heads, o.head_dim));
    Buf<float> bias(o.bias_grad ? static_cast<size_t>(3) * H : 0);  // summed into across calls: only timed
    NOPAD_CUDA_CHECK(cudaMemcpy(qkv.ptr, qkv_h.data(), qkv.bytes(), cudaMemcpyHostToDevice));
    NOPAD_CUDA_CHECK(cudaMemcpy(dctx.ptr, dctx_h.data(), dctx.bytes(), cudaMemcpyHostToDevice));
    NOPAD_CUDA_CHECK(cudaMemcpy(cu_d.ptr, cu.data(), cu_d.bytes(), cudaMemcpyHostToDevice));
    NOPAD_CUDA_CHECK(cudaMemcpy(order_d.ptr, order.data(), order_d.bytes(), cudaMemcpyHostToDevice));
    NOPAD_CUDA_CHECK(cudaMemcpy(ids_d.ptr, ids.data(), ids_d.bytes(), cudaMemcpyHostToDevice));

    FmhaParams p;
    p.qkv = qkv.ptr;
    p.ctx = ctx.ptr;
    p.lse = lse.ptr;
    p.d_ctx = dctx.ptr;
    p.d_qkv = dqkv.ptr;
    p.workspace = ws.ptr;
    p.workspace_bytes = ws.bytes();
    if (o.bias_grad) {
      NOPAD_CUDA_CHECK(cudaMemset(bias.ptr, 0, bias.bytes()));
      p.d_qkv_bias = bias.ptr;
    }
    p.cu_seqlens = cu_d.ptr;
    p.sample_ids = ids_d.ptr;
    p.num_seqs = B;
    p.num_launch_seqs = B;
    p.num_tokens = T;
    p.max_seqlen = max_len;
    p.num_heads = o.heads;
    p.head_dim = o.head_dim;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(o.head_dim)));
    p.seed = o.seed;
    p.step = 1;
    p.op_id = 1;
    p.fp16 = fp16;
    const double flops = attention_forward_flops(lens, o.heads, o.head_dim);

    // Median of reps event-timed calls of fn (each call bracketed on `stream`), after warm-up calls.
    const auto time_ms = [&](const auto& fn) {
      for (int i = 0; i < o.warmup; ++i) fn();
      std::vector<double> ms;
      for (int i = 0; i < o.reps; ++i) {
        NOPAD_CUDA_CHECK(cudaEventRecord(ev0, stream));
        fn();
        NOPAD_CUDA_CHECK(cudaEventRecord(ev1, stream));
        NOPAD_CUDA_CHECK(cudaEventSynchronize(ev1));
        float t = 0;
        NOPAD_CUDA_CHECK(cudaEventElapsedTime(&t, ev0, ev1));
        ms.push_back(t);
      }
      return median(ms);
    };
    const auto download_ctx_lse = [&](std::vector<uint16_t>& c, std::vector<float>& l) {
      NOPAD_CUDA_CHECK(cudaStreamSynchronize(stream));
      c.resize(ctx.count);
      l.resize(lse.count);
      NOPAD_CUDA_CHECK(cudaMemcpy(c.data(), ctx.ptr, ctx.bytes(), cudaMemcpyDeviceToHost));
      NOPAD_CUDA_CHECK(cudaMemcpy(l.data(), lse.ptr, lse.bytes(), cudaMemcpyDeviceToHost));
    };

    for (const double drop : o.dropouts) {
      p.dropout_p = static_cast<float>(drop);
      NOPAD_CHECK(attention_dropout_p_supported(p.dropout_p), "--dropout ", drop, " is outside [0, 1 - 2^-8]");
      std::vector<uint16_t> ref_ctx;
      std::vector<float> ref_lse;
      NOPAD_CUDA_CHECK(cudaMemsetAsync(ctx.ptr, 0xFF, ctx.bytes(), stream));
      fmha_forward(p, stream);
      download_ctx_lse(ref_ctx, ref_lse);
      for (const Schedule& sc : schedules) {
        ops::AttentionPlan plan;
        ops::plan_attention(cu.data(), order.data(), B, sc.s, plan);
        const auto fwd = [&] { fmha_forward_planned(p, order_d.ptr, plan, streams, stream); };
        const auto bwd = [&] { fmha_backward_planned(p, order_d.ptr, plan, streams, stream); };
        NOPAD_CUDA_CHECK(cudaMemsetAsync(ctx.ptr, 0xFF, ctx.bytes(), stream));  // poison: every row must be written
        NOPAD_CUDA_CHECK(cudaMemsetAsync(lse.ptr, 0xFF, lse.bytes(), stream));
        fwd();
        std::vector<uint16_t> c;
        std::vector<float> l;
        download_ctx_lse(c, l);
        const bool same = c == ref_ctx && std::memcmp(l.data(), ref_lse.data(), l.size() * sizeof(float)) == 0;
        NOPAD_CHECK(same, "bench attention: schedule ", sc.label, " computed a different ctx/lse than one launch (",
                    "batch ", bi, ", dropout ", drop, ")");
        const double f_ms = time_ms(fwd);
        const double b_ms = time_ms(bwd);
        const double fb_ms = time_ms([&] {
          fwd();
          bwd();
        });
        nlohmann::ordered_json j;
        j["bench"] = "attention";
        j["gpu"] = prop.name;
        j["precision"] = o.precision;
        j["batch_index"] = bi;
        j["seqs"] = B;
        j["tokens"] = T;
        j["max_len"] = max_len;
        j["mean_len"] = static_cast<double>(T) / B;
        j["heads"] = o.heads;
        j["head_dim"] = o.head_dim;
        j["dropout"] = drop;
        j["bias_grad"] = o.bias_grad;
        j["schedule"] = ops::attention_mode_name(sc.s.mode);
        j["streams"] = plan.num_streams;
        j["bucket"] = sc.s.mode == ops::AttentionMode::kGrouped ? sc.s.bucket_tokens : 0;
        j["launches"] = plan.num_groups;
        j["fwd_ms"] = f_ms;
        j["bwd_ms"] = b_ms;
        j["fwd_bwd_ms"] = fb_ms;
        j["fwd_tflops"] = flops / f_ms * 1e-9;
        j["fwd_bwd_tflops"] = 3.5 * flops / fb_ms * 1e-9;
        j["matches_single"] = same;
        lines.push_back(j.dump());
        std::fprintf(stderr, "%-5zu %-6.2f %-18s %8.4f %8.4f %8.4f %10.1f %10.1f %d on %d streams\n", bi, drop,
                     sc.label.c_str(), f_ms, b_ms, fb_ms, flops / f_ms * 1e-9, 3.5 * flops / fb_ms * 1e-9,
                     plan.num_groups, plan.num_streams);
      }

      // Every kernel variant on every length group (one stream, the first bucket width): which kernel suits which
      // lengths. Each launch alone, so the times add up to a grouped run without overlap.
      if (o.variants) {
        ops::AttentionSchedule gs;
        gs.mode = ops::AttentionMode::kGrouped;
        gs.streams = 1;
        gs.bucket_tokens = o.buckets.empty() ? 64 : o.buckets.front();
        ops::AttentionPlan plan;
        ops::plan_attention(cu.data(), order.data(), B, gs, plan);
        for (int g = 0; g < plan.num_groups; ++g) {
          const ops::AttentionGroup& gr = plan.groups[g];
          FmhaParams q = p;
          q.seq_index = order_d.ptr + gr.begin;
          q.num_launch_seqs = gr.count;
          q.max_seqlen = gr.max_seqlen;
          std::vector<int32_t> glens;
          for (int32_t i = gr.begin; i < gr.begin + gr.count; ++i) glens.push_back(lens[order[i]]);
          const double gflops = attention_forward_flops(glens, o.heads, o.head_dim);
          for (int fwd_pass = 1; fwd_pass >= 0; --fwd_pass) {
            const int nv = fwd_pass ? fmha_forward_variant_count() : fmha_backward_variant_count();
            for (int v = 0; v < nv; ++v) {
              FmhaParams r = q;
              r.fwd_variant = fwd_pass ? v : -1;
              r.bwd_variant = fwd_pass ? -1 : v;
              fmha_forward(r, stream);  // the backward reads the forward's ctx and lse
              const double ms = fwd_pass ? time_ms([&] { fmha_forward(r, stream); })
                                         : time_ms([&] { fmha_backward(r, stream); });
              nlohmann::ordered_json j;
              j["bench"] = "attention_variant";
              j["gpu"] = prop.name;
              j["batch_index"] = bi;
              j["dropout"] = drop;
              j["bias_grad"] = o.bias_grad;
              j["group"] = g;
              j["group_max_len"] = gr.max_seqlen;
              j["group_seqs"] = gr.count;
              j["pass"] = fwd_pass ? "fwd" : "bwd";
              j["variant"] = fwd_pass ? fmha_forward_variant_name(v) : fmha_backward_variant_name(v);
              j["variant_index"] = v;
              j["default"] = v == (fwd_pass ? fmha_forward_variant(q) : fmha_backward_variant(q));
              j["ms"] = ms;
              j["tflops"] = (fwd_pass ? 1.0 : 2.5) * gflops / ms * 1e-9;
              lines.push_back(j.dump());
              std::fprintf(stderr, "      group %d (%d seqs, max %d) %s variant %d %-7s %8.4f ms %7.1f TF/s%s\n", g,
                           gr.count, gr.max_seqlen, fwd_pass ? "fwd" : "bwd", v,
                           fwd_pass ? fmha_forward_variant_name(v) : fmha_backward_variant_name(v), ms,
                           (fwd_pass ? 1.0 : 2.5) * gflops / ms * 1e-9, j["default"].get<bool>() ? " (default)" : "");
            }
          }
        }
      }
    }
  }
  NOPAD_CUDA_CHECK(cudaEventDestroy(ev0));
  NOPAD_CUDA_CHECK(cudaEventDestroy(ev1));
  NOPAD_CUDA_CHECK(cudaStreamDestroy(stream));
  return lines;
}

}  // namespace nopad::cuda
