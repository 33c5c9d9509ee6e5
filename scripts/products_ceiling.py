"""The matrix products of BERT-large training steps alone, timed on this GPU: what a step would take if everything
else (attention, LayerNorms, GELU, dropout, the optimizer, the losses) cost nothing.

For each step of a workload file (`length masked` lines in batch order, as `nopad bench model --workload` writes them),
it runs exactly the products that the FLOP count of docs/performance.md and the peers' common.model_flops counts,
on T = the step's real tokens and M = its masked tokens:
  per layer, forward: QKV [T,1024]x[1024,3072], output projection [T,1024]x[1024,1024], FFN-in [T,1024]x[1024,4096],
  FFN-out [T,4096]x[4096,1024]; backward: for each of them dX = dY W^T and dW = X^T dY;
  MLM head: transform [M,1024]x[1024,1024] and decoder [M,1024]x[1024,30522], forward and both backward products.
bf16 operands (cuBLAS through torch.mm, fp32 accumulation), outputs written into preallocated tensors (no allocation
in the timed loop), operands filled with random values (not zeros: a GPU at its power cap draws less on zeros and
would clock higher). 24 layers with their own weights.

Prints one JSON line: products_ms per step (mean over the timed steps, CUDA events), their TFLOP/s, and
seqs_per_s_bound = batch / products time: no BERT-large implementation whose products run at these rates can train
faster on this GPU. Usage (GPU machine): python3 scripts/products_ceiling.py --lengths workload-160.txt --batch 160
"""
import argparse
import json

import torch

H, L, FF, V = 1024, 24, 4096, 30522


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", required=True, help="workload file: one 'length masked' line per sequence")
    ap.add_argument("--batch", type=int, required=True, help="sequences per step (the file's batch size)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (taken from the file, in order)")
    a = ap.parse_args()

    rows = []
    with open(a.lengths) as f:
        for i, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise SystemExit(f"{a.lengths}:{i}: expected 'length masked', got {line.strip()!r}")
            rows.append((int(parts[0]), int(parts[1])))
    if a.batch <= 0 or len(rows) < a.batch:
        raise SystemExit(f"{a.lengths}: {len(rows)} sequences, fewer than one batch of {a.batch}")
    steps = [rows[i:i + a.batch] for i in range(0, len(rows) - a.batch + 1, a.batch)]
    if len(steps) <= a.warmup:
        raise SystemExit(f"{a.lengths}: {len(steps)} steps of {a.batch}, need more than --warmup {a.warmup}")
    tm = [(sum(n for n, _ in s), sum(m for _, m in s)) for s in steps]
    t_max = max(t for t, _ in tm)
    m_max = max(m for _, m in tm)

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape):
        return (torch.randn(*shape, device=dev, dtype=torch.float32) * 0.05).to(bf)

    # Weights stored [in, out]: forward X W, backward dX = dY W^T, dW = X^T dY.
    shapes = [(H, 3 * H), (H, H), (H, FF), (FF, H)]
    weights = [[rnd(k, n) for k, n in shapes] for _ in range(L)]
    grads = [[torch.empty(k, n, device=dev, dtype=bf) for k, n in shapes] for _ in range(L)]
    # Activations: one input and one output buffer per width, reused across layers (each is far larger than the L2,
    # so reuse does not flatter the rates).
    x_in = {k: rnd(t_max, k) for k in (H, FF)}
    y_out = {n: torch.empty(t_max, n, device=dev, dtype=bf) for n in (H, 3 * H, FF)}
    dy_in = {n: rnd(t_max, n) for n in (H, 3 * H, FF)}
    dx_out = {k: torch.empty(t_max, k, device=dev, dtype=bf) for k in (H, FF)}
    # MLM head: the transform [H, H] and the decoder [H, V], each with its own output and gradient buffers.
    head = [(rnd(H, n), torch.empty(H, n, device=dev, dtype=bf), torch.empty(m_max, n, device=dev, dtype=bf),
             rnd(m_max, n)) for n in (H, V)]
    m_x, m_dx = rnd(m_max, H), torch.empty(m_max, H, device=dev, dtype=bf)

    def step(t, m):
        for layer in range(L):
            for (k, n), w, g in zip(shapes, weights[layer], grads[layer]):
                torch.mm(x_in[k][:t], w, out=y_out[n][:t])             # forward
                torch.mm(dy_in[n][:t], w.t(), out=dx_out[k][:t])       # dX
                torch.mm(x_in[k][:t].t(), dy_in[n][:t], out=g)         # dW
        for w, g, y, dy in head:
            torch.mm(m_x[:m], w, out=y[:m])
            torch.mm(dy[:m], w.t(), out=m_dx[:m])
            torch.mm(m_x[:m].t(), dy[:m], out=g)

    def flops(t, m):
        return 3 * 2 * (t * L * (4 * H * H + 2 * H * FF) + m * (H * H + H * V))

    for t, m in tm[:a.warmup]:
        step(t, m)
    torch.cuda.synchronize()
    timed = tm[a.warmup:]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for t, m in timed:
        step(t, m)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / len(timed)
    tflop = sum(flops(t, m) for t, m in timed) / len(timed) / 1e12
    print(json.dumps({
        "bench": "products_ceiling", "gpu": torch.cuda.get_device_name(), "batch": a.batch, "steps": len(timed),
        "warmup": a.warmup, "mean_tokens": sum(t for t, _ in timed) / len(timed),
        "mean_masked": sum(m for _, m in timed) / len(timed), "products_tflop_per_step": tflop,
        "products_ms": ms, "products_tflops": tflop / ms * 1e3, "seqs_per_s_bound": a.batch / ms * 1e3}))


if __name__ == "__main__":
    main()
