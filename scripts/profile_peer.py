"""Where a peer benchmark's step goes: runs a peer script (e.g. peer_torch_varlen.py) unchanged, with the PyTorch
profiler recording the GPU kernels of its timed loop (the span between the peer's two torch.cuda.synchronize() calls
around it), and prints the kernels grouped into the same categories as `nopad bench model --breakdown` (GEMMs,
attention, elementwise/normalisation, optimizer, other), in milliseconds per step, plus the top kernels.

    python3 scripts/profile_peer.py PEER.py --steps 6 [peer arguments ...]

The profiler adds host overhead to the peer's own seq/s line (ignore it); kernel times are the GPU's."""
import collections
import contextlib
import io
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

if len(sys.argv) < 2:
    sys.exit(__doc__)
peer, peer_args = sys.argv[1], sys.argv[2:]
steps = 10
for i, a in enumerate(peer_args):
    if a == "--steps" and i + 1 < len(peer_args):
        steps = int(peer_args[i + 1])

# The peer's timed loop is bracketed by "torch.cuda.synchronize(); t0 = time.time()" and
# "torch.cuda.synchronize(); dt = time.time() - t0"; the profiler is started and stopped there (torch.compile calls
# synchronize on its own during warm-up, so the calls themselves cannot mark the loop).
START = "torch.cuda.synchronize(); t0 = time.time()"
STOP = "torch.cuda.synchronize(); dt = time.time() - t0"
source = open(peer).read()
if source.count(START) != 1 or source.count(STOP) != 1:
    sys.exit(f"profile_peer: {peer} does not bracket its timed loop with '{START}' ... '{STOP}' exactly once; "
             "update START/STOP in this script to the peer's lines")
source = source.replace(START, START + "; _nopad_prof.__enter__()").replace(STOP, "_nopad_prof.__exit__(None, None, None); " + STOP)
prof = profile(activities=[ProfilerActivity.CUDA])
sys.path.insert(0, __import__("os").path.dirname(os.path.abspath(peer)))
sys.argv = [peer] + peer_args
captured = io.StringIO()  # the peer's own JSON line is slowed by the profiler: shown, but not as a JSON line
with contextlib.redirect_stdout(captured):
    exec(compile(source, peer, "exec"), {"__name__": "__main__", "__file__": peer, "_nopad_prof": prof})
for line in captured.getvalue().splitlines():
    print("peer output under the profiler (slower than its own run): " + line)


def category(name):
    n = name.lower()
    if "flash" in n or "fmha" in n or "attn" in n or "attention" in n or "cudnn" in n and "sdpa" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "sgemm", "hgemm")):
        return "gemm"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "triton" in n or "elementwise" in n or "layer_norm" in n or "reduce" in n or "softmax" in n:
        return "elementwise/norm/reduce"
    return "other"


totals = collections.Counter()
by_kernel = collections.Counter()
for ev in prof.events():
    if ev.device_type == torch.autograd.DeviceType.CUDA:
        us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        totals[category(ev.name)] += us
        by_kernel[ev.name] += us
total = sum(totals.values())
print(f"== kernel time per step by category ({steps} steps profiled, {total / steps / 1000:.1f} ms/step of kernels)")
for cat, us in totals.most_common():
    print(f"  {cat:28s} {us / steps / 1000:8.2f} ms/step  {100 * us / max(total, 1):5.1f}%")
print("== top kernels (ms/step)")
for name, us in by_kernel.most_common(30):
    print(f"  {us / steps / 1000:8.3f}  {name[:140]}")
print(json.dumps({"profile": peer, "steps": steps,
                  "ms_per_step": {k: v / steps / 1000 for k, v in totals.items()}}))
