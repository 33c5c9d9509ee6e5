"""PyTorch's attention kernels on fixed-length batches (every sequence the same length, so no padding and no
variable-length bookkeeping): what the libraries reach on their easiest input, to set beside `nopad bench attention
--lengths` on a file of equal lengths. BERT-large heads by default (16 x 64), bf16, dropout 0, non-causal.

Times, per kernel: the forward alone and forward + backward (dQ, dK, dV), the median of --reps calls after --warmup,
each call between CUDA events; TFLOP/s counts the forward as 4 L^2 d per head and sequence and forward + backward as
3.5x that (the convention of `nopad bench attention`). Kernels: scaled_dot_product_attention with each backend that
accepts the input (flash, cuDNN, memory-efficient) on [batch, heads, L, d], and torch.nn.attention.varlen's
varlen_attn on the same tokens packed as [batch * L, heads, d] with equal cu_seqlens. Inputs are random (not zeros).
One JSON line per kernel. Usage (GPU machine): python3 scripts/attention_libs.py --batch 64 --seqlen 512
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64, help="sequences")
    ap.add_argument("--seqlen", type=int, default=512, help="tokens per sequence (all equal)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if min(a.batch, a.seqlen, a.heads, a.head_dim, a.reps) <= 0 or a.warmup < 0:
        raise SystemExit("attention_libs.py: sizes and --reps must be positive, --warmup not negative")

    torch.manual_seed(0)
    B, L, NH, D = a.batch, a.seqlen, a.heads, a.head_dim
    fwd_flop = 4.0 * L * L * D * NH * B

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    q, k, v, do = (rnd(B, NH, L, D) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def report(kernel, fwd_ms, fb_ms, **extra):
        print(json.dumps({"bench": "attention_libs", "kernel": kernel, "gpu": torch.cuda.get_device_name(),
                          "batch": B, "seqlen": L, "heads": NH, "head_dim": D, "dropout": 0.0,
                          "fwd_ms": fwd_ms, "fwd_tflops": fwd_flop / fwd_ms / 1e9,
                          "fwd_bwd_ms": fb_ms, "fwd_bwd_tflops": 3.5 * fwd_flop / fb_ms / 1e9, **extra}), flush=True)

    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v)

                def fwd_bwd():
                    out = F.scaled_dot_product_attention(q, k, v)
                    torch.autograd.grad(out, (q, k, v), do)

                report(name, timed(fwd, a.warmup, a.reps), timed(fwd_bwd, a.warmup, a.reps))
        except RuntimeError as e:  # a backend that does not take this input (or this build lacks it)
            print(json.dumps({"bench": "attention_libs", "kernel": name, "error": str(e).splitlines()[0][:200]}),
                  flush=True)

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        print(json.dumps({"bench": "attention_libs", "kernel": "varlen_attn", "error": str(e)}), flush=True)
        return
    qp, kp, vp, dop = (t.detach().transpose(1, 2).reshape(B * L, NH, D).contiguous() for t in (q, k, v, do))
    for t in (qp, kp, vp):
        t.requires_grad_(True)
    cu = torch.arange(0, (B + 1) * L, L, device="cuda", dtype=torch.int32)

    def vfwd():
        with torch.no_grad():
            varlen_attn(qp, kp, vp, cu, cu, L, L)

    def vfwd_bwd():
        out = varlen_attn(qp, kp, vp, cu, cu, L, L)
        torch.autograd.grad(out, (qp, kp, vp), dop)

    report("varlen_attn", timed(vfwd, a.warmup, a.reps), timed(vfwd_bwd, a.warmup, a.reps))


if __name__ == "__main__":
    main()
